"""The package's JVM line parser (spark/java) against Spark's from_json: the same rows for every line.

The analytics parse with the JVM parser when its jar is built (`make jar`, which `make test` runs) and
with ``from_json`` otherwise; both must give the same flags, time, example and fields. The corpus is
the hand-written rules of the reader plus realistic generated lines and thousands of seeded mutations
of them (a byte deleted, inserted or replaced, including bytes that are not UTF-8).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
from migratory_spark.generate import generate
from migratory_spark.reader import jvm_parser, parse_lines
from migratory_spark.schema import ACCESS_SCHEMA, CORRUPT, MESSAGE_SCHEMA, STATS_SCHEMA
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from tests.spark_fixtures import INVALID_UTF8, NOT_ONE_OBJECT, NOT_ONE_OBJECT_EITHER, ONE_OBJECT

pytestmark = pytest.mark.slow

TS = "2026-11-02T00:00:01.000Z"
# one line per rule the two parsers must apply alike (bytes: some are not UTF-8)
RULES: list[bytes] = [
    line.encode()
    for line in [
        *ONE_OBJECT,
        *NOT_ONE_OBJECT,
        *NOT_ONE_OBJECT_EITHER,
        "",
        " \t\r",
        f'{{"v":2,"ts":"{TS}","event":"connect"}}',
        f'{{"v":"1","ts":"{TS}","event":"connect"}}',
        f'{{"v":1.0,"ts":"{TS}","event":"connect"}}',
        f'{{"v":1,"ts":"{TS}"}}',
        f'{{"v":1,"ts":"{TS}","event":null}}',
        '{"v":1,"ts":"2026-11-02T00:00:01Z","event":"connect"}',
        '{"v":1,"ts":"2026-13-02T00:00:01.000Z","event":"connect"}',
        f'{{"v":1,"ts":"{TS}","event":"connect","port":99999999999}}',
        f'{{"v":1,"ts":"{TS}","event":"connect","port":""}}',
        f'{{"v":1,"ts":"{TS}","event":"connect","tls":"true"}}',
        f'{{"v":1,"ts":"{TS}","event":"connect","tls":true,"tls":false}}',  # the last one counts
        f'{{"v":1,"ts":"{TS}","event":"disconnect","duration_ms":-0,"msgs_in":1e3}}',
        f'{{"v":1,"ts":"{TS}","event":"subscribe","subject":12.50}}',  # a number as a string field
        f'{{"v":1,"ts":"{TS}","event":"subscribe","subject":{{"a":[1,"b",null]}}}}',
        f'{{"v":1,"ts":"{TS}","event":"subscribe","subject":"\\u00e9\\ud83d\\ude00\\n"}}',
        f'{{"v":1,"ts":"{TS}","event":"subscribe","subject":"/é/漢字/😀"}}',
        f"{{'v':1,'ts':'{TS}','event':'connect'}}",  # single quotes: Spark's JSON options allow them
        f'{{v:1,"ts":"{TS}","event":"connect"}}',
        f'{{"v":1,"ts":"{TS}","event":"connect"}} // comment',
        f'{{"v":01,"ts":"{TS}","event":"connect"}}',
        f'{{"v":1,"ts":"{TS}","event":"connect","status":NaN}}',
        f'{{"v":1,"ts":"{TS}","event":"publish","sampling":NaN,"size":10}}',
        f'{{"v":1,"ts":"{TS}","event":"publish","sampling":"Infinity"}}',
        f'{{"v":1,"ts":"{TS}","event":"publish","sampling":"-INF"}}',
        f'{{"v":1,"ts":"{TS}","event":"publish","sampling":"1.5"}}',
        f'{{"v":1,"ts":"{TS}","event":"publish","sampling":""}}',
        f'{{"v":1,"ts":"{TS}","event":"publish","size":9223372036854775808}}',
        f'{{"v":1,"ts":"{TS}","event":"stats","totals":{{"a":1,"b":null,"a":2}},"denied":{{}}}}',
        f'{{"v":1,"ts":"{TS}","event":"stats","totals":{{"a":"1"}}}}',
        f'{{"v":1,"ts":"{TS}","event":"stats","totals":[1]}}',
        f'{{"v":1,"ts":"{TS}","event":"stats","connected_clients":{{"current":1,"1m_max":"NaN","x":[{{}}]}}}}',
        f'{{"v":1,"ts":"{TS}","event":"stats","connected_clients":{{"current":true}}}}',
        f'{{"v":1,"ts":"{TS}","event":"stats","connected_clients":5}}',
        f'{{"v":1,"ts":"{TS}","event":"connect"',
        f'{{"v":1,"ts":"{TS}","event":"connect","subject":"a\tb"}}',  # a raw tab inside a string
    ]
] + [
    INVALID_UTF8.rstrip(b"\n"),
    f'{{"v":1,"ts":"{TS}","event":"subscribe","subject":"/\xff/x"}}'.encode("latin-1"),  # not UTF-8, kept field
    f'{{"v":1,"ts":"{TS}","event":"connect","other":"\xc3("}}'.encode("latin-1"),  # not UTF-8, skipped field
    f'{{"v":1,"ts":"{TS}","event":"subscribe","subject":"'.encode() + b"\xc0\xaf" + b'"}',  # overlong
    f'{{"v":1,"ts":"{TS}","event":"subscribe","subject":"'.encode() + b"\xed\xa0\x80" + b'"}',  # a surrogate
    b"\xef\xbb\xbf" + f'{{"v":1,"ts":"{TS}","event":"connect"}}'.encode(),  # a byte order mark
    b'{\x00\x00\x00"v":1}',
    b"\x00{}",
    f'{{"v":1,"ts":"{TS}","event":"connect","subject":"a\x00b"}}'.encode(),
]
# what a mutation inserts or writes over a byte: JSON's own characters, and bytes that are not UTF-8
MUTATIONS = b"{}[]\",:\\ 0123456789.eE+-ntfaluqr'/\r\t\x00\x80\xbf\xc3\xe2\xf0\xff"


def _corpus(tmp_path: Path) -> dict[str, list[bytes]]:
    generated = generate(str(tmp_path / "gen"), 200_000, nodes=1, seed=11)
    folder = Path(generated.folders[0])
    corpus = {}
    rng = random.Random(2026)
    for kind in ("access", "message", "stats"):
        real = [line for line in (folder / f"{kind}.log").read_bytes().split(b"\n") if line]
        base = rng.sample(real, min(40, len(real))) + RULES
        mutated = []
        for _ in range(1500):
            line = bytearray(rng.choice(base))
            for _ in range(rng.choice((1, 1, 2, 3))):
                at = rng.randrange(len(line) + 1)
                what = rng.choice(("delete", "insert", "replace"))
                if what == "delete" and at < len(line):
                    del line[at]
                elif what == "insert":
                    line[at:at] = bytes([rng.choice(MUTATIONS)])
                elif at < len(line):
                    line[at] = rng.choice(MUTATIONS)
            mutated.append(bytes(line).replace(b"\n", b" "))
        corpus[kind] = base + mutated
    return corpus


def _same(value: Any) -> Any:
    """A value that compares equal to itself (NaN does not), nested rows and maps included."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, dict):
        return sorted((k, _same(v)) for k, v in value.items())
    if isinstance(value, (tuple, list)):
        return tuple(_same(v) for v in value)
    return value


