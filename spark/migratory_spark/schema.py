"""Explicit schemas of access.log, message.log and stats.log (docs/logs.md, version 1).

Spark never infers a schema here: inference costs a full extra pass over the
logs and would silently retype a field the day one line carries a surprise.
Lines that do not fit are kept aside in ``_corrupt`` and counted.
"""

from __future__ import annotations

from pyspark.sql.types import (
    BooleanType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

__all__ = [
    "ACCESS_SCHEMA",
    "CORRUPT",
    "MESSAGE_SCHEMA",
    "STATS_INDICATORS",
    "STATS_SCHEMA",
    "STATS_WINDOWS",
    "TS_FORMAT",
]

CORRUPT = "_corrupt"
# "2026-11-22T15:04:05.123Z", always UTC
TS_FORMAT = "yyyy-MM-dd'T'HH:mm:ss.SSSX"


def _fields(*pairs: tuple[str, object]) -> list[StructField]:
    return [StructField(name, kind, True) for name, kind in pairs]  # type: ignore[arg-type]


_COMMON = (
    ("v", IntegerType()),
    ("ts", StringType()),
    ("event", StringType()),
    ("session", StringType()),
    ("addr", StringType()),
    ("port", IntegerType()),
    ("protocol", StringType()),
)

ACCESS_SCHEMA = StructType(
    _fields(
        *_COMMON,
        ("listener", StringType()),
        ("tls", BooleanType()),
        # disconnect
        ("duration_ms", LongType()),
        ("reason", StringType()),
        ("msgs_in", LongType()),
        ("msgs_out", LongType()),
        ("bytes_in", LongType()),
        ("bytes_out", LongType()),
        # subscribe / unsubscribe / denied / http
        ("subject", StringType()),
        ("conflation_ms", LongType()),
        ("request", StringType()),
        ("reason_code", StringType()),
        ("method", StringType()),
        ("path", StringType()),
        ("status", IntegerType()),
        (CORRUPT, StringType()),
    )
)

MESSAGE_SCHEMA = StructType(
    _fields(
        *_COMMON,
        ("subject", StringType()),
        ("size", LongType()),
        ("fields", IntegerType()),
        ("qos", StringType()),
        ("retained", BooleanType()),
        ("status", StringType()),
        ("recipients", LongType()),
        ("bytes_out", LongType()),
        ("latency_us", LongType()),
        ("seq", LongType()),
        ("epoch", LongType()),
        ("sampling", DoubleType()),
        (CORRUPT, StringType()),
    )
)

# stats.log: every indicator of the node (the server's /stats), one line per Stats.LogInterval
STATS_INDICATORS = (
    "connected_clients",
    "connections_per_second",
    "disconnections_per_second",
    "messages_in_per_second",
    "messages_out_per_second",
    "bytes_in_per_second",
    "bytes_out_per_second",
)
# each indicator's object: ``current`` (the last one-second sample) and these
STATS_WINDOWS = ("1m_max", "1m_avg", "5m_max", "5m_avg", "15m_max", "15m_avg")

_INDICATOR = StructType(_fields(("current", DoubleType()), *[(name, DoubleType()) for name in STATS_WINDOWS]))

STATS_SCHEMA = StructType(
    _fields(
        ("v", IntegerType()),
        ("ts", StringType()),
        ("event", StringType()),
        ("node", StringType()),
        ("epoch", LongType()),
        ("uptime_s", LongType()),
        ("history_s", LongType()),
        *[(name, _INDICATOR) for name in STATS_INDICATORS],
        ("totals", MapType(StringType(), LongType())),
        ("denied", MapType(StringType(), LongType())),
        (CORRUPT, StringType()),
    )
)
