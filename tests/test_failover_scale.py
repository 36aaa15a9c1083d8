"""The million-through-failures benchmark in small (issue 35, item 4): 50,000 clients, one SIGKILL.

``migratory bench run --preset seed-10m-failover`` at 50,000 clients, as a correctness check, not
a timed one: three Guaranteed members (the clients on two of them, the publisher and the third
seed's vote on the last), member 1 SIGKILLed under the load and restarted. Every client of the
dead member must reconnect to the other, resubscribe with its positions and get what it missed
(NOTIFY_DATA_SYNC), and no client may see a message skipped, twice, or a NOTIFY_DATA_RESYNC.
The publication rate is higher than the seeds' one a minute, so that every client has messages
to recover within the minute the test lasts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CLIENTS = 50_000


@pytest.mark.timeout(600)
def test_fifty_thousand_clients_fail_over_and_recover_everything(tmp_path: Path) -> None:
    out = tmp_path / "failover.json"
    command = [
        str(Path(sys.executable).with_name("migratory")),
        "bench",
        "run",
        "--spawn",
        "--preset",
        "seed-10m-failover",
        "--clients",
        str(CLIENTS),
        "--rate",
        "50",
        "--hold",
        "60",
        "--kill-after",
        "20",
        "--restart-after",
        "32",
        "--drain",
        "150",
        "--json",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=560)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    failover = report["failover"]
    assert report["connected"] == CLIENTS, report["errors"]
    # the clients spread evenly over the two serving members: member 1's half was displaced, every one
    # came back and finished its recovery
    assert failover["displaced"] == failover["expected_displaced"] == CLIENTS // 2 + 1  # loaders of 16,667/16,666
    assert failover["awaiting"] == 0
    assert failover["recovered_ms"]["count"] >= failover["displaced"]  # a client dropped twice counts twice
    assert failover["recovered"] > 0  # they did miss messages, and got them
    assert (failover["gaps"], failover["duplicates"], failover["resyncs"]) == (0, 0, 0), failover["examples"]
    assert report["delivered"] >= report["expected_deliveries"] > 0
    assert failover["restart_seconds"] is not None  # member 1 came back and rejoined under the load
    assert failover["storm_seconds"] is not None  # every displaced client was back and recovered, in time
    # the phase "after" (the storm over, member 1 not yet restarted) exists only when the storm ended within
    # the 12 s before the restart: on a loaded or slower machine (half this one's speed: bench/results/
    # calibration/) it does not, and member 1 rejoins while the last clients come back, which is harsher
    phases = set(failover["latency_ms_by_phase"])
    assert {"before", "storm", "rejoin"} <= phases <= {"before", "storm", "after", "rejoin"}, phases
    assert failover["latency_ms_by_phase"]["rejoin"]["count"] > 0
    assert done.returncode == 0, report["errors"]
