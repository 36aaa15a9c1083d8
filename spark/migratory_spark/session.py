"""The SparkSession every job runs in: UTC, ANSI mode on, sized for the master.

The time zone is pinned to UTC because the logs are UTC and per-day partitions
must not move with the driver's locale. ANSI mode stays on (Spark 4's default)
so an overflow or a bad cast fails loudly instead of becoming a silent null;
the jobs use ``try_*`` functions where a null is the intended answer.

In local mode the session is set up for the size of the input. A small report
(below :data:`SMALL_INPUT`) is a few dozen queries over little data, whose time
goes into compiling, not computing: the JVM's just-in-time compiler stops at its
quick first tier (``-XX:TieredStopAtLevel=1``), expressions are interpreted
instead of compiled to Java classes one by one (``spark.sql.codegen.factoryMode``
``NO_CODEGEN``, no whole-stage code generation: hundreds of Janino compilations
saved; ``factoryMode`` is an internal setting, checked against its values and
honoured by Spark 4.3's code generators: the interpreted path gave the same
tables on generated logs), and each shuffle has one partition and a fixed plan
(no adaptive execution re-planning every query in several jobs). A large report
spends its time in a few hot loops (the JSON parser, the aggregations) that need
all of them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from pyspark.sql import SparkSession

__all__ = ["DEFAULT_MASTER", "SMALL_INPUT", "build_session", "input_bytes"]

DEFAULT_MASTER = "local[*]"
SMALL_INPUT = 64 * 1024 * 1024


def input_bytes(dirs: Sequence[str]) -> int | None:
    """Bytes of access, message and stats logs in local folders (None if a folder is remote or missing)."""
    from migratory_spark.reader import log_files

    total = 0
    try:
        for name in ("access.log", "message.log", "stats.log"):
            for paths in log_files(dirs, name)[0].values():
                for path in paths:
                    if not path.startswith("file://"):
                        return None
                    total += os.path.getsize(path.removeprefix("file://"))
    except OSError:
        return None
    return total


def build_session(
    master: str | None = DEFAULT_MASTER,
    app_name: str = "migratory-logs",
    conf: Mapping[str, str] | None = None,
    input_size: int | None = None,
) -> SparkSession:
    """Create (or reuse) the session; ``master=None`` keeps what spark-submit chose.

    ``input_size`` (bytes of logs, see :func:`input_bytes`) tunes a local JVM to it.
    """
    # Python workers: in local mode this very interpreter (an installed appliance has no python3 on the
    # service's PATH, only its venv's); on a cluster, the executors' own python3
    local = master is not None and master.startswith("local")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable if local else "python3")
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    settings = {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.ansi.enabled": "true",
        "spark.sql.adaptive.enabled": "true",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
        "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
    }
    if master and master.startswith("local"):
        # before the JVM starts: keeps Spark from resolving (and warning about) a public address
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        # one machine: a few shuffle partitions beat Spark's 200 tiny ones
        settings["spark.sql.shuffle.partitions"] = str(max(4, 2 * (os.cpu_count() or 2)))
        settings["spark.ui.enabled"] = "false"
        # embedded: the driver talks to itself only, never on the machine's public address
        settings["spark.driver.host"] = "127.0.0.1"
        settings["spark.driver.bindAddress"] = "127.0.0.1"
        # the parsed logs are cached in the driver's own memory: skip compressing them (a tenth of the
        # parse's time); MEMORY_AND_DISK spills what does not fit
        settings["spark.sql.inMemoryColumnarStorage.compressed"] = "false"
        if input_size is not None and input_size < SMALL_INPUT:
            settings["spark.driver.extraJavaOptions"] += " -XX:TieredStopAtLevel=1"
            settings["spark.sql.codegen.wholeStage"] = "false"
            settings["spark.sql.codegen.factoryMode"] = "NO_CODEGEN"
            settings["spark.sql.adaptive.enabled"] = "false"
            settings["spark.sql.shuffle.partitions"] = "1"
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
