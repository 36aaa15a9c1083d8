"""Run one benchmark: connect, subscribe, publish, measure, report."""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

from migratory.bench.loader import BUCKETS, LoaderSpec, bucket_upper_ns, loader_main, open_client
from migratory.bench.roaming import roamer_main
from migratory.bench.servers import MultiMeter, ProcessMeter, SpawnedServer, spawn
from migratory.bench.wire import TLS_TARGETS, Codec, base_target, codec_for

__all__ = ["BROADCAST_TARGETS", "BenchConfig", "Report", "run"]

BROADCAST_TARGETS = ("ws-broadcast", "websockets")
# Connection attempts in flight across all loaders: enough to keep the server busy, few enough
# that none waits out the server's HandshakeTimeout (10 s) when fifty loaders share two cores.
IN_FLIGHT = 2048
# At rates above 1/PUBLISH_TICK the publisher writes what is due every PUBLISH_TICK seconds (each message
# stamped when written, so the latency measured includes nothing of the wait).
PUBLISH_TICK = 0.005


@dataclass
class BenchConfig:
    """One workload; every field is a ``migratory bench`` option."""

    target: str = "migratory"
    host: str = "127.0.0.1"
    port: int = 8800
    clients: int = 100
    subjects: int = 1
    subjects_per_client: int = 1
    size: int = 64
    rate: float = 0.0  # messages per second in total; 0 = closed-loop bursts (saturation)
    messages: int = 100
    burst: int = 50
    processes: int = 2
    sources: list[str] = field(default_factory=lambda: ["127.0.0.1"])
    server_pid: int = 0
    spawn: bool = False
    workers: int = 1
    idle_seconds: float = 0.0
    drain_timeout: float = 60.0
    disconnect: bool = False  # storm: disconnect everyone at the end and measure memory again
    endpoints: list[tuple[str, int]] = field(default_factory=list)  # a cluster: loader i uses endpoints[i % n]
    server_pids: list[int] = field(default_factory=list)  # a cluster: every member's supervisor
    settings: dict[str, str] = field(default_factory=dict)  # extra configuration of a spawned migratory server
    ca: str = ""  # a TLS target's CA file (set by --spawn, which makes a test CA)
    # the load generators' TLS: "lean" (TLS 1.3, migratory/bench/leantls.py, a few hundred bytes a connection)
    # or "openssl" (the event loop's TLS transport, about 25 KB a connection: too much for a million)
    tls_client: str = "lean"
    loader_poll: float = 0.0  # seconds between the loaders' reads once subscribed (LoaderSpec.poll); 0: on each
    # failover (roaming clients, migratory/bench/roaming.py): seconds after publishing starts to run the
    # "kill" action (a member's SIGKILL) and the "restart" action (the same member back); 0: never
    kill_after: float = 0.0
    restart_after: float = 0.0
    logs: str = ""  # a spawned cluster: a folder to copy every member's logs into after the run


