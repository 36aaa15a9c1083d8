"""JSON-lines writer: schema fields and rotation without losing lines."""

from __future__ import annotations

import json
from pathlib import Path

from migratory.logs import JsonLineWriter, utc_timestamp


def test_rotation_keeps_every_line(tmp_path: Path) -> None:
    writer = JsonLineWriter(tmp_path, "access.log", max_bytes=4096, max_files=50)
    for i in range(1000):
        writer.write({"event": "connect", "n": i})
    writer.close()
    files = sorted(tmp_path.glob("access.log*"))
    assert len(files) > 5
    numbers = []
    for path in files:
        assert path.stat().st_size <= 4096
        for line in path.read_text().splitlines():
            record = json.loads(line)
            assert record["v"] == 1 and record["ts"].endswith("Z")
            numbers.append(record["n"])
    assert sorted(numbers) == list(range(1000))


def test_rotation_drops_only_beyond_max_files(tmp_path: Path) -> None:
    writer = JsonLineWriter(tmp_path, "m.log", max_bytes=4096, max_files=2)
    for i in range(1000):
        writer.write({"n": i})
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.log", "m.log.1", "m.log.2"]


def test_timestamp_format() -> None:
    assert utc_timestamp(0.5) == "1970-01-01T00:00:00.500Z"
