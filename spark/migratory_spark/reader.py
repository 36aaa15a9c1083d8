"""Read access.log and message.log (and their rotated files) into typed frames.

Each line is parsed against the explicit schema by Spark's JSON source in
PERMISSIVE mode; a line that is not JSON, has a wrongly typed field, no parseable ``ts``,
no ``event`` or an unknown schema version is *corrupt*: it is counted per node
and file kind and left out of every analysis, never fatal. Every directory
given is one node; the node is kept on each row so that session ids (unique
per node only) are keyed by node.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from migratory_spark import SCHEMA_VERSION
from migratory_spark.schema import ACCESS_SCHEMA, CORRUPT, MESSAGE_SCHEMA, TS_FORMAT

__all__ = ["LogFrames", "log_paths", "read_logs", "typed"]


@dataclass(frozen=True)
class LogFrames:
    """The parsed logs: good access and message rows, and corrupt-line counts."""

    access: DataFrame
    messages: DataFrame
    corrupt: DataFrame  # kind, node, lines, example


def _is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def log_paths(dirs: Sequence[str], name: str) -> list[str]:
    """``NAME`` and its rotations ``NAME.N`` in every directory (globbed by Spark for remote ones)."""
    out: list[str] = []
    for folder in dirs:
        if _is_remote(folder):
            out.append(f"{folder.rstrip('/')}/{name}{{,.[0-9]*}}")
            continue
        local = folder.removeprefix("file://")
        if not os.path.isdir(local):
            raise FileNotFoundError(f"{folder}: not a directory")
        for entry in sorted(os.listdir(local)):
            suffix = entry[len(name) :]
            if entry == name or (entry.startswith(name + ".") and suffix[1:].isdigit()):
                out.append("file://" + os.path.abspath(os.path.join(local, entry)))
    return out


def _node(file_col: Column) -> Column:
    """The directory a line came from, as the node's name."""
    return F.regexp_extract(file_col, r"^(?:file:(?://)?)?(.*)/[^/]+$", 1)


def typed(rows: DataFrame) -> DataFrame:
    """Rows parsed against a schema (with ``node``) -> plus ``time``, ``second``, ``session_key`` and a ``bad`` flag."""
    rows = rows.withColumn("time", F.try_to_timestamp(F.col("ts"), F.lit(TS_FORMAT)))
    bad = (
        F.col(CORRUPT).isNotNull()
        | F.col("time").isNull()
        | F.col("event").isNull()
        | F.col("v").isNull()
        | (F.col("v") != SCHEMA_VERSION)
    )
    return (
        rows.withColumn("bad", bad)
        .withColumn("second", F.unix_seconds("time"))
        .withColumn("session_key", F.concat_ws("|", "node", "session"))
    )


def _read_kind(spark: SparkSession, dirs: Sequence[str], name: str, schema: StructType) -> DataFrame:
    """Spark's JSON source in PERMISSIVE mode: a line that does not fit lands in ``_corrupt``."""
    paths = log_paths(dirs, name)
    if not paths:
        return typed(spark.createDataFrame([], schema).withColumn("node", F.lit(None).cast("string")))
    rows = (
        spark.read.schema(schema)
        .option("mode", "PERMISSIVE")
        .option("columnNameOfCorruptRecord", CORRUPT)
        .option("timeZone", "UTC")
        .json(paths)
        .withColumn("node", _node(F.col("_metadata.file_path")))
    )
    return typed(rows)


def _window(frame: DataFrame, since: datetime | None, until: datetime | None) -> DataFrame:
    if since is not None:
        frame = frame.where(F.col("time") >= F.lit(since))
    if until is not None:
        frame = frame.where(F.col("time") < F.lit(until))
    return frame


def read_logs(
    spark: SparkSession,
    dirs: Sequence[str],
    since: datetime | None = None,
    until: datetime | None = None,
    persist: bool = True,
) -> LogFrames:
    """Parse every node's logs once; with ``persist`` the parse is kept for all analyses."""
    access = _read_kind(spark, dirs, "access.log", ACCESS_SCHEMA)
    messages = _read_kind(spark, dirs, "message.log", MESSAGE_SCHEMA)
    if persist:
        access = access.persist(StorageLevel.MEMORY_AND_DISK)
        messages = messages.persist(StorageLevel.MEMORY_AND_DISK)
    corrupt = (
        access.where("bad")
        .select(F.lit("access").alias("kind"), "node", CORRUPT, "ts")
        .unionByName(messages.where("bad").select(F.lit("message").alias("kind"), "node", CORRUPT, "ts"))
        .groupBy("kind", "node")
        .agg(
            F.count(F.lit(1)).alias("lines"),
            F.min(F.substring(F.coalesce(CORRUPT, F.concat(F.lit("ts="), "ts")), 1, 200)).alias("example"),
        )
    )
    keep_access = [c for c in access.columns if c not in (CORRUPT, "bad")]
    keep_messages = [c for c in messages.columns if c not in (CORRUPT, "bad")]
    good_access = _window(access.where(~F.col("bad")).select(*keep_access), since, until)
    good_messages = _window(messages.where(~F.col("bad")).select(*keep_messages), since, until)
    return LogFrames(access=good_access, messages=good_messages, corrupt=corrupt)