@dataclass
class Report:
    target: str
    clients: int
    subjects: int
    subjects_per_client: int
    size: int
    rate: float
    connected: int = 0
    connect_errors: int = 0
    connect_refused_retried: int = 0  # upgrades answered 503 (a member not ready) and tried again, as clients do
    connect_seconds: float = 0.0
    connect_rate: float = 0.0
    published: int = 0
    expected_deliveries: int = 0
    delivered: int = 0
    publish_seconds: float = 0.0
    deliveries_per_second: float = 0.0
    latency_ms: dict[str, float] = field(default_factory=dict)
    server_cpu_seconds: float = 0.0
    # from before the first client until every client is connected and subscribed: what accepting costs
    # (with TLS, the handshakes: the difference from the same run without TLS)
    server_cpu_seconds_connecting: float = 0.0
    server_cpu_us_per_connection: float = 0.0
    server_cpu_system_seconds: float = 0.0
    server_cpu_us_per_delivery: float = 0.0
    loader_cpu_seconds: float = 0.0  # the load generators' own CPU while publishing (they share the machine)
    loader_cpu_us_per_delivery: float = 0.0
    server_rss_mb_before: float = 0.0
    server_rss_mb_connected: float = 0.0
    server_rss_mb_after_disconnect: float = 0.0
    server_bytes_per_connection: float = 0.0
    server_pss_mb_before: float = 0.0
    server_pss_mb_connected: float = 0.0
    server_pss_bytes_per_connection: float = 0.0
    # after publishing and the drain, the connections still open: what working costs beyond idle
    server_pss_mb_published: float = 0.0
    server_pss_bytes_per_connection_published: float = 0.0
    server_processes: int = 0  # supervisor and workers (and a member's agent) when the clients connected
    server_pss_mb_per_process_before: float = 0.0  # the fixed cost of one more worker
    sockstat_before: dict[str, int] = field(default_factory=dict)  # /proc/net/sockstat's TCP line
    sockstat_connected: dict[str, int] = field(default_factory=dict)
    load_average: list[float] = field(default_factory=list)  # 1, 5, 15 minutes, when the run started
    loader_poll: float = 0.0  # the load generators' read interval once subscribed (0: on every message)
    tls_client: str = ""  # a TLS target: the load generators' TLS client (lean or openssl)
    settings: dict[str, str] = field(default_factory=dict)  # --set: the spawned server's extra configuration
    # UTC wall-clock time of each phase's start (started, connected, publishing, drained, stopping,
    # closed): places a member's timestamped warning in the run (subscribing, publishing or tearing down)
    timeline: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # a local cluster: what its members logged at WARNING or worse (a dropped member link, a stalled
    # process), the teardown included; context for the figures, not a failure of the run by itself
    member_warnings: list[str] = field(default_factory=list)
    # the same members' pauses (stalls, long collections; worker and agent) by phase of the run
    pauses: dict[str, dict[str, Any]] = field(default_factory=dict)
    # a failover run: the displaced clients' outage, latency by phase, sequence checks (roaming.py)
    failover: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Progress = Callable[[str, dict[str, float]], None]


def _subjects_of(config: BenchConfig, client: int) -> list[str]:
    return [
        f"/bench/s{(client * config.subjects_per_client + k) % config.subjects}"
        for k in range(config.subjects_per_client)
    ]


class _Subjects(Sequence[list[str]]):
    """The subjects of a loader's clients, made when asked: a million lists would cost the parent memory."""

    def __init__(self, config: BenchConfig, members: range) -> None:
        self.config = config
        self.members = members

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, index: int) -> list[str]:  # type: ignore[override]
        return _subjects_of(self.config, self.members[index])


def sockstat() -> dict[str, int]:
    """The kernel's TCP socket counts and memory (pages) of this network namespace."""
    try:
        for line in Path("/proc/net/sockstat").read_text().splitlines():
            if line.startswith("TCP:"):
                words = line.split()[1:]
                return {words[i]: int(words[i + 1]) for i in range(0, len(words) - 1, 2)}
    except OSError:
        pass
    return {}


def _percentiles(histogram: list[int], max_ns: int) -> dict[str, float]:
    total = sum(histogram)
    out: dict[str, float] = {}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999)):
        if not total:
            out[name] = 0.0
            continue
        rank = q * total
        seen = 0
        for index, count in enumerate(histogram):
            seen += count
            if seen >= rank:
                out[name] = round(min(bucket_upper_ns(index), max_ns) / 1e6, 3)
                break
    out["max"] = round(max_ns / 1e6, 3)
    return out


class _Publisher(asyncio.Protocol):
    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        _, answer = self.codec.feed(data)
        if answer and self.transport is not None:
            self.transport.write(answer)
        if not self.ready.done() and self.codec.is_ready(0):
            self.ready.set_result(None)


Actions = Mapping[str, Callable[[], object]]


def run(config: BenchConfig, progress: Progress | None = None, actions: Actions | None = None) -> Report:
    """Run the workload and return its report (spawning the server when asked).

    ``actions``: what ``kill_after`` and ``restart_after`` do ("kill", "restart"), in a thread.
    """
    notify: Progress = progress or (lambda phase, values: None)
    server: SpawnedServer | None = None
    if config.spawn:
        server = spawn(config.target, config.host, config.workers, settings=config.settings)
        config.port = server.port
        config.server_pid = server.proc.pid
        config.ca = server.extra.get("ca", "")
    if config.target in TLS_TARGETS and not config.ca:
        raise ValueError(f"{config.target}: give the CA file that its certificate is checked against (--ca)")
    try:
        return _run(config, notify, actions or {})
    finally:
        if server is not None:
            server.stop()


