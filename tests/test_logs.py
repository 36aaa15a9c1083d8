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
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["m.log", "m.log.1", "m.log.2"]


def _writer_process(folder: str, tag: str) -> None:
    writer = JsonLineWriter(folder, "access.log", max_bytes=20000, max_files=1000)
    for i in range(3000):
        writer.write({"w": tag, "n": i, "pad": "x" * (i % 50)})
        if i % 100 == 0:
            writer.flush()
    writer.close()


def test_several_processes_share_a_file_and_its_rotation(tmp_path: Path) -> None:
    """Workers append to one access.log: no line is split, lost or duplicated."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_writer_process, args=(str(tmp_path), tag)) for tag in "abc"]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    seen: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    for path in tmp_path.glob("access.log*"):
        for line in path.read_text().splitlines():
            record = json.loads(line)  # a split line would not parse
            seen[record["w"]].append(record["n"])
    for numbers in seen.values():
        assert sorted(numbers) == list(range(3000))


def test_timestamp_format() -> None:
    assert utc_timestamp(0.5) == "1970-01-01T00:00:00.500Z"
