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
all of them, but not the compiler's attention to every method that gets warm: at
1 GB the JIT's threads used 25-33 s of the JVM's 75-90 s of CPU, on the same two
cores as the tasks. Four times the usual thresholds
(``-XX:CompileThresholdScaling=4``) leave it the methods that stay hot, smaller
inlining limits for the optimising compiler (``-XX:FreqInlineSize=100
-XX:InlineSmallCode=1000``, against 325 and 2500) make each of its compilations
cheaper (a third less compiler CPU; the tasks' own CPU did not grow), and the
throughput collector (``-XX:+UseParallelGC``) runs no concurrent marking threads.
Per-subject percentiles keep their hash aggregation for up to 65,536 subjects a
task (``spark.sql.objectHashAggregate.sortBased.fallbackThreshold``, 128 by
default, past which Spark sorts every row of the task; the buffers are bounded
by the task's rows either way).

A local JVM also maps the Spark classes it loaded last time from a class-data
sharing archive (:func:`cds_options`): loading and verifying some 15,000
classes from 280 jars is a third of the CPU a small report costs. The first
run on a machine writes the archive when its JVM exits; later runs start from
it. A small report also runs the serial garbage collector (no concurrent GC
threads competing for two cores on a heap that stays small).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence

import pyspark
from pyspark.sql import SparkSession

__all__ = [
    "CDS_ENV",
    "DEFAULT_MASTER",
    "SMALL_INPUT",
    "build_session",
    "cds_options",
    "input_bytes",
    "session_settings",
]

# the package's JVM line parser (spark/java, built by `make jar`); without it the logs are parsed by from_json
JAR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jars", "migratory-spark.jar")
# MIGRATORY_SPARK_JAR=0 leaves it out (the from_json parser, e.g. to compare the two)
JAR_ENV = "MIGRATORY_SPARK_JAR"

# what turns an on-by-default MIGRATORY_SPARK_* variable off
_OFF = ("0", "false", "no", "off")

# MIGRATORY_SPARK_CDS=0 turns the class-data sharing archive off; a path puts it in that folder
CDS_ENV = "MIGRATORY_SPARK_CDS"
_CDS_QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
_CDS_MAGIC = 0xF00BABA8  # HotSpot's dynamic archive, written last: a half-written file does not have it

DEFAULT_MASTER = "local[*]"
SMALL_INPUT = 64 * 1024 * 1024
# a large local report: throughput GC, and the JIT compiling only what stays hot (see the module's docstring)
_LARGE_JVM = "-XX:+UseParallelGC -XX:CompileThresholdScaling=4 -XX:FreqInlineSize=100 -XX:InlineSmallCode=1000"
# another installation's archive (another venv, Java or Spark) is removed once unused this long
_CDS_STALE = 14 * 86400


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


def _cds_dir() -> str | None:
    chosen = os.environ.get(CDS_ENV, "")
    if chosen.lower() in _OFF:
        return None
    if chosen and chosen.lower() not in ("1", "true", "yes", "on"):
        return chosen
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "migratory", "spark-cds")


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(found) if found and os.path.exists(found) else None


def _spark_home() -> str:
    return os.environ.get("SPARK_HOME") or os.path.dirname(os.path.abspath(pyspark.__file__))


def _plain_classpath(spark_home: str) -> bool:
    """CDS refuses a class path with a non-empty folder (spark-submit adds the conf folders when they exist)."""
    folders = [os.environ.get("SPARK_CONF_DIR") or os.path.join(spark_home, "conf")]
    folders += [os.environ.get(name, "") for name in ("HADOOP_CONF_DIR", "YARN_CONF_DIR")]
    if os.environ.get("SPARK_DIST_CLASSPATH") or os.environ.get("SPARK_CLASSPATH"):
        return False
    return not any(folder and os.path.isdir(folder) and os.listdir(folder) for folder in folders)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _complete(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError:
        return False
    return len(head) == 4 and int.from_bytes(head, sys.byteorder) == _CDS_MAGIC


def cds_options(extra: Sequence[str] = ()) -> tuple[str, str | None]:
    """JVM options for the class-data sharing archive of this Java and Spark, and the file a new archive goes to.

    Returns ``-XX:SharedArchiveFile=...`` when the archive exists, else (once per
    machine, unless another JVM is writing one) ``-XX:ArchiveClassesAtExit=`` a
    temporary file that the next call checks (its JVM gone, its header written)
    and renames into place; ``("", None)`` when it cannot be used (turned off
    with ``MIGRATORY_SPARK_CDS=0``, no writable cache, a class path with
    folders). ``extra`` (the driver's extra class path) is part of the key.
    Archives of other installations (another venv, Java or Spark) sharing the
    cache are kept until unused for two weeks: removing them on sight made two
    installations on one machine delete each other's archive on every run.
    """
    folder, java, home = _cds_dir(), _java(), _spark_home()
    if folder is None or java is None or not _plain_classpath(home) or any(extra):
        return "", None
    try:
        jars = os.path.join(home, "jars")
        stamp = [pyspark.__version__, home, java, str(os.stat(java).st_mtime_ns), str(os.stat(jars).st_mtime_ns)]
        key = hashlib.sha256("\0".join(stamp).encode()).hexdigest()[:16]
        os.makedirs(folder, exist_ok=True)
        final = os.path.join(folder, f"spark-{key}.jsa")
        if os.path.exists(final):
            with contextlib.suppress(OSError):  # a shared archive this user may read but not touch is still used
                os.utime(final)  # in use: another installation's clean-up keeps it
            return f"-XX:SharedArchiveFile={final} {_CDS_QUIET}", None
        writing = False
        for pending in glob.glob(os.path.join(folder, f"spark-{key}.*.jsa")):
            writer = int(pending.rsplit(".", 2)[1].split("-")[0])
            if _complete(pending) and not _alive(writer):
                os.replace(pending, final)
            elif _alive(writer) or time.time() - os.path.getmtime(pending) < 120:
                writing = True  # its JVM writes it after the Python process ends, the header last
            else:
                os.remove(pending)  # a JVM killed while writing
        for old in glob.glob(os.path.join(folder, "spark-*.jsa")):
            mine = os.path.basename(old).startswith(f"spark-{key}")
            if not mine and time.time() - os.path.getmtime(old) > _CDS_STALE:
                os.remove(old)  # another Java's or Spark's, unused for two weeks (an upgrade left it behind)
        if os.path.exists(final):
            return f"-XX:SharedArchiveFile={final} {_CDS_QUIET}", None
        if writing or not os.access(folder, os.W_OK):
            return "", None
        # the JVM writes it when it exits (the Python process ends); named after that process (checked alive)
        pending = os.path.join(folder, f"spark-{key}.{os.getpid()}-{time.monotonic_ns()}.jsa")
        return f"-XX:ArchiveClassesAtExit={pending} {_CDS_QUIET}", pending
    except (OSError, ValueError):
        return "", None


def _local(master: str | None) -> bool:
    return master is not None and master.startswith("local")


def session_settings(master: str | None, input_size: int | None = None) -> dict[str, str]:
    """The Spark settings :func:`build_session` starts with (before the caller's ``conf``), by master and input size."""
    settings = {
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.ansi.enabled": "true",
        "spark.sql.adaptive.enabled": "true",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.extraJavaOptions": "-Duser.timezone=UTC",
        "spark.executor.extraJavaOptions": "-Duser.timezone=UTC",
    }
    if _local(master):
        # one machine: a few shuffle partitions beat Spark's 200 tiny ones
        settings["spark.sql.shuffle.partitions"] = str(max(4, 2 * (os.cpu_count() or 2)))
        settings["spark.ui.enabled"] = "false"
        if os.path.isfile(JAR) and os.environ.get(JAR_ENV, "").lower() not in _OFF:
            # the driver loads it (under spark-submit, pass it with --jars: see docs/analytics.md)
            settings["spark.jars"] = JAR
        # embedded: the driver talks to itself only, never on the machine's public address
        settings["spark.driver.host"] = "127.0.0.1"
        settings["spark.driver.bindAddress"] = "127.0.0.1"
        # the parsed logs are cached in the driver's own memory: skip compressing them (a tenth of the
        # parse's time); MEMORY_AND_DISK spills what does not fit
        settings["spark.sql.inMemoryColumnarStorage.compressed"] = "false"
        # percentile_approx per subject: a hash aggregation past Spark's 128 keys a task, not a sort of every row
        settings["spark.sql.objectHashAggregate.sortBased.fallbackThreshold"] = "65536"
        if input_size is not None and input_size < SMALL_INPUT:
            settings["spark.driver.extraJavaOptions"] += " -XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
            settings["spark.sql.codegen.wholeStage"] = "false"
            settings["spark.sql.codegen.factoryMode"] = "NO_CODEGEN"
            settings["spark.sql.adaptive.enabled"] = "false"
            settings["spark.sql.shuffle.partitions"] = "1"
        else:
            settings["spark.driver.extraJavaOptions"] += " " + _LARGE_JVM
    return settings


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
    local = _local(master)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable if local else "python3")
    builder = SparkSession.builder.appName(app_name)
    if master:
        builder = builder.master(master)
    if local:
        # before the JVM starts: keeps Spark from resolving (and warning about) a public address
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings = session_settings(master, input_size)
    chosen = dict(conf or {})
    cds = ""
    if local and "spark.driver.extraJavaOptions" not in chosen:
        cds, _ = cds_options([chosen.get("spark.driver.extraClassPath", "")])
    if "spark.jars" in settings and chosen.get("spark.jars"):
        chosen["spark.jars"] = settings["spark.jars"] + "," + chosen["spark.jars"]  # theirs and ours
    settings.update(chosen)
    if cds:
        settings["spark.driver.extraJavaOptions"] += " " + cds
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception:
        if not cds:
            raise
        # the archive must never keep Spark from starting: without it, and without it next time
        if "SharedArchiveFile=" in cds:
            archive = cds.split("SharedArchiveFile=", 1)[1].split()[0]
            with contextlib.suppress(OSError):
                os.remove(archive)
        plain = settings["spark.driver.extraJavaOptions"].replace(" " + cds, "")
        spark = builder.config("spark.driver.extraJavaOptions", plain).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
