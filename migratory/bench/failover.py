"""Fault-injection rounds against a local cluster, judged by the history checker.

One round: start a cluster (processes on 127.0.0.x, or each member in its own network
namespace when a partition is wanted), start subscribers that record everything and
publishers that publish steadily on several subjects (each publication retried with
the same publish id until acknowledged), inject one fault, heal it, let the cluster
settle, and check every history (migratory/bench/checker.py): no acknowledged message
lost, none delivered twice, order kept per subject, every client back in sync.
``migratory bench failover --rounds N`` and tests/test_failover.py both run these.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from migratory.bench.checker import Recorder, check, content_of
from migratory.bench.cluster import LocalCluster
from migratory.bench.netns import Namespaces
from migratory.client import MigratoryClient
from migratory.groups import group_of
from migratory.protocol import Status

__all__ = ["FAULTS", "RoundResult", "percentile", "run_round"]

FAULTS = (
    "kill-coordinator",
    "kill-agent",
    "kill-member",
    "stop-member",
    "partition-member",
    "restart-member",
    "lose-seed-majority",
)
OK = (Status.OK, Status.NO_SUBSCRIBER)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass
class RoundResult:
    fault: str
    mode: str
    size: int
    violations: list[str]
    published: int = 0
    acked: int = 0
    unacked: int = 0
    gaps: list[float] = field(default_factory=list)
    recovered: list[int] = field(default_factory=list)
    resynced_clients: int = 0
    history: str | None = None
    seconds: float = 0.0
    victim: int = -1

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


class _Publisher:
    def __init__(
        self, name: str, servers: list[str | tuple[str, float]], subjects: list[str], interval: float, retries: int
    ) -> None:
        self.name = name
        self.retries = retries
        self.subjects = subjects
        self.interval = interval
        self.client = MigratoryClient(servers, backoff_initial=0.05, backoff_max=1.0, request_timeout=8.0)
        self.acked: dict[str, list[tuple[bytes, float]]] = {s: [] for s in subjects}
        self.published = 0
        self.unacked = 0

    async def run(self, stop: asyncio.Event) -> None:
        """One loop per subject, so a group that is changing coordinator does not hold up the others."""
        await asyncio.gather(*(self._subject(stop, subject, k) for k, subject in enumerate(self.subjects)))

    async def _subject(self, stop: asyncio.Event, subject: str, k: int) -> None:
        n = 0
        interval = self.interval * len(self.subjects)
        await asyncio.sleep(self.interval * k)
        while not stop.is_set():
            content = content_of(f"{self.name}.{k}", n)
            sent = time.monotonic()
            status = await self.client.publish(
                subject, content, guaranteed=True, publish_id=f"{self.name}.{k}-{n}", retries=self.retries
            )
            self.published += 1
            if status in OK:
                self.acked[subject].append((content, sent))
            else:
                self.unacked += 1  # outcome unknown: it may or may not be delivered, never twice
            n += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)


async def run_round(
    folder: Path,
    fault: str,
    *,
    size: int = 3,
    mode: str = "Guaranteed",
    subjects: int = 6,
    rate: float = 60.0,
    heartbeat_timeout: int = 1000,
    seeds: int | None = None,
    seed: int | None = None,
    log: Callable[[str], None] | None = None,
) -> RoundResult:
    """Run one round with ``fault`` and return what the checker found."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r} (one of {', '.join(FAULTS)})")
    rng = random.Random(seed)
    say = log or (lambda _: None)
    started = time.monotonic()
    namespaces = Namespaces(size) if fault == "partition-member" else None
    extra = {"ClusterSeedMemberCount": str(seeds)} if seeds else {}
    try:
        cluster = LocalCluster(
            folder,
            size,
            mode=mode,
            heartbeat_interval=max(50, heartbeat_timeout // 5),
            heartbeat_timeout=heartbeat_timeout,
            extra=extra,
            hosts=namespaces.hosts if namespaces else None,
            ports=(8800, 9100, 9900) if namespaces else None,
            wrap=namespaces.wrap if namespaces else None,
        )
        with cluster:
            cluster.start_all(ready_timeout=60)
            for index in range(size):
                cluster.wait_view(index, set(range(size)), timeout=60)
            result = await _round(cluster, namespaces, fault, mode, subjects, rate, heartbeat_timeout, rng, say, folder)
    finally:
        if namespaces is not None:
            namespaces.close()
    result.seconds = round(time.monotonic() - started, 2)
    return result


async def _round(
    cluster: LocalCluster,
    namespaces: Namespaces | None,
    fault: str,
    mode: str,
    subject_count: int,
    rate: float,
    heartbeat_timeout: int,
    rng: random.Random,
    say: Callable[[str], None],
    folder: Path,
) -> RoundResult:
    loop = asyncio.get_running_loop()
    size = cluster.size
    subjects = [f"/fault/s{i}" for i in range(subject_count)]
    servers: list[str | tuple[str, float]] = [(m.ws_url, 100.0) for m in cluster.members]
    recorders = [Recorder(f"sub{i}", servers, request_timeout=8.0) for i in range(2 * size)]
    for recorder in recorders:
        await recorder.start(subjects)
    # Standard mode has no cache to recognise a retried publish id: a retry could be delivered twice
    retries = 40 if mode == "Guaranteed" else 0
    publishers = [_Publisher(f"pub{i}", servers, subjects, 2 / rate, retries) for i in range(2)]
    for publisher in publishers:
        await publisher.client.connect()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(p.run(stop)) for p in publishers]
    await asyncio.sleep(1.5)
    coordinator = await loop.run_in_executor(None, _coordinator_of, cluster, subjects[0])
    pause = max(2.0, 2.5 * heartbeat_timeout / 1000)
    victim = coordinator
    fault_at = time.monotonic()
    say(f"{fault}: member {victim + 1} coordinates {subjects[0]}")
    if fault == "kill-coordinator":
        await loop.run_in_executor(None, cluster.kill, victim)
        await asyncio.sleep(pause)
        await loop.run_in_executor(None, _restart, cluster, victim)
    elif fault == "kill-member":
        victim = rng.choice([i for i in range(size) if i != coordinator])
        await loop.run_in_executor(None, cluster.kill, victim)
        await asyncio.sleep(pause)
        await loop.run_in_executor(None, _restart, cluster, victim)
    elif fault == "kill-agent":  # the member's agent alone: its workers and their clients stay
        agent = cluster.processes(victim).get("migratory-agent")
        if agent is None:
            raise RuntimeError(f"member {victim} has no agent process")
        os.kill(agent, 9)
        await asyncio.sleep(pause)
    elif fault == "restart-member":
        await loop.run_in_executor(None, cluster.kill, victim)
        await loop.run_in_executor(None, _restart, cluster, victim)  # back before the others notice
    elif fault == "stop-member":
        cluster.signal(victim, 19)  # SIGSTOP
        await asyncio.sleep(pause)
        cluster.signal(victim, 18)  # SIGCONT
    elif fault == "partition-member":
        assert namespaces is not None
        namespaces.partition(victim)
        await asyncio.sleep(pause)
        namespaces.heal(victim)
    elif fault == "lose-seed-majority":
        seeds = min(size, 3 if size < 5 else 5)
        victims = rng.sample(range(seeds), seeds // 2 + 1)
        victim = victims[0]
        for index in victims:
            await loop.run_in_executor(None, cluster.kill, index)
        await asyncio.sleep(pause)
        for index in victims:
            await loop.run_in_executor(None, cluster.start, index)
        await loop.run_in_executor(None, cluster.wait_ready, victims, 60.0)
    healed_at = time.monotonic()
    say(f"healed after {healed_at - fault_at:.2f} s")
    for index in range(size):
        await loop.run_in_executor(None, cluster.wait_view, index, set(range(size)), 60.0)
    say(f"every member sees every other {time.monotonic() - fault_at:.2f} s after the fault")
    await asyncio.sleep(2.0)
    stop.set()
    await asyncio.gather(*tasks)
    say(f"publishers stopped {time.monotonic() - fault_at:.2f} s after the fault")
    await _settle(cluster, recorders, subjects)
    say(f"settled {time.monotonic() - fault_at:.2f} s after the fault")
    acked: dict[str, list[tuple[bytes, float]]] = {s: [] for s in subjects}
    for publisher in publishers:
        for subject, items in publisher.acked.items():
            acked[subject].extend(items)
    keep = folder / f"violations-{fault}.json"
    violations = check([r.history for r in recorders], acked, guaranteed=mode == "Guaranteed", keep=keep)
    violations += await loop.run_in_executor(None, _in_sync, cluster, recorders, subjects)
    result = RoundResult(
        fault,
        mode,
        size,
        violations,
        published=sum(p.published for p in publishers),
        acked=sum(len(v) for v in acked.values()),
        unacked=sum(p.unacked for p in publishers),
        gaps=[g for r in recorders if (g := _gap(r, fault_at, healed_at)) is not None],
        recovered=[_recovered(r) for r in recorders],
        resynced_clients=sum(1 for r in recorders if any(r.history.resynced(s) for s in subjects)),
        history=str(keep) if keep.exists() else None,
        victim=victim,
    )
    for client in (*(p.client for p in publishers), *(r.client for r in recorders)):
        await client.close()
    return result


def _coordinator_of(cluster: LocalCluster, subject: str) -> int:
    """The member coordinating ``subject``'s group: its epoch names it (migratory/groups.py)."""
    for index in range(cluster.size):
        snapshot = cluster.snapshot(index, subject)
        if snapshot is not None:
            return int(snapshot["epoch"]) % cluster.size
    return group_of(subject) % cluster.size


def _restart(cluster: LocalCluster, index: int) -> None:
    cluster.start(index)
    cluster.wait_ready([index], 60.0)


async def _settle(cluster: LocalCluster, recorders: list[Recorder], subjects: list[str], timeout: float = 20.0) -> None:
    """Wait until every recorder's last message of each subject is the cluster's snapshot."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snapshots = await loop.run_in_executor(None, lambda: [cluster.snapshot(0, s) for s in subjects])
        latest = {s: (snap or {}).get("seq") for s, snap in zip(subjects, snapshots, strict=True)}
        if all((r.client.position(s) or (0, 0))[1] == latest[s] for r in recorders for s in subjects if latest[s]):
            return
        await asyncio.sleep(0.2)


def _in_sync(cluster: LocalCluster, recorders: list[Recorder], subjects: list[str]) -> list[str]:
    out = []
    for subject in subjects:
        snapshots = [cluster.snapshot(i, subject) for i in range(cluster.size)]
        if any(s != snapshots[0] for s in snapshots):
            out.append(f"{subject}: members disagree on the snapshot: {snapshots}")
            continue
        latest = (snapshots[0] or {}).get("seq")
        for recorder in recorders:
            position = recorder.client.position(subject)
            if latest and (position is None or position[1] != latest):
                out.append(f"{recorder.history.name}: {subject} at {position}, the cluster at seq {latest}")
    return out


def _gap(recorder: Recorder, fault_at: float, healed_at: float) -> float | None:
    """The longest silence this client saw from just before the fault until after the heal."""
    times = sorted(t for items in recorder.history.messages.values() for *_, t in items)
    window = [t for t in times if fault_at - 1.0 <= t <= healed_at + 2.0]
    before = [t for t in times if t < fault_at]
    if not before or not window:
        return None
    points = [before[-1], *(t for t in window if t >= before[-1])]
    return max((b - a for a, b in itertools.pairwise(points)), default=0.0)


def _recovered(recorder: Recorder) -> int:
    return sum(1 for items in recorder.history.messages.values() for m in items if m[0] == "RECOVERED")


def summary(results: list[RoundResult]) -> dict[str, Any]:
    """Figures over rounds: failover gap p50/p99/max per client, recovered messages, violations."""
    gaps = [g for r in results for g in r.gaps]
    recovered = [n for r in results for n in r.recovered]
    return {
        "rounds": len(results),
        "failed_rounds": sum(1 for r in results if not r.ok),
        "gap_p50_s": round(percentile(gaps, 50), 3),
        "gap_p99_s": round(percentile(gaps, 99), 3),
        "gap_max_s": round(max(gaps, default=0.0), 3),
        "recovered_mean": round(statistics.fmean(recovered), 1) if recovered else 0.0,
        "recovered_max": max(recovered, default=0),
        "acked": sum(r.acked for r in results),
        "unacked": sum(r.unacked for r in results),
    }
