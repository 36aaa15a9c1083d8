"""Cluster benchmarks: the same fan-out on one server and on a cluster, and client failover time.

``fanout`` runs the ``migratory bench run`` workload against one server or against a
local cluster (subscribers spread over the members by load-generator process, the
publisher on the first member) and measures the CPU of every member together, so
the cost of replication per message is the difference of the two, measured in one
run. ``failover`` connects many clients (the client library, in several processes so
the load generator is not the bottleneck) to a cluster, SIGKILLs one member, and
times each of its clients from the kill until it is connected to another member and
has the current state of its subject (NOTIFY_DATA_RESYNC and the snapshot in
Standard mode, NOTIFY_DATA_SYNC in Guaranteed mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from migratory.bench.cluster import LocalCluster, MemberProcess
from migratory.bench.runner import BenchConfig, Report, run
from migratory.bench.servers import make_test_pki, spawn
from migratory.client import EventKind, MigratoryClient, StatusEvent
from migratory.protocol import Status

__all__ = ["FailoverTimes", "failover", "failover_at_scale", "fanout", "on_cluster", "publish_latency"]

QUIET = {"MessageLog": "false", "AccessLog": "false", "KeepAliveInterval": "3600000", "MaxPendingOutput": "64MB"}


def fanout(
    folder: Path,
    members: int,
    *,
    mode: str = "Standard",
    workers: int = 1,
    clients: int = 1000,
    subjects: int = 10,
    size: int = 64,
    rate: float = 0.0,
    messages: int = 2000,
    processes: int = 2,
) -> Report:
    """One fan-out workload against one server (``members == 1``) or a local cluster."""
    config = BenchConfig(
        target="migratory",
        clients=clients,
        subjects=subjects,
        size=size,
        rate=rate,
        messages=messages,
        processes=processes,
        burst=max(1, subjects * 5),
    )
    if members == 1:
        server = spawn("migratory", "127.0.0.1", workers)
        try:
            config.host, config.port, config.server_pid = server.host, server.port, server.proc.pid
            report = run(config)
        finally:
            server.stop()
        report.target = "migratory (1 server)"
        return report
    config.processes = max(processes, members)
    config.workers = workers
    return on_cluster(folder, config, members, mode)


@contextlib.contextmanager
def _started(
    folder: Path, config: BenchConfig, members: int, mode: str, workers: list[int], timeout: float
) -> Iterator[LocalCluster]:
    """A local cluster for ``config``, every member started and seeing every other (the product's heartbeat).

    ``migratory-wss``: every member also serves ``ListenEncrypted`` with a certificate of a test CA made
    for the run (``config.ca``), and the clients and the publisher use it."""
    tls = None
    if config.target == "migratory-wss":
        hosts = [f"127.0.0.{1 + i}" for i in range(members)]  # LocalCluster's own addresses
        ca, cert, key = make_test_pki(folder / "pki", *hosts)
        config.ca, tls = str(ca), (cert, key)
    with LocalCluster(
        folder,
        members,
        mode=mode,
        workers=workers,
        extra={**QUIET, **config.settings},
        heartbeat_interval=500,
        heartbeat_timeout=3000,
        tls=tls,
    ) as cluster:
        cluster.start_all(ready_timeout=timeout)
        for index in range(members):
            cluster.wait_view(index, set(range(members)), timeout=timeout)
        yield cluster


def _port(member: MemberProcess) -> int:
    """Where the bench's clients connect: ListenEncrypted when the cluster serves wss://, else Listen."""
    return member.tls_port or member.client_port


def failover_at_scale(folder: Path, config: BenchConfig, members: int = 3, mode: str = "Guaranteed") -> Report:
    """``config``'s clients spread over the first ``members - 1`` members, which fail over when member 1 dies.

    The publisher is alone on the last member (one worker: a Guaranteed cluster needs a majority of
    three seeds, and this one keeps quorum through the kill). ``config.kill_after`` seconds into
    publishing member 1 is SIGKILLed and its clients reconnect to the next member with their positions;
    ``config.restart_after`` seconds in it starts again and rejoins under the load
    (migratory/bench/roaming.py checks every client's sequence). Each serving member has
    ``config.workers`` workers: enough for all the clients, since one of them ends up holding them all.
    """
    serving = members - 1
    with _started(folder, config, members, mode, [config.workers] * serving + [1], 180) as cluster:
        publisher = cluster[members - 1]
        config.host, config.port = publisher.host, _port(publisher)
        config.endpoints = [(m.host, _port(m)) for m in cluster.members[:serving]]
        # the members that survive are measured: their CPU and memory while they take the displaced clients
        config.server_pids = [m.proc.pid for m in cluster.members[1:] if m.proc is not None]
        config.spawn = False

        def rejoined() -> None:
            cluster.wait_ready([0], timeout=300)
            cluster.wait_view(0, set(range(members)), timeout=300)

        actions = {"kill": lambda: cluster.kill(0), "restart": lambda: cluster.start(0), "rejoined": rejoined}
        try:
            report = run(config, actions=actions)
        finally:
            _keep_logs(cluster, config.logs)  # a run that failed is the one whose logs are wanted
        report.member_warnings = _member_warnings(cluster)
        report.pauses = pauses_by_phase(cluster, report.timeline)
    report.target = f"{config.target} ({members} members, {mode}, member 1 SIGKILLed and restarted)"
    return report


def on_cluster(
    folder: Path, config: BenchConfig, members: int, mode: str = "Standard", *, publisher_apart: bool = False
) -> Report:
    """Run ``config`` against a local cluster of ``members`` members of ``config.workers`` workers each.

    Load-generator process i connects to member i % members and the publisher to the
    first member. ``publisher_apart``: the publisher alone on the last member (one
    worker), the clients on the others, so that every delivery crosses a member link.
    """
    serving = members - 1 if publisher_apart else members
    workers = [config.workers] * serving + [1] * (members - serving)
    # the product's heartbeat (500 ms, 3 s), not the fault tests' fast one: a member agent among a
    # hundred busy processes on two cores misses a 1-s deadline, and the link flaps
    with _started(folder, config, members, mode, workers, 120) as cluster:
        publisher = cluster[members - 1] if publisher_apart else cluster[0]
        config.host, config.port = publisher.host, _port(publisher)
        config.endpoints = [(m.host, _port(m)) for m in cluster.members[:serving]]
        config.server_pids = [m.proc.pid for m in cluster.members if m.proc is not None]
        config.spawn = False  # the cluster is the server
        try:
            report = run(config)
        finally:
            _keep_logs(cluster, config.logs)
        report.member_warnings = _member_warnings(cluster)
        report.pauses = pauses_by_phase(cluster, report.timeline)
    report.target = f"{config.target} ({members} members, {mode}{', publisher apart' if publisher_apart else ''})"
    return report


# pauses.py's lines: which process, what kind (a collection, a starved loop, a long task, blocked) and how long
# (logs of before the CPU share was logged: a stall without its cause)
_PAUSE = re.compile(
    r"^(?P<who>worker \d+|member agent): (?:garbage collection of generation (?P<gen>\d+) held the process for"
    r" (?P<gc>[\d.]+) s|event loop stalled for (?P<late>[\d.]+) s(?:, (?P<busy>[\d.]+) s of it on the CPU"
    r"(?:, (?P<queued>[\d.]+) s waiting for a core)? \((?P<cause>[^)]*)\))?)"
)


def _member_warnings(cluster: LocalCluster, keep: int = 20) -> list[str]:
    """What the members logged at WARNING or worse during the run: every line about the cluster (a member
    link that went down explains messages a Standard-mode cluster did not deliver) and the member agent,
    up to ``keep`` a member; the workers' own stalls and long collections (pauses.py), hundreds on a
    saturated host, as one count with the longest."""
    out = []
    for index in range(len(cluster.members)):
        lines = []
        pauses: list[float] = []
        for record in _warnings(cluster, index):
            message = str(record.get("msg", ""))
            pause = _PAUSE.match(message)
            if pause and pause["who"] != "member agent":
                pauses.append(float(pause["gc"] or pause["late"]))
            else:
                lines.append(f"{record.get('ts', '')} {message}")
        out += [f"member {index}: {line[:200]}" for line in lines[:keep]]
        if len(lines) > keep:
            out.append(f"member {index}: {len(lines) - keep} more warnings")
        if pauses:
            out.append(
                f"member {index}: {len(pauses)} worker stalls or long garbage collections,"
                f" the longest {max(pauses):.1f} s"
            )
    return out


def _keep_logs(cluster: LocalCluster, into: str) -> None:
    """Copy every member's logs to ``into``/member-N (``--logs``): the run's folder is removed after it."""
    if not into:
        return
    for member in cluster.members:
        source = member.folder / "logs"
        if source.is_dir():
            shutil.copytree(source, Path(into) / member.folder.name, dirs_exist_ok=True)


def _warnings(cluster: LocalCluster, index: int) -> Iterator[dict[str, Any]]:
    """Member ``index``'s log records at WARNING or worse, in order."""
    for line in cluster.server_log(index).splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("level") in ("WARNING", "ERROR", "CRITICAL"):
            yield record


def pauses_by_phase(cluster: LocalCluster, timeline: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The members' pauses (pauses.py) placed in the run's phases by their timestamps: per phase (the
    timeline entry each follows: ``connected`` is the clients' subscribing done, ``publishing`` the
    publishing, ``drained`` the teardown), how many worker collections, worker stalls waiting for a
    core, worker long tasks and agent pauses, and the longest of each. Says which phase a tail comes
    from, and whether the agent (the member links' heartbeats) ever stopped."""
    marks = sorted((at, name) for name, at in timeline.items())
    table: dict[str, dict[str, Any]] = {}
    for index in range(len(cluster.members)):
        for record in _warnings(cluster, index):
            found = _PAUSE.match(str(record.get("msg", "")))
            if not found:
                continue
            at = str(record.get("ts", ""))
            phase = "before"
            for mark, name in marks:
                if mark <= at:
                    phase = name
            if found["gc"] is not None:
                kind, seconds = f"collection (generation {found['gen']})", float(found["gc"])
            else:
                cause = found["cause"]
                kind = (
                    "stalled"
                    if cause is None
                    else "starved"
                    if "waiting" in cause
                    else "blocked"
                    if cause == "blocked"
                    else "long task"
                )
                seconds = float(found["late"])
            who = "agent" if found["who"] == "member agent" else "worker"
            row = table.setdefault(phase, {})
            entry = row.setdefault(f"member {index} {who} {kind}", {"count": 0, "longest_s": 0.0})
            entry["count"] += 1
            entry["longest_s"] = max(entry["longest_s"], seconds)
    return table


@dataclass
class FailoverTimes:
    clients: int
    victims: int
    times: list[float]
    errors: list[str]

    def summary(self) -> dict[str, Any]:
        ordered = sorted(self.times)

        def pick(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3) if ordered else 0.0

        return {
            "clients": self.clients,
            "clients_on_the_killed_member": self.victims,
            "failed_over": len(self.times),
            "p50_s": pick(0.5),
            "p99_s": pick(0.99),
            "max_s": round(max(ordered, default=0.0), 3),
            "errors": self.errors[:10],
        }


def _client_process(urls: list[str], count: int, first: int, subjects: list[str], pipe: Connection) -> None:
    asyncio.run(_clients(urls, count, first, subjects, pipe))


async def _clients(urls: list[str], count: int, first: int, subjects: list[str], pipe: Connection) -> None:
    killed = [0.0]
    victim = [""]
    done: dict[int, float] = {}

    def listener(i: int) -> Any:
        def on_status(event: StatusEvent) -> None:
            if killed[0] and i not in done and event.kind in (EventKind.NOTIFY_DATA_RESYNC, EventKind.NOTIFY_DATA_SYNC):
                done[i] = time.monotonic() - killed[0]

        return on_status

    servers: list[str | tuple[str, float]] = [(url, 100.0) for url in urls]
    clients = [
        MigratoryClient(servers, on_status=listener(i), backoff_initial=0.05, backoff_max=2.0, request_timeout=30)
        for i in range(count)
    ]
    for start in range(0, count, 50):
        await asyncio.gather(*(c.connect(60) for c in clients[start : start + 50]))
    for i, client in enumerate(clients):
        await client.subscribe([subjects[(first + i) % len(subjects)]])
    pipe.send(("ready", [c.server for c in clients]))
    loop = asyncio.get_running_loop()
    command = await loop.run_in_executor(None, pipe.recv)
    killed[0], victim[0] = command[1], command[2]
    mine = [i for i, c in enumerate(clients) if c.server == victim[0]]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(i in done for i in mine):
        await asyncio.sleep(0.05)
    pipe.send(("times", [done[i] for i in mine if i in done], len(mine)))
    for client in clients:
        await client.close()


def failover(
    folder: Path, *, members: int = 3, clients: int = 1000, processes: int = 4, mode: str = "Standard", workers: int = 2
) -> FailoverTimes:
    """SIGKILL one member under ``clients`` clients; time each of its clients back to a current state."""
    subjects = [f"/failover/s{i}" for i in range(10)]
    context = multiprocessing.get_context("fork")
    with LocalCluster(folder, members, mode=mode, workers=workers, extra=QUIET) as cluster:
        cluster.start_all(ready_timeout=60)
        for index in range(members):
            cluster.wait_view(index, set(range(members)), timeout=60)
        urls = [m.ws_url for m in cluster.members]
        pipes = []
        share = clients // processes
        for p in range(processes):
            parent, child = context.Pipe()
            proc = context.Process(target=_client_process, args=(urls, share, p * share, subjects, child), daemon=True)
            proc.start()
            pipes.append((proc, parent))
        placements: list[str] = []
        for _, pipe in pipes:
            placements.extend(pipe.recv()[1])

        async def publish(value: bytes) -> None:
            async with MigratoryClient([urls[0]]) as publisher:
                for subject in subjects:
                    status = await publisher.publish(subject, value, guaranteed=mode == "Guaranteed", retries=5)
                    assert status in (Status.OK, Status.NO_SUBSCRIBER), status

        asyncio.run(publish(b"before"))
        time.sleep(1.0)
        victim = members - 1
        killed_at = time.monotonic()
        cluster.kill(victim)
        for _, pipe in pipes:
            pipe.send(("killed", killed_at, urls[victim]))
        asyncio.run(publish(b"after"))
        times: list[float] = []
        victims = 0
        for proc, pipe in pipes:
            message = pipe.recv()
            times.extend(message[1])
            victims += message[2]
            proc.join(30)
    errors = [] if len(times) == victims else [f"{victims - len(times)} clients did not fail over in 60 s"]
    return FailoverTimes(len(placements), victims, times, errors)


def publish_latency(
    folder: Path, *, members: int = 3, mode: str = "Standard", publishes: int = 2000, subjects: int = 10
) -> dict[str, Any]:
    """Milliseconds from PUBLISH to its PUBLISH_OK, one publication at a time, from a client on member 1.

    Subjects are spread over the groups, so most are coordinated by another member:
    what is measured is the whole path a publisher waits for (forwarding, numbering,
    and in Guaranteed mode the second member's acknowledgement).
    """
    with LocalCluster(folder, members, mode=mode, extra=QUIET) as cluster:
        cluster.start_all(ready_timeout=60)
        for index in range(members):
            cluster.wait_view(index, set(range(members)), timeout=60)

        async def measure() -> list[float]:
            out = []
            async with MigratoryClient([cluster[0].ws_url]) as publisher:
                for n in range(publishes):
                    started = time.perf_counter()
                    status = await publisher.publish(f"/latency/s{n % subjects}", b"x" * 64, guaranteed=True)
                    out.append((time.perf_counter() - started) * 1000)
                    if status not in (Status.OK, Status.NO_SUBSCRIBER):
                        raise RuntimeError(f"publish {n}: {status.name}")
            return out

        times = sorted(asyncio.run(measure())[publishes // 10 :])  # the first tenth warms up

    def pick(q: float) -> float:
        return round(times[min(len(times) - 1, round(q * (len(times) - 1)))], 3)

    return {"mode": mode, "members": members, "publishes": len(times), "p50_ms": pick(0.5), "p99_ms": pick(0.99)}