LOADER_CLOSE_TIMEOUT = 120.0  # seconds every loader gets, after "stop", to send its last counts and "closed"


def _collect_closed(
    loaders: list[tuple[Any, Connection]],
    delivered: list[int],
    loader_cpu: list[float],
    roams: list[Any],
    report: Report,
) -> None:
    """Every loader's last words after "stop", read from all pipes at once (a loader blocked writing a
    large last message must not wait behind another's), within LOADER_CLOSE_TIMEOUT; a loader that
    does not close is terminated and reported, so that the run still ends with its report."""
    index = {id(pipe): i for i, (_, pipe) in enumerate(loaders)}
    open_pipes = [pipe for _, pipe in loaders]
    deadline = time.monotonic() + LOADER_CLOSE_TIMEOUT
    while open_pipes and time.monotonic() < deadline:
        for pipe in multiprocessing.connection.wait(open_pipes, timeout=max(0.0, deadline - time.monotonic())):
            assert isinstance(pipe, Connection)
            i = index[id(pipe)]
            try:
                message = pipe.recv()
            except EOFError:
                report.errors.append(f"load generator {i} exited before reporting its last counts")
                open_pipes.remove(pipe)
                continue
            if message[0] == "closed":
                open_pipes.remove(pipe)
                if message[2]:
                    report.errors.append(f"load generator {i}: {message[2]} clients did not end when cancelled")
                malformed, examples = message[3]
                if malformed:
                    report.errors.append(
                        f"load generator {i}: {malformed} clients received what they could not decode once "
                        f"subscribed: {'; '.join(examples)}"
                    )
            elif message[0] == "roam":  # the last counts, after the drain
                delivered[i], _, loader_cpu[i], roams[i] = message[1:5]
    for pipe in open_pipes:
        i = index[id(pipe)]
        report.errors.append(f"load generator {i} did not close within {LOADER_CLOSE_TIMEOUT:.0f} s: terminated")
        loaders[i][0].terminate()
    for i, (proc, _) in enumerate(loaders):
        proc.join(30)
        if proc.is_alive():
            report.errors.append(f"load generator {i} did not exit after closing: terminated")
            proc.terminate()
            proc.join(5)


