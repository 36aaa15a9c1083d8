"""Fault-injection rounds against a local cluster, judged by the history checker.

One round: start a cluster (processes on 127.0.0.x, or each member in its own network
namespace when a partition is wanted), fill it with history (``prefill``: hundreds of
subjects with full caches, so that every state sync after a restart is large), start
subscribers that record everything and publishers that publish steadily on several
subjects (each publication retried with the same publish id until acknowledged), inject
one fault, heal it, let the cluster settle, and check every history
(migratory/bench/checker.py): no acknowledged message lost, none delivered or numbered
twice, order kept, no silent gap, every client back in sync, every member's snapshots
alike. Whenever a restarted member's ``/health`` first says ready, the round checks
what the member can actually do at that moment: deliver to a subscriber on it what is
published elsewhere, and answer a publication made through it.
``migratory bench failover --rounds N`` and tests/test_failover.py both run these.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from migratory.bench.checker import Recorder, check, content_of
from migratory.bench.cluster import LocalCluster
from migratory.bench.mqttobserver import MqttObserver, check_mqtt
from migratory.bench.mqttobserver import available as mqtt_available
from migratory.bench.netns import Namespaces
from migratory.client import EventKind, MigratoryClient, PublishError
from migratory.groups import group_of
from migratory.protocol import Status

__all__ = ["DEFAULTS", "FAULTS", "GUARANTEED_ONLY", "RoundResult", "percentile", "run_round", "summary_by_fault"]

# The default member configuration on this 2-core machine (Workers = auto is one per core): what an operator runs.
DEFAULTS: dict[str, Any] = {"heartbeat_timeout": 3000, "heartbeat_interval": 500, "workers": 2}

FAULTS = (
    "kill-coordinator",
    "kill-agent",
    "kill-member",
    "stop-member",
    "partition-member",
    "restart-member",
    "lose-seed-majority",
    "kill-worker",
    "kill-leader",
    "stop-leader",
    "rolling-restart",
    "kill-rejoined",
    "partition-leader",
    "partition-follower",
    "pause-long",
    "pause-during-rejoin",
    "partition-during-rejoin",
)
GUARANTEED_ONLY = ("lose-seed-majority", "kill-leader", "stop-leader", "partition-leader")  # the seeds' consensus
PARTITIONS = ("partition-member", "partition-leader", "partition-follower", "partition-during-rejoin")
# Standard mode loses nothing acknowledged when no coordinator crashes or is cut off (docs/cluster.md)
STANDARD_LOSSLESS = ("kill-member", "kill-worker", "rolling-restart")
HEALTH_PROBE_TIMEOUT = 5.0  # s a member whose /health says ready gets to deliver and answer a probe
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
    ack_gaps: list[float] = field(default_factory=list)  # per publisher loop: longest wait between two acks
    # the clients on the faulted member when the fault began: the longest each went without a message
    victim_gaps: list[float] = field(default_factory=list)
    victim_clients: int = 0  # how many clients the faulted member had when the fault began
    victim_moved: int = 0  # of those, how many were served by another member before the fault ended
    mqtt_received: int = 0  # what the MQTT observer (Guaranteed rounds) got, redeliveries included
    mqtt_reconnections: int = 0  # how often it came back on another member with its session

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
        self.ack_times: dict[str, list[float]] = {s: [] for s in subjects}
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
                self.ack_times[subject].append(time.monotonic())
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
    heartbeat_interval: int | None = None,
    workers: int = 1,
    prefill: tuple[int, int] = (0, 0),
    seeds: int | None = None,
    seed: int | None = None,
    log: Callable[[str], None] | None = None,
) -> RoundResult:
    """Run one round with ``fault`` and return what the checker found.

    ``prefill`` = (subjects, messages each) published before the round (120-byte messages: with 60
    a subject, every cache holds 7 KB). The default member configuration is ``heartbeat_timeout=3000,
    heartbeat_interval=500, workers=2`` on this 2-core machine (:data:`DEFAULTS`).
    """
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r} (one of {', '.join(FAULTS)})")
    if fault in GUARANTEED_ONLY and mode != "Guaranteed":
        raise ValueError(f"{fault} is a fault of the Guaranteed mode's seed consensus")
    rng = random.Random(seed)
    say = log or (lambda _: None)
    started = time.monotonic()
    namespaces = Namespaces(size) if fault in PARTITIONS else None
    extra = {"ClusterSeedMemberCount": str(seeds)} if seeds else {}
    try:
        cluster = LocalCluster(
            folder,
            size,
            mode=mode,
            heartbeat_interval=heartbeat_interval or max(50, heartbeat_timeout // 5),
            heartbeat_timeout=heartbeat_timeout,
            workers=workers,
            extra=extra,
            hosts=namespaces.hosts if namespaces else None,
            ports=(8800, 9100, 9900) if namespaces else None,
            wrap=namespaces.wrap if namespaces else None,
        )
        with cluster:
            cluster.start_all(ready_timeout=60)
            for index in range(size):
                cluster.wait_view(index, set(range(size)), timeout=60)
            if prefill[0]:
                await _prefill(cluster, mode, *prefill)
                say(f"prefilled {prefill[0]} subjects with {prefill[1]} messages each")
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
    # two subscribers start on each member (its weight 100 against 1: a member with none would leave a fault
    # of it unmeasured); after a failure each goes anywhere else, at random
    recorders = [
        Recorder(
            f"sub{i}",
            [(m.ws_url, 100.0 if j == i % size else 1.0) for j, m in enumerate(cluster.members)],
            request_timeout=8.0,
        )
        for i in range(2 * size)
    ]
    for recorder in recorders:
        await recorder.start(subjects)
    coordinator = await loop.run_in_executor(None, _coordinator_of, cluster, subjects[0])
    observer: MqttObserver | None = None
    if mode == "Guaranteed" and mqtt_available():  # QoS 1 through the fault, with a client nobody here wrote
        members = [(m.host, m.client_port) for m in cluster.members]
        observer = MqttObserver("fault-observer", members, coordinator, [s[1:] for s in subjects])
        await loop.run_in_executor(None, observer.start)
    retries = 40  # both modes number a retried publish id once (the ids travel with the state)
    # named per round: a stray connection to another harness's cluster shows up as foreign content, never as a
    # publish id that cluster had numbered already
    tag = secrets.token_hex(2)
    publishers = [_Publisher(f"pub{i}-{tag}", servers, subjects, 2 / rate, retries) for i in range(2)]
    for publisher in publishers:
        await publisher.client.connect()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(p.run(stop)) for p in publishers]
    await asyncio.sleep(1.5)
    pause = max(2.0, 2.5 * heartbeat_timeout / 1000)
    victim = coordinator
    probes: list[str] = []  # what a member's /health promised and the member could not do
    if fault in ("kill-leader", "stop-leader", "partition-leader"):
        victim = await loop.run_in_executor(None, _leader_of, cluster)
        say(f"{fault}: member {victim + 1} leads the seed members")
    elif fault == "partition-follower" and mode == "Guaranteed":
        leader = await loop.run_in_executor(None, _leader_of, cluster)
        victim = coordinator if coordinator != leader else rng.choice([i for i in range(size) if i != leader])
        say(f"{fault}: member {victim + 1} (not the seeds' leader)")
    else:
        say(f"{fault}: member {victim + 1} coordinates {subjects[0]}")
    fault_at = time.monotonic()
    on_victim = [r for r in recorders if r.client.server == cluster[victim].ws_url]
    long_pause = 3 * heartbeat_timeout / 1000  # three failure-detector timeouts: the others have moved on
    if fault in ("kill-coordinator", "kill-leader"):
        await loop.run_in_executor(None, cluster.kill, victim)
        await asyncio.sleep(pause)
        await _restart_checked(cluster, victim, mode, probes)
    elif fault == "kill-member":
        victim = rng.choice([i for i in range(size) if i != coordinator])
        await loop.run_in_executor(None, cluster.kill, victim)
        await asyncio.sleep(pause)
        await _restart_checked(cluster, victim, mode, probes)
    elif fault == "kill-agent":  # the member's agent alone: its workers and their clients stay
        await _kill_child(cluster, victim, "migratory-agent")
        await _probe_when_ready(cluster, victim, mode, probes)
    elif fault == "kill-worker":  # one worker alone: the supervisor restarts it, it links to its agent again
        await _kill_child(cluster, victim, "migratory-w0")
        await _probe_when_ready(cluster, victim, mode, probes)
    elif fault == "restart-member":
        await loop.run_in_executor(None, cluster.kill, victim)
        await _restart_checked(cluster, victim, mode, probes)  # back before the others notice
    elif fault == "kill-rejoined":  # killed again the moment it says it is back
        await loop.run_in_executor(None, cluster.kill, victim)
        await asyncio.sleep(pause)
        await loop.run_in_executor(None, cluster.start, victim)
        await _wait_healthy(cluster, victim)
        await loop.run_in_executor(None, cluster.kill, victim)
        await asyncio.sleep(pause)
        await _restart_checked(cluster, victim, mode, probes)
    elif fault == "rolling-restart":  # the apt upgrade workflow: each member in turn, once the last is healthy
        for index in range(size):
            await loop.run_in_executor(None, cluster.stop, index)
            await _restart_checked(cluster, index, mode, probes)
            for other in range(size):
                await loop.run_in_executor(None, cluster.wait_view, other, set(range(size)), 60.0)
    elif fault in ("stop-member", "stop-leader"):
        cluster.signal(victim, 19)  # SIGSTOP
        await asyncio.sleep(pause)
        cluster.signal(victim, 18)  # SIGCONT
        await _probe_when_ready(cluster, victim, mode, probes)
    elif fault in ("partition-member", "partition-leader", "partition-follower"):
        assert namespaces is not None
        namespaces.partition(victim)  # its cluster links and consensus cut; its clients still reach it
        await asyncio.sleep(pause)
        namespaces.heal(victim)
        # A Standard member cut off stays ready on its side (both sides serve, docs/cluster.md): what it is
        # promised to do again is checked once its links are back, as the members' own view says
        await loop.run_in_executor(None, cluster.wait_view, victim, set(range(size)), 60.0)
        await _probe_when_ready(cluster, victim, mode, probes)
    elif fault == "pause-long":  # the whole member, agent included
        cluster.signal(victim, 19)
        await asyncio.sleep(long_pause)
        cluster.signal(victim, 18)
        await _probe_when_ready(cluster, victim, mode, probes)
    elif fault in ("pause-during-rejoin", "partition-during-rejoin"):
        # two faults overlapping: a member restarts, and while it rejoins another one stops or is cut off
        rejoining = victim
        victim = rng.choice([i for i in range(size) if i != rejoining])
        await loop.run_in_executor(None, cluster.kill, rejoining)
        await asyncio.sleep(pause)
        await loop.run_in_executor(None, cluster.start, rejoining)
        say(f"{fault}: member {rejoining + 1} restarted; member {victim + 1} faulted while it rejoins")
        on_victim = [r for r in recorders if r.client.server == cluster[victim].ws_url]
        # the rejoining member is probed the moment its /health says ready, while the other one is still
        # faulted, and not through that one: a Standard member cut off numbers alone until its links are back,
        # and what it numbered is the partition's loss (Standard's rule), not a broken promise of /health
        probing = asyncio.ensure_future(_probe_when_ready(cluster, rejoining, mode, probes, avoid={victim}))
        if fault == "pause-during-rejoin":
            cluster.signal(victim, 19)
            await asyncio.sleep(long_pause)
            cluster.signal(victim, 18)
        else:
            assert namespaces is not None
            namespaces.partition(victim)
            await asyncio.sleep(long_pause)
            namespaces.heal(victim)
        await probing
        if fault == "partition-during-rejoin":  # as after partition-*: a member cut off is probed once its
            # links are back (a Standard one stayed ready on its side, and its links take a retry to return)
            await loop.run_in_executor(None, cluster.wait_view, victim, set(range(size)), 60.0)
        await _probe_when_ready(cluster, victim, mode, probes)
    elif fault == "lose-seed-majority":
        seeds = min(size, 3 if size < 5 else 5)
        victims = rng.sample(range(seeds), seeds // 2 + 1)
        victim = victims[0]
        for index in victims:
            await loop.run_in_executor(None, cluster.kill, index)
        await asyncio.sleep(pause)
        for index in victims:
            await loop.run_in_executor(None, cluster.start, index)
        for index in victims:
            await _probe_when_ready(cluster, index, mode, probes)
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
    guaranteed = mode == "Guaranteed"
    lossless = guaranteed or fault in STANDARD_LOSSLESS
    violations = check([r.history for r in recorders], acked, guaranteed=guaranteed, lossless=lossless, keep=keep)
    violations += await loop.run_in_executor(None, _in_sync, cluster, recorders, subjects)
    violations += probes
    if observer is not None:
        contents = {subject: [c for c, _ in items] for subject, items in acked.items()}
        await loop.run_in_executor(None, observer.wait_for, {s[1:]: set(c) for s, c in contents.items()}, 20.0)
        order = {subject: recorders[0].history.contents(subject) for subject in subjects}
        violations += check_mqtt(observer, contents, order)
        await loop.run_in_executor(None, observer.stop)
        say(f"mqtt observer: {len(observer.received)} received, {observer.reconnections} reconnections")
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
        ack_gaps=[g for p in publishers for t in p.ack_times.values() if (g := _ack_gap(t, fault_at)) is not None],
        victim_gaps=[g for r in on_victim if (g := _gap(r, fault_at, healed_at)) is not None],
        victim_clients=len(on_victim),
        victim_moved=sum(1 for r in on_victim if _moved(r, cluster[victim].ws_url, fault_at, healed_at)),
        mqtt_received=len(observer.received) if observer is not None else 0,
        mqtt_reconnections=observer.reconnections if observer is not None else 0,
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


def _leader_of(cluster: LocalCluster) -> int:
    """The seed members' Raft leader, as the members' /cluster documents name it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for index in range(cluster.size):
            document = cluster.cluster(index) or {}
            if int(document.get("leader", -1)) >= 0:
                return int(document["leader"])
        time.sleep(0.1)
    raise RuntimeError("no member names a Raft leader")