def _parsed(spark: SparkSession, path: Path, schema: StructType, jvm: bool) -> dict[str, tuple[Any, ...]]:
    lines: DataFrame = spark.read.option("lineSep", "\n").text(str(path))
    lines = lines.select(F.hex(F.col("value").cast("binary")).alias("key"), "value")
    fields = [f.name for f in schema.fields if f.name != CORRUPT]
    out = {}
    # microseconds: a mutated year can be past what Python's datetime holds
    for row in parse_lines(lines, schema, jvm=jvm).withColumn("time", F.unix_micros("time")).collect():
        values = None if row["bad"] else _same([row[name] for name in fields])
        example = None if row["example"] is None else bytes(row["example"])
        out[row["key"]] = (row["blank"], row["bad"], row["time"], row["second"], example, values)
    return out


def test_the_suite_runs_the_jvm_parser(spark: SparkSession) -> None:
    """`make test` builds the jar first; without it every other Spark test would exercise from_json only."""
    assert jvm_parser(spark) is not None, "migratory-spark.jar is not loaded: run `make jar`"


@pytest.mark.parametrize(
    ("kind", "schema"), [("access", ACCESS_SCHEMA), ("message", MESSAGE_SCHEMA), ("stats", STATS_SCHEMA)]
)
def test_both_parsers_give_the_same_rows(spark: SparkSession, tmp_path: Path, kind: str, schema: StructType) -> None:
    corpus = _corpus(tmp_path)[kind]
    path = tmp_path / f"{kind}.log"
    path.write_bytes(b"\n".join(corpus) + b"\n")
    jvm = _parsed(spark, path, schema, jvm=True)
    spark_json = _parsed(spark, path, schema, jvm=False)
    assert len(jvm) == len(spark_json) == len(set(corpus))
    differ = {bytes.fromhex(key): (jvm[key], spark_json[key]) for key in jvm if jvm[key] != spark_json[key]}
    assert differ == {}
    flags = [row[:2] for row in jvm.values()]
    # the corpus exercises every outcome, not only corrupt lines
    assert (False, False) in flags and (False, True) in flags and (True, False) in flags
    assert sum(1 for blank, bad in flags if not blank and not bad) >= 40