def _utc_now() -> str:
    """The members' log format (ISO 8601, milliseconds, Z), so the two read side by side."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _run(config: BenchConfig, notify: Progress, actions: Actions) -> Report:
    report = Report(
        config.target, config.clients, config.subjects, config.subjects_per_client, config.size, config.rate
    )
    report.load_average = [round(v, 2) for v in os.getloadavg()]
    report.loader_poll, report.settings = config.loader_poll, dict(config.settings)
    report.tls_client = config.tls_client if config.ca else ""
    meter: ProcessMeter | MultiMeter | None = ProcessMeter(config.server_pid) if config.server_pid else None
    if config.server_pids:
        meter = MultiMeter([ProcessMeter(pid) for pid in config.server_pids])
    if meter is not None:
        time.sleep(0.5)
        report.server_rss_mb_before = meter.rss_bytes() / 2**20
        report.server_pss_mb_before = meter.pss_bytes() / 2**20
    cpu_started = sum(meter.cpu_split()) if meter is not None else 0.0
    context = multiprocessing.get_context("fork")
    report.sockstat_before = sockstat()
    per_process = [range(i, config.clients, config.processes) for i in range(config.processes)]
    roaming = bool(config.kill_after)
    loaders = []
    started = time.monotonic()
    report.timeline["started"] = _utc_now()
    for index, members in enumerate(per_process):
        if not members:
            continue
        parent, child = context.Pipe()
        host, port = config.endpoints[index % len(config.endpoints)] if config.endpoints else (config.host, config.port)
        spec = LoaderSpec(
            config.target,
            host,
            port,
            config.sources[index % len(config.sources)],
            _Subjects(config, members),
            concurrency=max(8, IN_FLIGHT // config.processes),
            ca=config.ca,
            sources=tuple(config.sources[index :: config.processes]),  # more addresses than loaders: shared out
            poll=config.loader_poll,
            lean_tls=config.tls_client == "lean",
            endpoints=tuple(config.endpoints),
        )
        main = roamer_main if roaming else loader_main
        proc = context.Process(target=main, args=(spec, child), daemon=True)
        proc.start()
        child.close()  # the loader's end lives in the loader only: its exit is an EOF here
        loaders.append((proc, parent))
    reasons: dict[str, int] = {}
    for _, pipe in loaders:
        message = pipe.recv()
        report.connected += message[1]
        report.connect_errors += message[2]
        report.connect_refused_retried += message[5] if len(message) > 5 else 0
        for reason, count in message[4].items():
            reasons[reason] = reasons.get(reason, 0) + count
        notify("connect", {"connected": report.connected, "clients": config.clients})
    report.connect_seconds = round(time.monotonic() - started, 3)
    report.timeline["connected"] = _utc_now()
    report.connect_rate = round(report.connected / max(report.connect_seconds, 1e-9), 1)
    cpu_connected = sum(meter.cpu_split()) if meter is not None else 0.0  # before any idle time
    if config.idle_seconds:
        time.sleep(config.idle_seconds)
    delivered = [0] * len(loaders)
    histograms = [[0] * BUCKETS for _ in loaders]
    max_ns = [0] * len(loaders)
    sum_ns = [0] * len(loaders)
    loader_cpu = [0.0] * len(loaders)
    roams: list[dict[str, Any]] = [{} for _ in loaders]

    def poll() -> int:
        for i, (_, pipe) in enumerate(loaders):
            while pipe.poll():
                message = pipe.recv()
                if message[0] == "stats":
                    delivered[i], histograms[i], max_ns[i], sum_ns[i], loader_cpu[i] = message[1:6]
                elif message[0] == "roam":
                    delivered[i], _, loader_cpu[i], roams[i] = message[1:5]
        return sum(delivered)

    def tell(command: tuple[str, Any]) -> None:
        """Tell the roaming loaders a phase began (they keep live latencies per phase), or when the fault was."""
        if command[0] == "phase":
            report.timeline[command[1]] = _utc_now()
        for _, pipe in loaders:
            pipe.send(command)

    endpoints = max(1, len(config.endpoints))
    displaced = sum(len(range(0, len(members), endpoints)) for members in per_process)  # roaming.py: index % n

    report.sockstat_connected = sockstat()
    if meter is not None:
        report.server_processes = meter.processes()
        processes = max(report.server_processes, 1)
        report.server_pss_mb_per_process_before = round(report.server_pss_mb_before / processes, 2)
        report.server_rss_mb_connected = meter.rss_bytes() / 2**20
        report.server_pss_mb_connected = meter.pss_bytes() / 2**20
        report.server_cpu_seconds_connecting = round(cpu_connected - cpu_started, 3)
        if report.connected:
            report.server_cpu_us_per_connection = round(
                report.server_cpu_seconds_connecting * 1e6 / report.connected, 1
            )
            report.server_bytes_per_connection = round(
                (report.server_rss_mb_connected - report.server_rss_mb_before) * 2**20 / report.connected, 1
            )
            report.server_pss_bytes_per_connection = round(
                (report.server_pss_mb_connected - report.server_pss_mb_before) * 2**20 / report.connected, 1
            )
    subscribers: dict[str, int] = {}
    if config.target in BROADCAST_TARGETS:  # no subjects: every client receives every message
        subscribers = {f"/bench/s{i}": report.connected for i in range(config.subjects)}
    else:
        for client in range(config.clients):
            for subject in _subjects_of(config, client):
                subscribers[subject] = subscribers.get(subject, 0) + 1
    if config.messages:
        time.sleep(0.25)  # every loader's latest stats (a few a second), for its CPU before publishing
        poll()
        loader_cpu_before = sum(loader_cpu)
        cpu_before = meter.cpu_split() if meter is not None else (0.0, 0.0)
        publish_started = time.monotonic()
        report.timeline["publishing"] = _utc_now()
        control = _FaultControl(config, actions, tell, roams, poll, displaced) if roaming else None
        asyncio.run(_publish(config, report, subscribers, poll, notify, control))
        deadline = time.monotonic() + config.drain_timeout
        while poll() < report.expected_deliveries and time.monotonic() < deadline:
            notify("drain", {"delivered": sum(delivered), "expected": report.expected_deliveries})
            time.sleep(0.1)
        time.sleep(0.3)
        report.delivered = poll()
        report.timeline["drained"] = _utc_now()
        report.publish_seconds = round(time.monotonic() - publish_started, 3)
        report.deliveries_per_second = round(report.delivered / max(report.publish_seconds, 1e-9), 1)
        report.loader_cpu_seconds = round(sum(loader_cpu) - loader_cpu_before, 3)
        if report.delivered:
            report.loader_cpu_us_per_delivery = round(report.loader_cpu_seconds * 1e6 / report.delivered, 3)
        if meter is not None:
            report.server_pss_mb_published = meter.pss_bytes() / 2**20
            if report.connected:
                report.server_pss_bytes_per_connection_published = round(
                    (report.server_pss_mb_published - report.server_pss_mb_before) * 2**20 / report.connected, 1
                )
            user, system = meter.cpu_split()
            report.server_cpu_seconds = round(user + system - sum(cpu_before), 3)
            report.server_cpu_system_seconds = round(system - cpu_before[1], 3)
            if report.delivered:
                report.server_cpu_us_per_delivery = round(report.server_cpu_seconds * 1e6 / report.delivered, 3)
        if roaming and meter is not None:  # with the displaced clients, before anyone leaves
            report.failover["survivor_pss_mb"] = round(meter.pss_bytes() / 2**20, 1)
            report.failover["survivor_processes"] = meter.processes()
        if not roaming:
            merged = [sum(h[i] for h in histograms) for i in range(BUCKETS)]
            report.latency_ms = _percentiles(merged, max(max_ns))
            report.latency_ms["mean"] = round(sum(sum_ns) / max(sum(delivered), 1) / 1e6, 3)
            if report.delivered != report.expected_deliveries:
                report.errors.append(f"delivered {report.delivered} of {report.expected_deliveries} messages")
    report.timeline["stopping"] = _utc_now()
    for _, pipe in loaders:
        pipe.send("stop")
    _collect_closed(loaders, delivered, loader_cpu, roams, report)
    if roaming and config.messages:
        report.delivered = sum(delivered)
        _failover_report(report, roams, control)
        if report.delivered < report.expected_deliveries:
            # more is possible: a publication answered FAILED in the failover may still have been numbered
            # (every client checks each seq instead)
            report.errors.append(f"delivered {report.delivered} of {report.expected_deliveries} messages")
    report.timeline["closed"] = _utc_now()
    if report.connect_errors:
        common = sorted(reasons.items(), key=lambda item: -item[1])[:3]
        report.errors.append(
            f"{report.connect_errors} clients failed to connect or subscribe ("
            + "; ".join(f"{count} x {reason}" for reason, count in common)
            + ")"
        )
    if config.disconnect and meter is not None:
        time.sleep(2.0)
        report.server_rss_mb_after_disconnect = meter.rss_bytes() / 2**20
    return report


def _deliverable(report: Report, codec: object, subscribers: dict[str, int]) -> int:
    """The deliveries still to come: those of the publications not refused (FAILED, DENIED, ...)."""
    unpublished: dict[str, int] = getattr(codec, "unpublished", {})
    return report.expected_deliveries - sum(subscribers.get(s, 0) * n for s, n in unpublished.items())


class _FaultControl:
    """Runs the kill and the restart of a failover run at their times, and names the phases."""

    def __init__(
        self,
        config: BenchConfig,
        actions: Actions,
        tell: Callable[[tuple[str, Any]], None],
        roams: list[dict[str, Any]],
        poll: Callable[[], int],
        displaced: int,
    ) -> None:
        self.config = config
        self.actions = actions
        self.tell = tell
        self.roams = roams
        self.poll = poll
        self.displaced = displaced  # the clients of the member that is killed (roaming.py spreads them)
        self.killed_at = 0.0  # loop time
        self.fault_ns = 0
        self.recovered_at = 0.0
        self.restarted_at = 0.0
        self.restart_seconds = 0.0
        self.rejoin_error = ""  # the restarted member did not rejoin (the wait's error)
        self.pending: asyncio.Future[object] | None = None

    def recovered(self) -> tuple[int, int]:
        """(clients displaced, of which still recovering), as the loaders last said."""
        return sum(r.get("displaced", 0) for r in self.roams), sum(r.get("awaiting", 0) for r in self.roams)

    def _kill(self) -> None:
        self.fault_ns = time.time_ns()  # the outage is timed from the signal, not from the phase's start
        self.actions["kill"]()

    async def tick(self, elapsed: float) -> None:
        loop = asyncio.get_running_loop()
        config = self.config
        if not self.killed_at and elapsed >= config.kill_after and "kill" in self.actions:
            self.tell(("phase", "storm"))
            self.killed_at = loop.time()
            await loop.run_in_executor(None, self._kill)
            self.tell(("fault", self.fault_ns))
        elif self.killed_at and not self.recovered_at:
            displaced, awaiting = self.recovered()
            if displaced >= self.displaced and not awaiting:
                self.recovered_at = loop.time()
                if not self.restarted_at:
                    self.tell(("phase", "after"))
        if (
            self.killed_at
            and not self.restarted_at
            and config.restart_after
            and elapsed >= config.restart_after
            and "restart" in self.actions
        ):
            self.tell(("phase", "rejoin"))
            self.restarted_at = loop.time()
            # started from this (the main) thread: a child started from an executor's thread would get its
            # parent-death signal when that thread ends; only the wait for the rejoin runs in the executor
            self.actions["restart"]()
            if "rejoined" in self.actions:
                self.pending = asyncio.ensure_future(loop.run_in_executor(None, self.actions["rejoined"]))

    async def done(self) -> None:
        """Wait for the recovery (within the drain time) and the rejoin, the loaders' pipes kept drained."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while self.killed_at and not self.recovered_at and loop.time() - start < self.config.drain_timeout:
            self.poll()
            await self.tick(float("-inf"))  # recovery only: nothing is started now
            await asyncio.sleep(0.05)
        if self.pending is not None:
            while not self.pending.done():
                self.poll()
                await asyncio.sleep(0.05)
            try:
                self.pending.result()
            except (RuntimeError, TimeoutError) as exc:  # reported with the run's figures, not instead of them
                self.rejoin_error = str(exc)[:300]
            else:
                self.restart_seconds = loop.time() - self.restarted_at