async def _kill_child(cluster: LocalCluster, index: int, name: str) -> None:
    """SIGKILL one process of a member and wait until its supervisor has started another."""
    pid = cluster.processes(index).get(name)
    if pid is None:
        raise RuntimeError(f"member {index} has no {name} process")
    os.kill(pid, 9)
    deadline = time.monotonic() + 30
    while cluster.processes(index).get(name) in (None, pid):
        if time.monotonic() > deadline:
            raise RuntimeError(f"member {index}'s {name} was not restarted")
        await asyncio.sleep(0.05)


async def _wait_healthy(cluster: LocalCluster, index: int, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    while True:
        document = await loop.run_in_executor(None, cluster.health, index, 1.0)
        if document is not None and document.get("ready"):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"member {index} not ready after {timeout:.0f} s: {document}")
        await asyncio.sleep(0.05)


async def _restart_checked(cluster: LocalCluster, index: int, mode: str, probes: list[str]) -> None:
    await asyncio.get_running_loop().run_in_executor(None, cluster.start, index)
    await _probe_when_ready(cluster, index, mode, probes)


async def _probe_when_ready(
    cluster: LocalCluster, index: int, mode: str, probes: list[str], avoid: frozenset[int] | set[int] = frozenset()
) -> None:
    """The moment member ``index``'s /health says ready, check that it can do what that promises.

    ``avoid``: members not to publish through, because they are still faulted or just healed (a Standard
    member cut off numbers a subject on its own until its links are back: what it numbers then is the
    partition's loss, not a broken promise of ``index``'s /health).
    """
    loop = asyncio.get_running_loop()
    for _ in range(3):
        await _wait_healthy(cluster, index)
        said = time.monotonic()
        term, table = await loop.run_in_executor(None, _consensus_clock, cluster)
        problem = await _probe(cluster, index, mode == "Guaranteed", avoid)
        if " answered FAILED" in problem:
            term_now, table_now = await loop.run_in_executor(None, _consensus_clock, cluster)
            if term_now > term or ("coordinator changed" in problem and table_now > table):
                # an election, or a new table that moved the subject's group (a member admitted), came between
                # /health and the publication: refusing it then, for its publisher to retry, is the promise kept
                continue
        if problem:
            probes.append(f"member {index + 1}: /health said ready but {problem} ({time.monotonic() - said:.1f} s)")
        return
    probes.append(f"member {index + 1}: three elections or table changes in a row interrupted the probes of /health")


