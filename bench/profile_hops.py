"""Share of each server process's py-spy samples by hop of a publication (bench/ingest.md, "Where the CPU goes").

Reads the collapsed stacks ``migratory bench ingest --profile FOLDER`` writes and files every sample under the
first hop whose function is on its stack (the order below), else under the event loop when the top Python frame
is the loop's own run (uvloop's C code: epoll, socket reads and, as py-spy cannot tell, idle waits), else other.

    .venv/bin/python bench/profile_hops.py FOLDER 'migratory-guaranteed-K128-m*-migratory-*'
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

HOPS: list[tuple[str, tuple[str, ...]]] = [
    ("client frames read (publish decode, engine.publish)", ("Connection.data_received",)),
    ("deliveries and acks written to clients", ("Connection.flush", "FanOut.flush_dirty")),
    ("worker bus: frames from the agent", ("Engine.on_bus_frame",)),
    ("worker bus: frames written", ("Bus._flush", "Bus.flush")),
    ("member links: peer frames read", ("MemberLinks.received",)),
    ("member links: frames written", ("MemberLinks._flush", "_Link.flush")),
    ("agent: worker frames read", ("Member.on_worker_frame",)),
    ("Raft (pysyncobj's tick thread)", ("SyncObj._autoTickThread",)),
]
LOOP = "event loop (uvloop's C code, idle included)"


def hops(path: Path) -> tuple[int, Counter[str]]:
    """Samples in ``path`` and their count per hop."""
    total = 0
    found: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        names = [frame.split(" (")[0] for frame in stack.split(";")]
        label = next((label for label, keys in HOPS if any(key in names for key in keys)), None)
        found[label or (LOOP if names[-1] == "Runner.run" else "other")] += int(count)
    return total, found


def main(folder: str, pattern: str) -> None:
    for path in sorted(Path(folder).glob(pattern)):
        total, found = hops(path)
        print(f"{path.name}: {total} samples")
        for label, count in found.most_common():
            print(f"  {100 * count / max(total, 1):5.1f}%  {label}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