def test_a_missing_jar_is_named(spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> None:
    import migratory_spark.reader as reader

    monkeypatch.setattr(reader, "JSON_LINES_CLASS", "migratory.spark.NoSuchParser")
    lines = spark.createDataFrame([("{}",)], "value STRING")
    with pytest.raises(RuntimeError, match="make jar"):
        parse_lines(lines, ACCESS_SCHEMA, jvm=True)
    assert parse_lines(lines, ACCESS_SCHEMA).select("bad").first() == (True,)  # from_json, without the jar


def test_other_columns_pass_through_and_a_null_line_is_corrupt(spark: SparkSession) -> None:
    """Whatever else a line carries (a node number, a struct) comes out as it went in, with either parser."""
    good = f'{{"v":1,"ts":"{TS}","event":"connect","subject":"/a"}}'
    lines = spark.createDataFrame(
        [(1, ("n1", [1, 2]), good), (2, ("n2", []), None), (3, None, "  ")],
        "id INT, origin STRUCT<name: STRING, parts: ARRAY<INT>>, value STRING",
    )
    found = {}
    for jvm in (True, False):
        rows = parse_lines(lines, ACCESS_SCHEMA, keep=["event", "subject"], jvm=jvm).collect()
        found[jvm] = sorted(
            (r["id"], r["origin"], r["event"] if not r["bad"] else None, r["subject"], r["blank"], r["bad"])
            for r in rows
        )
        assert rows[0].__fields__[:4] == ["id", "origin", "event", "subject"]
    assert found[True] == [
        (1, ("n1", [1, 2]), "connect", "/a", False, False),
        (2, ("n2", []), None, None, False, True),
        (3, None, None, None, True, False),
    ]
    assert found[False] == found[True]


def test_a_jar_built_for_another_spark_is_left_unused(
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A PySpark upgraded under an old jar: the reader names the mismatch once and parses with from_json."""
    built = jvm_parser(spark).sparkVersion()  # type: ignore[union-attr]
    assert built == spark.version  # the manifest written by spark/build_jar.py
    import migratory_spark.reader as reader

    monkeypatch.setattr(reader, "_warned", set())  # once per process: this test's own count
    monkeypatch.setattr(type(spark), "version", property(lambda _: "9.9.9"))
    assert jvm_parser(spark) is None
    assert jvm_parser(spark) is None
    err = capsys.readouterr().err
    assert err.count(f"built for Spark {built}, this is 9.9.9") == 1 and "make jar" in err
    lines = spark.createDataFrame([(f'{{"v":1,"ts":"{TS}","event":"connect"}}',)], "value STRING")
    assert parse_lines(lines, ACCESS_SCHEMA).select("bad", "event").first() == (False, "connect")