def _consensus_clock(cluster: LocalCluster) -> tuple[int, int]:
    """The highest Raft term and table version the live members name (both 0 in Standard mode)."""
    documents = [cluster.cluster(i) or {} for i in range(cluster.size) if cluster[i].alive]
    return (
        max((int(d.get("term", 0)) for d in documents), default=0),
        max((int(d.get("table_version", 0)) for d in documents), default=0),
    )


async def _probe(
    cluster: LocalCluster, index: int, guaranteed: bool, avoid: frozenset[int] | set[int] = frozenset()
) -> str:
    """Deliver to a subscriber on member ``index`` what another member numbers; answer a publication."""
    others = [i for i in range(cluster.size) if i != index and i not in avoid and cluster[i].alive]
    subject = f"/probe/m{index}-{random.randrange(1 << 30)}"
    limit = HEALTH_PROBE_TIMEOUT
    step = "connecting to it"
    try:
        async with MigratoryClient([cluster[index].ws_url], request_timeout=limit, backoff_max=0.2) as own:
            step = "subscribing on it"
            await own.subscribe([subject])
            step = "publishing through it"
            try:
                await own.publish(subject, b"probe-own", guaranteed=guaranteed, retries=0, raise_on_error=True)
            except PublishError as exc:
                return f"a publication through it was answered {exc.status.name} ({exc.reason})"
            step = "waiting for its own publication on its subscriber"
            if (await own.next_message(limit)).content != b"probe-own":
                return "its own publication did not reach its subscriber"
            for other in others[:1]:
                step = f"publishing through member {other + 1}"
                async with MigratoryClient([cluster[other].ws_url], request_timeout=limit) as elsewhere:
                    await elsewhere.publish(subject, b"probe-elsewhere", guaranteed=guaranteed, retries=5)
                step = f"waiting on its subscriber for what member {other + 1} published"
                if (await own.next_message(limit)).content != b"probe-elsewhere":
                    return f"a publication through member {other + 1} did not reach its subscriber"
    except (TimeoutError, OSError, ConnectionError) as exc:
        return f"the probe failed {step}: {type(exc).__name__}: {exc}"
    return ""