def _hist_ms(h: list[Any]) -> dict[str, float]:
    """Percentiles (ms) of a roaming loader's merged histogram ``[buckets, count, sum_ns, max_ns]``."""
    buckets, count, total, top = h
    out = _percentiles(buckets, top) if count else {}
    out["count"] = count
    if count:
        out["mean"] = round(total / count / 1e6, 3)
    return out


def _merge_hists(hists: list[list[Any]]) -> list[Any]:
    return [
        [sum(h[0][i] for h in hists) for i in range(BUCKETS)],
        sum(h[1] for h in hists),
        sum(h[2] for h in hists),
        max((h[3] for h in hists), default=0),
    ]


def _failover_report(report: Report, roams: list[dict[str, Any]], control: _FaultControl | None) -> None:
    roams = [r for r in roams if r]
    phases: dict[str, list[list[Any]]] = {}
    for r in roams:
        for name, h in r["latency"].items():
            phases.setdefault(name, []).append(h)
    report.latency_ms = _hist_ms(_merge_hists([h for hs in phases.values() for h in hs]))
    keys = ("displaced", "awaiting", "recovered", "redelivered", "gaps", "duplicates", "resyncs", "synced", "lost")
    counts = {k: sum(r[k] for r in roams) for k in keys}
    failover: dict[str, Any] = {
        **report.failover,
        **counts,
        "reconnect_failures": sum(r["reconnect_failures"] for r in roams),
        "back_ms": _hist_ms(_merge_hists([r["back"] for r in roams])),
        "recovered_ms": _hist_ms(_merge_hists([r["back_synced"] for r in roams])),
        "latency_ms_by_phase": {name: _hist_ms(_merge_hists(hs)) for name, hs in phases.items()},
        "examples": [e for r in roams for e in r["examples"]][:10],
    }
    if control is not None:
        failover["expected_displaced"] = control.displaced
        failover["storm_seconds"] = round(control.recovered_at - control.killed_at, 3) if control.recovered_at else None
        failover["restart_seconds"] = round(control.restart_seconds, 3) if control.restart_seconds else None
        if not control.killed_at:
            report.errors.append("no member was killed: --kill-after is past the end of publishing")
        elif counts["displaced"] < control.displaced or counts["awaiting"]:
            report.errors.append(
                f"{counts['awaiting']} of {counts['displaced']} displaced clients never recovered "
                f"({control.displaced} were on the killed member)"
            )
        if control.rejoin_error:
            report.errors.append(f"the restarted member did not rejoin: {control.rejoin_error}")
        elif control.config.restart_after and not control.restart_seconds:
            report.errors.append("the killed member was not restarted: --restart-after is past the end of publishing")
    report.failover = failover
    if counts["gaps"] or counts["duplicates"] or counts["resyncs"]:
        report.errors.append(
            f"clients saw {counts['gaps']} messages skipped, {counts['duplicates']} twice and "
            f"{counts['resyncs']} NOTIFY_DATA_RESYNC: {'; '.join(failover['examples'][:3])}"
        )


