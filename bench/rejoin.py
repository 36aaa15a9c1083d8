"""A Guaranteed member restarted after its peers' caches filled: how long until it is ready, and which links drop.

Three members on 127.0.0.1, one worker each; SUBJECTS x MESSAGES guaranteed publications of 124 bytes
(each with a publish id) through member 1, every one of them cached (MaxCachedMessagesPerSubject =
MESSAGES); then member 2 is SIGKILLed and started again. Printed: the seconds from its start to its
``/health`` saying ready, and every line of the three logs after the restart that says a link was lost
or dropped, or that the event loop stalled. Usage (bench/failover.md, "A restart after the caches
filled")::

    .venv/bin/python bench/rejoin.py [SUBJECTS MESSAGES HEARTBEAT_TIMEOUT_MS]   # 40 5000 1000
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from migratory.bench.cluster import LocalCluster
from migratory.client import MigratoryClient
from migratory.protocol import Status

PAYLOAD = b"x" * 120
WATCHED = ("lost", "dropped", "stalled", "quorum")


async def fill(url: str, subjects: list[str], messages: int) -> None:
    async with MigratoryClient([url]) as publisher:
        for n in range(messages):
            statuses = await asyncio.gather(
                *(publisher.publish(s, PAYLOAD + b"%04d" % (n % 10000), guaranteed=True, retries=3) for s in subjects)
            )
            if any(status not in (Status.OK, Status.NO_SUBSCRIBER) for status in statuses):
                raise SystemExit(f"publication {n} answered {statuses}")


def main() -> None:
    given = sys.argv[1:]
    if len(given) > 3 or not all(a.isdigit() and int(a) > 0 for a in given):
        print("usage: bench/rejoin.py [SUBJECTS MESSAGES HEARTBEAT_TIMEOUT_MS], positive integers", file=sys.stderr)
        raise SystemExit(2)
    count, messages, timeout = (int(a) for a in [*given, *["40", "5000", "1000"][len(given) :]])
    subjects = [f"/rejoin/s{i}" for i in range(count)]
    extra = {
        "MaxCachedMessagesPerSubject": str(messages),
        "CacheExpireTime": "3600",
        "ClusterHeartbeatTimeout": str(timeout),
    }
    with tempfile.TemporaryDirectory() as folder, LocalCluster(Path(folder), 3, mode="Guaranteed", extra=extra) as c:
        c.start_all()
        started = time.monotonic()
        asyncio.run(fill(c[0].ws_url, subjects, messages))
        print(f"{count * messages} publications cached in {time.monotonic() - started:.1f} s", flush=True)
        seen = [len(c.server_log(i)) for i in range(3)]
        c.kill(1)
        time.sleep(2)
        started = time.monotonic()
        c.start(1)
        try:
            c.wait_ready([1], 300)
            print(f"member 2 ready {time.monotonic() - started:.1f} s after its start")
        except Exception as exc:  # reported, with the logs below: this is what the script is for
            print(f"member 2 not ready: {exc}"[:300])
        time.sleep(5)
        for i in range(3):
            lines = [line for line in c.server_log(i)[seen[i] :].splitlines() if any(w in line for w in WATCHED)]
            print(f"member {i + 1}: {len(lines)} lines on lost or dropped links, quorum and stalls after the restart")
            for line in lines[:12]:
                print("   ", line[:220])


if __name__ == "__main__":
    main()