def _moved(recorder: Recorder, url: str, since: float, until: float) -> bool:
    """Whether the client was served by a member other than ``url`` between ``since`` and ``until``."""
    return any(
        kind == EventKind.NOTIFY_SERVER_UP.value and detail != url and since <= t <= until
        for kind, detail, t in recorder.server_changes
    )


def _ack_gap(times: list[float], fault_at: float) -> float | None:
    """The longest wait between two acknowledgements of one publisher loop, from the last one before the fault."""
    before = [t for t in times if t < fault_at]
    after = [t for t in times if t >= fault_at]
    if not before or not after:
        return None
    return max(b - a for a, b in itertools.pairwise([before[-1], *after]))


async def _prefill(cluster: LocalCluster, mode: str, subjects: int, messages: int) -> None:
    """History before the round: ``messages`` of 120 bytes on each of ``subjects`` subjects, in parallel."""
    payload = b"f" * 110
    guaranteed = mode == "Guaranteed"
    async with MigratoryClient([m.ws_url for m in cluster.members], request_timeout=20.0) as client:
        for n in range(messages):
            await asyncio.gather(
                *(
                    client.publish(f"/fill/s{k}", payload + b"%09d" % n, guaranteed=guaranteed, retries=5)
                    for k in range(subjects)
                )
            )


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
        try:
            snapshots = [cluster.snapshot(i, subject) for i in range(cluster.size)]
        except OSError as exc:  # urllib's URLError: a member that should answer does not
            out.append(f"{subject}: a member's /snapshot did not answer: {exc}")
            continue
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
        "violations": sum(len(r.violations) for r in results),
        "ack_gap_p50_s": round(percentile([g for r in results for g in r.ack_gaps], 50), 3),
        "ack_gap_max_s": round(max((g for r in results for g in r.ack_gaps), default=0.0), 3),
        # the faulted member's own clients: the longest any went unserved (failed over, or it came back)
        "victim_gap_p50_s": round(percentile([g for r in results for g in r.victim_gaps], 50), 3),
        "victim_gap_max_s": round(max((g for r in results for g in r.victim_gaps), default=0.0), 3),
    }


def summary_by_fault(results: list[RoundResult]) -> dict[str, dict[str, Any]]:
    """:func:`summary` for each mode and fault kind, as bench/failover.md reports them."""
    kinds: dict[str, list[RoundResult]] = {}
    for result in results:
        kinds.setdefault(f"{result.mode} {result.fault}", []).append(result)
    return {kind: summary(rounds) for kind, rounds in kinds.items()}