async def _publish(
    config: BenchConfig,
    report: Report,
    subscribers: dict[str, int],
    poll: Callable[[], int],
    notify: Progress,
    control: _FaultControl | None = None,
) -> None:
    loop = asyncio.get_running_loop()
    codec = codec_for(base_target(config.target))  # migratory-stream: its subscribers stream, the publisher does not
    sock = socket.create_connection((config.host, config.port))
    sock.setblocking(False)
    transport, publisher = await open_client(sock, config.target, config.host, config.ca, lambda: _Publisher(codec))
    transport.write(codec.hello(config.host, []))
    await asyncio.wait_for(publisher.ready, 30)
    subjects = [f"/bench/s{i}" for i in range(config.subjects)]
    padding = b"x" * max(0, config.size - 8)
    interval = 1.0 / config.rate if config.rate else 0.0
    start = drained = loop.time()
    for n in range(config.messages):
        subject = subjects[n % len(subjects)]
        transport.write(codec.publish(subject, time.time_ns().to_bytes(8, "big") + padding))
        report.published += 1
        report.expected_deliveries += subscribers.get(subject, 0)
        if interval:
            # what is due goes out together, at most every PUBLISH_TICK: one wake-up of the publisher per
            # message would cost the shared cores more than the server's work for it
            delay = start + (n + 1) * interval - loop.time()
            if delay > 0:
                await asyncio.sleep(max(delay, PUBLISH_TICK))
        elif (n + 1) % config.burst == 0:
            # closed loop: the next burst goes out once this one is delivered (what was refused never will be)
            deadline = loop.time() + config.drain_timeout
            while poll() < _deliverable(report, codec, subscribers) and loop.time() < deadline:
                await asyncio.sleep(0.005)
        now = loop.time()
        retries = getattr(codec, "take_retries", None)
        if retries is not None and now - drained >= 0.05:
            transport.write(retries())  # FAILED in a failover: sent again with their publish ids
        if now - drained >= 0.05:
            # keep the loaders' progress pipes drained: a full pipe blocks a loader's event loop,
            # and its clients would read their messages late (seconds of false latency at low rates)
            drained = now
            poll()
            notify("publish", {"published": report.published, "messages": config.messages})
            if control is not None:
                await control.tick(now - start)
    if control is not None:
        await control.done()
    await asyncio.sleep(0.5)  # the last answers
    deadline = loop.time() + 30.0
    while getattr(codec, "unanswered", 0) and loop.time() < deadline:  # retries still under way
        retries = getattr(codec, "take_retries", None)
        if retries is not None:
            transport.write(retries())
        await asyncio.sleep(0.1)
    transport.close()
    for why, count in getattr(codec, "refused", {}).items():
        if control is not None and why.startswith("NO_SUBSCRIBER"):
            continue  # every subscriber of the subject was away in the storm: numbered and recovered all the same
        report.errors.append(f"{count} publications answered {why}")
    report.expected_deliveries = _deliverable(report, codec, subscribers)  # the drain waits for these only
