"""Read access.log, message.log and stats.log (their rotations, gzipped or not) into typed frames.

Lines are split on ``\\n`` only (a stray ``\\r`` stays inside its line) and each one
must be exactly one JSON object of the explicit schema. A line that is not JSON,
is an array (``[{...},{...}]``, ``[]``), holds more than one value (``{...}{...}``,
``{...} xyz``), has a wrongly typed field, no parseable ``ts``, no ``event`` or an
unknown schema version is *corrupt*: it is counted per node and file kind, an
example is kept, and it is left out of every analysis, never fatal. Blank lines
are ignored.

Two parsers apply these rules alike (tests/test_spark_jar.py). The package's JVM
parser (spark/java, ``make jar``) hands Jackson the line's bytes, reads the object
and asks for one more token, which must be the line's end. Without its jar,
Spark's ``from_json`` parses the line wrapped as ``{"r":[LINE]}`` (a list of
exactly one object; anything after the object breaks the wrapper unless it starts
by closing it with ``]``), and only a line holding a ``]`` has its tokens read a
second time, wrapped as ``{"r":LINE}`` (which that ``]`` breaks).

Every directory given is one node; the node is kept on each row so that session
ids (unique per node only) are keyed by node. The parse is persisted, with only
the columns the analyses read, so every analysis starts from it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, IntegerType, StringType, StructField, StructType

from migratory_spark import SCHEMA_VERSION
from migratory_spark.schema import ACCESS_SCHEMA, CORRUPT, MESSAGE_SCHEMA, STATS_INDICATORS, STATS_SCHEMA

__all__ = [
    "ACCESS_COLUMNS",
    "COMPRESSED",
    "EXAMPLE_CHARS",
    "MESSAGE_COLUMNS",
    "STATES",
    "STATS_COLUMNS",
    "LogFrames",
    "corrupt_rows",
    "escape_example",
    "log_files",
    "log_paths",
    "parse_lines",
    "read_logs",
]

# what Spark decompresses by itself (Hadoop codecs, chosen by the file name)
COMPRESSED = (".gz", ".bz2")
# the stored example of a corrupt line: at most this many characters, escaped
EXAMPLE_CHARS = 200
_EXAMPLE_BYTES = 4 * EXAMPLE_CHARS

# the parsed columns kept (persisted) for the analyses, besides node, time, second
ACCESS_COLUMNS = (
    "event",
    "session",
    "addr",
    "listener",
    "protocol",
    "tls",
    "duration_ms",
    "reason",
    "subject",
    "request",
    "reason_code",
    "method",
    "path",
    "status",
    "bytes_out",
)
MESSAGE_COLUMNS = ("subject", "size", "status", "recipients", "bytes_out", "latency_us", "sampling")
# stats.log: all of it (its ``node``, the server's name for itself, becomes ``server``)
STATS_COLUMNS = ("node", "epoch", "uptime_s", "history_s", *STATS_INDICATORS, "totals", "denied")


@dataclass(frozen=True)
class LogFrames:
    """The parsed logs: good access, message and stats rows in the period, and what was left out.

    ``overview`` has one row per file kind, node, state (``good``, ``outside`` the
    period, ``corrupt``) and event with ``lines`` and the ``first``/``last`` second,
    and one more per kind and node with corrupt lines, with only their ``example``
    (the raw bytes of the smallest one, cut). One collect of it reads and persists
    the logs and answers every count.
    """

    access: DataFrame
    messages: DataFrame
    stats: DataFrame  # node (the folder), server (the line's node), time, second, the rest of STATS_COLUMNS
    corrupt: DataFrame  # kind, node, lines, example (raw bytes; see corrupt_rows)
    overview: DataFrame
    skipped: list[str] = field(default_factory=list)
    persisted: tuple[DataFrame, ...] = ()

    def unpersist(self) -> None:
        for frame in self.persisted:
            frame.unpersist()


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _is_rotation(entry: str, name: str) -> bool:
    """``NAME`` or ``NAME.N``, either possibly compressed (``.gz``, ``.bz2``)."""
    for suffix in COMPRESSED:
        if entry.endswith(suffix):
            entry = entry[: -len(suffix)]
            break
    return entry == name or (entry.startswith(name + ".") and entry[len(name) + 1 :].isdigit())


def log_files(dirs: Sequence[str], name: str) -> tuple[dict[str, list[str]], list[str]]:
    """Per node (its folder): ``NAME``, ``NAME.N`` and their ``.gz``/``.bz2``; and the ``NAME.*`` files skipped.

    A local node is named by its absolute path; remote folders (``hdfs://``,
    ``s3a://``) are globbed by Spark, never listed here.
    """
    out: dict[str, list[str]] = {}
    skipped: list[str] = []
    for folder in dirs:
        if _is_remote(folder):
            base = folder.rstrip("/")
            # NAME.N.gz matches the first pattern too
            out.setdefault(base, []).extend([f"{base}/{name}{{,.[0-9]*}}", f"{base}/{name}{{.gz,.bz2}}"])
            continue
        local = folder.removeprefix("file://")
        if not os.path.isdir(local):
            raise FileNotFoundError(f"{folder}: not a directory")
        node = os.path.abspath(local)
        files = out.setdefault(node, [])
        for entry in sorted(os.listdir(local)):
            path = os.path.join(node, entry)
            if _is_rotation(entry, name):
                if os.path.isfile(path) and os.path.getsize(path) > 0:
                    files.append("file://" + path)
            elif entry.startswith(name + "."):
                skipped.append(path)
    return {node: files for node, files in out.items() if files}, skipped


def log_paths(dirs: Sequence[str], name: str) -> list[str]:
    """The files (or, for remote folders, the globs) read for ``NAME`` in every directory."""
    return [path for paths in log_files(dirs, name)[0].values() for path in paths]


def _timestamp(ts: Column) -> Column:
    """``2026-11-22T15:04:05.123Z`` (``TS_FORMAT`` exactly) -> timestamp, anything else -> null.

    Spark's own ISO 8601 cast, guarded by the shape: far cheaper than a formatter per line. The guard
    counts bytes, not characters (a character that is not ASCII fails the cast anyway), and tests the
    last one without copying it: a third of the cost of the old guard, which cost more than the cast.
    """
    shaped = (
        (F.octet_length(ts) == 24)
        & ts.endswith("Z")
        & (F.substring(ts, 11, 1) == "T")
        & (F.substring(ts, 20, 1) == ".")
    )
    return F.when(shaped, ts.try_cast("timestamp"))


# the JVM-side parser shipped with the package (spark/java, built into migratory_spark/jars)
JSON_LINES_CLASS = "migratory.spark.JsonLines"


_warned: set[str] = set()


def jvm_parser(spark: SparkSession) -> Any | None:
    """The package's JVM line parser when its jar is on the session's class path (see :mod:`session`) and
    was built for this Spark, else None; a jar built for another Spark is named once on standard error."""
    from py4j.java_gateway import JavaClass  # type: ignore[import-untyped]

    found = spark._jvm
    for part in JSON_LINES_CLASS.split("."):
        found = getattr(found, part)
    if not isinstance(found, JavaClass):
        return None
    built = str(found.sparkVersion())
    if built != spark.version:
        if built not in _warned:
            _warned.add(built)
            print(
                f"migratory-spark.jar was built for Spark {built}, this is {spark.version}: "
                "parsing with from_json (rebuild it: make jar)",
                file=sys.stderr,
            )
        return None
    return found


def parse_lines(
    lines: DataFrame, schema: StructType, keep: Sequence[str] | None = None, jvm: bool | None = None
) -> DataFrame:
    """Text lines (``value``) -> the other columns of ``lines``, the schema's fields in ``keep`` (all by
    default; every field is checked either way), ``time``, the flags ``blank`` (nothing but whitespace: to
    be ignored) and ``bad`` (corrupt), ``example`` (a corrupt line's first bytes) and ``second``. A
    corrupt line has no time; its fields are not to be read.

    Two parsers apply the same rules (tested side by side): the package's JVM one, which hands Jackson the
    line's bytes (``jvm=None`` takes it when its jar is loaded), and Spark's ``from_json`` (``jvm=False``,
    or no jar). Nothing here filters: a filter on a parsed column would be pushed below ``from_json`` by the
    optimiser and parse every line twice.
    """
    fields = [f for f in schema.fields if f.name != CORRUPT]
    kept = [f.name for f in fields] if keep is None else list(keep)
    others = [name for name in lines.columns if name != "value"]
    spark = lines.sparkSession
    parser = None if jvm is False else jvm_parser(spark)
    if jvm and parser is None:
        raise RuntimeError(f"{JSON_LINES_CLASS} is not on the class path (build it with: make jar)")
    if parser is not None:
        java_schema = spark._jsparkSession.parseDataType(StructType(fields).json())
        # a Python list arrives as a java.util.List (PySpark's gateway converts it)
        parsed = DataFrame(parser.parse(lines._jdf, java_schema, kept, SCHEMA_VERSION, _EXAMPLE_BYTES), spark)
        return parsed.withColumn("second", F.unix_seconds("time"))
    wrapped = StructType([StructField("r", ArrayType(StructType(fields))), StructField(CORRUPT, StringType())])
    value = F.col("value")
    options = {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT}
    parsed_json = F.from_json(F.concat(F.lit('{"r":['), value, F.lit("]}")), wrapped, options)
    # a line with a "]" could close the wrapper above early: read its tokens in the other wrapper too, with
    # the same JSON options (contains, not instr: a first-byte scan, not a comparison at every character)
    as_text = StructType([StructField("r", StringType()), StructField(CORRUPT, StringType())])
    closed = F.from_json(F.concat(F.lit('{"r":'), value, F.lit("}")), as_text, options).getField(CORRUPT).isNull()
    single = F.when(value.contains("]"), closed).otherwise(F.lit(True))
    count = F.size("_p.r")
    rows = (
        lines.select("*", parsed_json.alias("_p"))
        .select("*", F.try_element_at("_p.r", F.lit(1)).alias("_r"))
        .select(
            *lines.columns,
            "_r.*",  # every field of the schema under its own name (one call, not three per field)
            F.col("_p").getField(CORRUPT).isNotNull().alias("_malformed"),
            ((F.coalesce(count, F.lit(0)) != 1) | F.col("_r").isNull()).alias("_missing"),
            single.alias("_single"),
            # nothing but JSON whitespace inside the wrapper (cheaper than trimming every line)
            (F.col("_p").getField(CORRUPT).isNull() & (F.coalesce(count, F.lit(-1)) == 0)).alias("blank"),
        )
        .withColumn("time", _timestamp(F.col("ts")))
    )
    bad = ~F.col("blank") & (
        F.col("_malformed")
        | F.col("_missing")
        | ~F.col("_single")
        | F.col("time").isNull()
        | F.col("event").isNull()
        | F.col("v").isNull()
        | (F.col("v") != SCHEMA_VERSION)
    )
    example = F.when(F.col("bad"), F.substring(value.cast("binary"), 1, _EXAMPLE_BYTES))
    # a corrupt line has no time (nor fields to read: the JVM parser leaves those of a malformed one null)
    return rows.withColumn("bad", bad).select(
        *others,
        *kept,
        F.when(~F.col("bad"), F.col("time")).alias("time"),
        "blank",
        "bad",
        example.alias("example"),
        F.unix_seconds(F.when(~F.col("bad"), F.col("time"))).alias("second"),
    )


def _parsed_schema(schema: StructType, keep: Sequence[str]) -> StructType:
    """The schema without the string fields no analysis reads.

    Spark turns any JSON value into a string (an object or a number as its JSON text), so such a field
    never makes a line corrupt: left out, its value is skipped instead of copied into a string on
    every line. Typed fields stay, read or not: a wrongly typed one makes its line corrupt.
    """
    needed = {*keep, "v", "ts", "event", CORRUPT}
    return StructType([f for f in schema.fields if f.name in needed or not isinstance(f.dataType, StringType)])


# the line's state, cached as a small number: 0 good, 1 outside --since/--until, 2 corrupt, 3 blank (ignored)
STATES = ("good", "outside", "corrupt", "blank")
_GOOD, _OUTSIDE, _CORRUPT, _BLANK = range(4)


def _read_kind(
    spark: SparkSession,
    files: dict[str, list[str]],
    nodes: Sequence[str],
    schema: StructType,
    keep: Sequence[str],
    since: datetime | None,
    until: datetime | None,
) -> DataFrame:
    """One kind of log, parsed and flagged: ``node_id`` (index in ``nodes``) and ``state`` (see :data:`STATES`)."""
    lines: DataFrame | None = None
    for node, paths in files.items():  # one read per node: the node is a constant, not parsed from each path
        read = spark.read.option("lineSep", "\n").text(paths)
        read = read.select("value", F.lit(nodes.index(node)).cast("int").alias("node_id"))
        lines = read if lines is None else lines.unionByName(read)
    if lines is None:
        empty = StructType([StructField("value", StringType()), StructField("node_id", IntegerType())])
        lines = spark.createDataFrame([], empty)
    rows = parse_lines(lines, _parsed_schema(schema, keep), keep)
    inside = F.lit(True)
    if since is not None:
        inside = inside & (F.col("time") >= F.lit(since))
    if until is not None:
        inside = inside & (F.col("time") < F.lit(until))
    state = (F.when(F.col("blank"), _BLANK).when(F.col("bad"), _CORRUPT).when(inside, _GOOD).otherwise(_OUTSIDE)).cast(
        "byte"
    )
    return rows.select("node_id", state.alias("state"), "second", *keep, "example")


def _names(codes: Column, names: Sequence[str]) -> Column:
    """0, 1, ... -> the names (as a lookup in a literal array)."""
    values = [F.lit(name) for name in names] or [F.lit(None).cast("string")]
    return F.element_at(F.array(*values), codes.cast("int") + 1)


def read_logs(
    spark: SparkSession,
    dirs: Sequence[str],
    since: datetime | None = None,
    until: datetime | None = None,
    persist: bool = True,
) -> LogFrames:
    """Parse every node's logs once; with ``persist`` the parse is kept for all analyses.

    Only the columns the analyses read are kept (:data:`ACCESS_COLUMNS`,
    :data:`MESSAGE_COLUMNS`, :data:`STATS_COLUMNS`, plus ``second``, a node number and the line's state as
    small numbers); ``node``, ``time`` (the second the line was logged in, as a
    timestamp) and ``session_key`` are computed when read.
    """
    access_files, access_skipped = log_files(dirs, "access.log")
    message_files, message_skipped = log_files(dirs, "message.log")
    stats_files, stats_skipped = log_files(dirs, "stats.log")
    nodes = list(dict.fromkeys([*access_files, *message_files, *stats_files]))
    # the three plans are built at once: on a cold JVM each takes a second of Catalyst's analysis
    with ThreadPoolExecutor(3, thread_name_prefix="migratory-plan") as pool:
        planned = [
            pool.submit(_read_kind, spark, files, nodes, schema, keep, since, until)
            for files, schema, keep in (
                (access_files, ACCESS_SCHEMA, ACCESS_COLUMNS),
                (message_files, MESSAGE_SCHEMA, MESSAGE_COLUMNS),
                (stats_files, STATS_SCHEMA, STATS_COLUMNS),
            )
        ]
        access, messages, stats = (future.result() for future in planned)
    persisted: tuple[DataFrame, ...] = ()
    if persist:
        access = access.persist(StorageLevel.MEMORY_AND_DISK)
        messages = messages.persist(StorageLevel.MEMORY_AND_DISK)
        stats = stats.persist(StorageLevel.MEMORY_AND_DISK)
        persisted = (access, messages, stats)
    columns = ["node_id", "state", "second", "example"]
    no_event = F.lit(None).cast("string").alias("event")
    lines = (
        access.select(F.lit("access").alias("kind"), *columns, "event")
        .unionByName(messages.select(F.lit("message").alias("kind"), *columns, no_event))
        .unionByName(stats.select(F.lit("stats").alias("kind"), *columns, no_event))
        .where(F.col("state") != _BLANK)
    )
    # counts with fixed-width buffers (a hash aggregation); the examples, a variable-width minimum that
    # would make Spark sort every line, only over the corrupt ones
    event = F.when(F.col("state") == _GOOD, F.col("event")).alias("event")
    counts = lines.groupBy("kind", "node_id", "state", event).agg(
        F.count(F.lit(1)).alias("lines"),
        F.min("second").alias("first"),
        F.max("second").alias("last"),
    )
    examples = (
        lines.where(F.col("state") == _CORRUPT)
        .groupBy("kind", "node_id", "state")
        .agg(F.min("example").alias("example"))
    )
    overview = counts.unionByName(examples, allowMissingColumns=True).select(
        "kind",
        _names(F.col("node_id"), nodes).alias("node"),
        _names(F.col("state"), STATES).alias("state"),
        "event",
        "lines",
        "first",
        "last",
        "example",
    )
    corrupt = (
        overview.where(F.col("state") == "corrupt")
        .groupBy("kind", "node")
        .agg(F.sum("lines").alias("lines"), F.min("example").alias("example"))
    )
    time = F.timestamp_seconds("second").alias("time")
    node = _names(F.col("node_id"), nodes).alias("node")
    session_key = F.concat_ws("|", node, F.col("session")).alias("session_key")
    return LogFrames(
        access=access.where(F.col("state") == _GOOD).select(node, time, "second", *ACCESS_COLUMNS, session_key),
        messages=messages.where(F.col("state") == _GOOD).select(node, time, "second", *MESSAGE_COLUMNS),
        stats=stats.where(F.col("state") == _GOOD).select(
            node, F.col("node").alias("server"), time, "second", *STATS_COLUMNS[1:]
        ),
        corrupt=corrupt,
        overview=overview,
        skipped=sorted(access_skipped + message_skipped + stats_skipped),
        persisted=persisted,
    )


def escape_example(raw: bytes | bytearray | None) -> str | None:
    """A corrupt line's bytes -> readable, valid text: bad UTF-8 as ``\\xNN``, control characters escaped, cut."""
    if raw is None:
        return None
    text = bytes(raw).decode("utf-8", "backslashreplace")
    text = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
    if len(text) > EXAMPLE_CHARS:
        text = text[: EXAMPLE_CHARS - 1] + "…"
    return text


def corrupt_rows(rows: Sequence[Any]) -> list[dict[str, Any]]:
    """Collected ``corrupt`` rows -> plain dicts with the example escaped (see :func:`escape_example`)."""
    out = []
    for row in rows:
        item = row.asDict() if hasattr(row, "asDict") else dict(row)
        item["lines"] = int(item["lines"])
        item["example"] = escape_example(item.get("example"))
        out.append(item)
    return sorted(out, key=lambda r: (r["kind"], r["node"]))
