"""`migratory bench ingest`: acknowledged publications per second and server CPU per publication.

N publisher processes keep a window of K publications outstanding each (a new one as each is
acknowledged), over S subjects with one subscriber connection each; every acknowledged
publication is then looked for at its subscriber, so a server that acknowledges what it does not
deliver fails the run instead of winning it. The same workload drives this server (one node, a
3-member Standard and a 3-member Guaranteed cluster), NATS JetStream (R1, and R3 on three
clustered nats-servers, file storage) and Mosquitto (QoS 1), one after the other in one run.

Counts and CPU are taken over the same window (after a warm-up, before the drain): the servers'
CPU (every process of each, from /proc) and each publisher process's own (a saturated publisher
would make the server look slow; it is reported so it is seen).
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

from migratory import protocol as p
from migratory.bench.cluster import LocalCluster, free_ports
from migratory.bench.loader import BUCKETS, bucket_of, bucket_upper_ns
from migratory.bench.profiles import Profiler
from migratory.bench.servers import TICKS, MultiMeter, ProcessMeter, peer_binary, process_tree, spawn
from migratory.bench.wire import Codec, MqttCodec, _mask, _mqtt_str, _remaining, _WebSocket, codec_for, nats_subject

__all__ = ["INGEST_TARGETS", "IngestConfig", "IngestResult", "run_ingest"]

INGEST_TARGETS = (
    "migratory",
    "migratory-standard",
    "migratory-guaranteed",
    "jetstream-r1",
    "jetstream-r3",
    "mosquitto",
)
"""One node of this server; its 3-member clusters; NATS JetStream R1 and R3; Mosquitto at QoS 1."""

QUIET = {"MessageLog": "false", "AccessLog": "false", "KeepAliveInterval": "3600000", "MaxPendingOutput": "64MB"}
KEY = struct.Struct("!HI")  # a payload starts with its publisher's index and the publication's number
DRAIN_SECONDS = 20.0  # after the window: the outstanding publications' answers, then the last deliveries


@dataclass(frozen=True)
class IngestConfig:
    target: str
    window: int = 16
    publishers: int = 3
    subjects: int = 1000
    size: int = 128
    duration: float = 10.0
    warmup: float = 2.0
    workers: int = 1  # per node or member of this server
    subscriber_processes: int = 2
    folder: Path = Path("bench/ingest-runs")
    profile: Path | None = None  # py-spy every server process over the measured window, into this folder


@dataclass
class IngestResult:
    target: str
    window: int
    publishers: int
    subjects: int
    size: int
    seconds: float
    acked: int  # acknowledged in the measured window
    per_second: float
    server_cpu_percent: float
    server_cpu_us_per_ack: float
    publisher_cpu_percent: list[float]
    ack_p50_ms: float
    ack_p99_ms: float
    server_rss_mb: float
    acked_total: int  # every acknowledged publication of the run, each looked for at its subscriber
    delivered: int
    missing: int
    duplicates: int
    refused: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # server CPU microseconds and wake-ups (context switches) per acknowledged publication, by process role
    by_role: dict[str, tuple[float, float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --- the publishers' wire formats (sans-I/O) ---------------------------------------------------------


class Publisher:
    """Turns numbered publications into bytes, and the server's answers into the numbers acknowledged."""

    def __init__(self) -> None:
        self.buf = b""
        self.ready = False

    def hello(self, host: str) -> bytes:
        raise NotImplementedError

    def publish(self, subject: str, payload: bytes, number: int) -> bytes:
        raise NotImplementedError

    def feed(self, data: bytes) -> tuple[list[int], list[tuple[int, str]], bytes]:
        """(numbers acknowledged, (number, why) refused, bytes to answer)."""
        raise NotImplementedError


class NativePublisher(Publisher):
    """The native protocol over WebSocket (docs/protocol.md): a closure and a publish id per publication."""

    def __init__(self, guaranteed: bool) -> None:
        super().__init__()
        self._ws = _WebSocket()
        self._prefix = os.urandom(4).hex()
        self._guaranteed = guaranteed

    def hello(self, host: str) -> bytes:
        return self._ws.hello(host, ()) + _mask(p.encode_connect())

    def publish(self, subject: str, payload: bytes, number: int) -> bytes:
        return _mask(
            p.encode_publish(
                subject,
                payload,
                closure=str(number),
                guaranteed=self._guaranteed,
                publish_id=f"{self._prefix}-{number}",
            )
        )

    def feed(self, data: bytes) -> tuple[list[int], list[tuple[int, str]], bytes]:
        frames, pong = self._ws.frames(data)
        self.ready = self._ws.ready
        acked: list[int] = []
        refused: list[tuple[int, str]] = []
        for opcode, payload in frames:
            if opcode != 0x2 or not payload or payload[0] != p.Op.PUBLISH_STATUS:
                continue
            answer = p.decode_server(payload)
            assert isinstance(answer, p.PublishStatus)
            if answer.status is p.Status.OK:
                acked.append(int(answer.closure))
            else:
                refused.append((int(answer.closure), f"{answer.status.name}: {answer.reason}"[:80]))
        return acked, refused, pong


class JetStreamPublisher(Publisher):
    """NATS with a reply subject per publication: JetStream answers once the stream has stored it."""

    def __init__(self) -> None:
        super().__init__()
        self._inbox = f"_INBOX.{os.urandom(6).hex()}"

    def hello(self, host: str) -> bytes:
        return f'CONNECT {{"verbose":false,"pedantic":false}}\r\nSUB {self._inbox}.* 1\r\nPING\r\n'.encode()

    def publish(self, subject: str, payload: bytes, number: int) -> bytes:
        return f"PUB {nats_subject(subject)} {self._inbox}.{number} {len(payload)}\r\n".encode() + payload + b"\r\n"

    def feed(self, data: bytes) -> tuple[list[int], list[tuple[int, str]], bytes]:
        buf = self.buf + data if self.buf else data
        acked: list[int] = []
        refused: list[tuple[int, str]] = []
        answer = b""
        pos = 0
        while True:
            end = buf.find(b"\r\n", pos)
            if end < 0:
                break
            line = buf[pos:end]
            if line.startswith(b"MSG "):
                parts = line.split()
                size = int(parts[-1])
                if len(buf) < end + 4 + size:
                    break
                body = buf[end + 2 : end + 2 + size]
                number = int(parts[1].rsplit(b".", 1)[1])
                if b'"error"' in body:
                    refused.append((number, body.decode(errors="replace")[:80]))
                else:
                    acked.append(number)
                pos = end + 4 + size
                continue
            if line == b"PING":
                answer += b"PONG\r\n"
            elif line == b"PONG":
                self.ready = True
            elif line.startswith(b"-ERR"):
                raise ConnectionError(line.decode(errors="replace"))
            pos = end + 2
        self.buf = buf[pos:]
        return acked, refused, answer


class MqttPublisher(Publisher):
    """MQTT 3.1.1 at QoS 1: a packet identifier per outstanding publication, answered by PUBACK."""

    def __init__(self) -> None:
        super().__init__()
        self._ids: dict[int, int] = {}  # packet identifier -> number

    def hello(self, host: str) -> bytes:
        variable = _mqtt_str("MQTT") + bytes((4, 0x02)) + struct.pack("!H", 0)
        body = variable + _mqtt_str("p" + os.urandom(8).hex())
        return bytes((0x10,)) + _remaining(len(body)) + body

    def publish(self, subject: str, payload: bytes, number: int) -> bytes:
        packet = number % 65535 + 1
        self._ids[packet] = number
        body = _mqtt_str(subject.strip("/")) + struct.pack("!H", packet) + payload
        return bytes((0x32,)) + _remaining(len(body)) + body

    def feed(self, data: bytes) -> tuple[list[int], list[tuple[int, str]], bytes]:
        buf = self.buf + data if self.buf else data
        acked: list[int] = []
        pos = 0
        while len(buf) - pos >= 2:
            kind, length = buf[pos] >> 4, buf[pos + 1]  # CONNACK and PUBACK: two bytes of body
            if len(buf) - pos < 2 + length:
                break
            body = buf[pos + 2 : pos + 2 + length]
            if kind == 2:
                if body[1]:
                    raise ConnectionError(f"CONNACK refused: return code {body[1]}")
                self.ready = True
            elif kind == 4:
                acked.append(self._ids.pop(struct.unpack("!H", body[:2])[0]))
            pos += 2 + length
        self.buf = buf[pos:]
        return acked, [], b""


def publisher_for(target: str) -> Publisher:
    if target.startswith("migratory"):
        return NativePublisher(guaranteed=target == "migratory-guaranteed")
    if target.startswith("jetstream"):
        return JetStreamPublisher()
    if target == "mosquitto":
        return MqttPublisher()
    raise ValueError(f"unknown target {target!r}; choose one of {', '.join(INGEST_TARGETS)}")


def subscriber_codec(target: str) -> Codec:
    if target.startswith("migratory"):
        return codec_for("migratory")
    if target.startswith("jetstream"):
        return codec_for("nats")
    return MqttCodec()


def subject_name(index: int) -> str:
    """Subject ``index`` of the workload, in the native form: each codec writes it as its protocol's
    (``ingest.sN`` for NATS, ``ingest/sN`` for MQTT)."""
    return f"/ingest/s{index}"


# --- the processes -------------------------------------------------------------------------------------


class _Stream(asyncio.Protocol):
    """A connection that hands what it reads to ``on_data`` and says when it is closed."""

    def __init__(self, on_data: Callable[[bytes], None]) -> None:
        self.on_data = on_data
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.on_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _event_loop() -> None:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover - uvloop is a dependency of the server
        pass


def _subscriber_main(
    target: str, endpoints: Sequence[tuple[str, int]], subjects: Sequence[str], pipe: Connection
) -> None:
    """One connection per subject (over the endpoints in turn); at "stop", every payload key seen."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _event_loop()
    asyncio.run(_subscribe(target, endpoints, subjects, pipe))


async def _subscribe(
    target: str, endpoints: Sequence[tuple[str, int]], subjects: Sequence[str], pipe: Connection
) -> None:
    loop = asyncio.get_running_loop()
    seen: set[int] = set()
    duplicates = [0]
    ready: list[asyncio.Future[None]] = []
    streams: list[_Stream] = []

    def opener(codec: Codec, done: asyncio.Future[None], holder: list[_Stream]) -> Callable[[bytes], None]:
        def on_data(data: bytes) -> None:
            payloads, answer = codec.feed(data)
            if answer and holder[0].transport is not None:
                holder[0].transport.write(answer)
            for payload in payloads:
                publisher, number = KEY.unpack_from(payload)
                key = publisher << 32 | number
                if key in seen:
                    duplicates[0] += 1
                else:
                    seen.add(key)
            if not done.done() and codec.is_ready(1):
                done.set_result(None)

        return on_data

    try:
        for i, subject in enumerate(subjects):
            host, port = endpoints[i % len(endpoints)]
            codec = subscriber_codec(target)
            done: asyncio.Future[None] = loop.create_future()
            holder: list[_Stream] = []
            factory = functools.partial(_Stream, opener(codec, done, holder))
            _, stream = await loop.create_connection(factory, host, port)
            holder.append(stream)
            assert stream.transport is not None
            stream.transport.write(codec.hello(host, [subject]))
            streams.append(stream)
            ready.append(done)
        await asyncio.wait_for(asyncio.gather(*ready), 60)
    except (TimeoutError, OSError, ConnectionError) as exc:
        pipe.send(("failed", f"subscriber: {type(exc).__name__}: {exc}"))
        return
    pipe.send(("ready",))
    await loop.run_in_executor(None, pipe.recv)
    pipe.send(("seen", sorted(seen), duplicates[0]))
    for stream in streams:
        if stream.transport is not None:
            stream.transport.close()


def _publisher_main(target: str, endpoint: tuple[str, int], index: int, config: IngestConfig, pipe: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _event_loop()
    asyncio.run(_publish(target, endpoint, index, config, pipe))


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _publish(target: str, endpoint: tuple[str, int], index: int, config: IngestConfig, pipe: Connection) -> None:
    """Keep ``config.window`` publications outstanding from the "go" until the window's end; then wait
    for the outstanding ones' answers and report."""
    loop = asyncio.get_running_loop()
    codec = publisher_for(target)
    connected: asyncio.Future[None] = loop.create_future()
    sent: dict[int, int] = {}  # number -> time sent (ns)
    acked: list[int] = []
    refused: dict[str, int] = {}
    histogram = [0] * BUCKETS
    marks: dict[str, tuple[int, float]] = {}  # "warm"/"end" -> (acknowledged so far, own CPU seconds)
    state = {"next": 0, "open": False}
    pad = b"x" * max(0, config.size - KEY.size)
    subjects = [subject_name(i) for i in range(config.subjects)]
    offset = index * max(1, config.subjects // max(1, config.publishers))
    holder: list[_Stream] = []
    idle: asyncio.Future[None] | None = None

    def send_more(count: int) -> None:
        out = []
        for _ in range(count):
            number = state["next"]
            state["next"] = number + 1
            subject = subjects[(offset + number) % len(subjects)]
            out.append(codec.publish(subject, KEY.pack(index, number) + pad, number))
            sent[number] = time.monotonic_ns()
        if out and holder[0].transport is not None:
            holder[0].transport.write(b"".join(out))

    def on_data(data: bytes) -> None:
        nonlocal idle
        try:
            done, no, answer = codec.feed(data)
        except ConnectionError as exc:
            if not connected.done():
                connected.set_exception(exc)
            return
        if answer and holder[0].transport is not None:
            holder[0].transport.write(answer)
        if not connected.done() and codec.ready:
            connected.set_result(None)
        now = time.monotonic_ns()
        for number in done:
            started = sent.pop(number, None)
            if started is not None:
                histogram[bucket_of(now - started)] += 1
                acked.append(number)
        for number, why in no:
            sent.pop(number, None)
            refused[why] = refused.get(why, 0) + 1
        if state["open"]:
            send_more(len(done) + len(no))
        elif not sent and idle is not None and not idle.done():
            idle.set_result(None)

    try:
        _, stream = await loop.create_connection(lambda: _Stream(on_data), *endpoint)
        holder.append(stream)
        assert stream.transport is not None
        stream.transport.write(codec.hello(endpoint[0]))
        await asyncio.wait_for(connected, 30)
    except (TimeoutError, OSError, ConnectionError) as exc:
        pipe.send(("failed", f"publisher {index}: {type(exc).__name__}: {exc}"))
        return
    pipe.send(("ready",))
    _, go, warm, end = await loop.run_in_executor(None, pipe.recv)

    def mark(name: str) -> None:
        marks[name] = (len(acked), _cpu())
        if name == "end":
            state["open"] = False

    clock = time.monotonic() - loop.time()  # the loop's clock against the parent's time.monotonic()
    loop.call_at(warm - clock, mark, "warm")
    loop.call_at(end - clock, mark, "end")
    await asyncio.sleep(max(0.0, go - time.monotonic()))
    state["open"] = True
    send_more(config.window)
    await asyncio.sleep(max(0.0, end - time.monotonic()) + 0.01)
    if sent:
        idle = loop.create_future()
        try:
            await asyncio.wait_for(idle, DRAIN_SECONDS)
        except TimeoutError:
            refused["unanswered at the end"] = len(sent)
    if holder[0].transport is not None:
        holder[0].transport.close()
    pipe.send(("done", marks.get("warm", (0, 0.0)), marks.get("end", (0, 0.0)), acked, histogram, refused))


# --- the servers ---------------------------------------------------------------------------------------


@contextmanager
def _target(config: IngestConfig, folder: Path) -> Iterator[tuple[list[tuple[str, int]], MultiMeter]]:
    """The server(s) of ``config.target`` running: their client endpoints and a meter over all of them."""
    target = config.target
    if target == "migratory":
        server = spawn("migratory", workers=config.workers)  # spawn writes the quiet settings itself
        try:
            yield [(server.host, server.port)], MultiMeter([server.meter])
        finally:
            server.stop()
    elif target in ("migratory-standard", "migratory-guaranteed"):
        mode = "Guaranteed" if target.endswith("guaranteed") else "Standard"
        with LocalCluster(folder, 3, mode=mode, workers=config.workers, extra=QUIET, base=61) as cluster:
            cluster.start_all(ready_timeout=90)
            for index in range(3):
                cluster.wait_view(index, {0, 1, 2}, timeout=90)
            meters = [ProcessMeter(m.proc.pid) for m in cluster.members if m.proc is not None]
            yield [(m.host, m.client_port) for m in cluster.members], MultiMeter(meters)
    elif target.startswith("jetstream"):
        with _jetstream(folder, 3 if target.endswith("r3") else 1) as (endpoints, meter):
            yield endpoints, meter
    elif target == "mosquitto":
        if peer_binary("mqtt") is None:
            raise RuntimeError("mosquitto is not installed (apt-get install mosquitto)")
        server = spawn("mqtt")
        try:
            yield [(server.host, server.port)], MultiMeter([server.meter])
        finally:
            server.stop()
    else:
        raise ValueError(f"unknown target {target!r}; choose one of {', '.join(INGEST_TARGETS)}")


@contextmanager
def _jetstream(folder: Path, replicas: int) -> Iterator[tuple[list[tuple[str, int]], MultiMeter]]:
    """``replicas`` nats-servers with JetStream (file storage under ``folder``), clustered when more than
    one, and a stream ``INGEST`` of ``ingest.>`` with that many replicas."""
    binary = peer_binary("nats")
    if binary is None:
        raise RuntimeError("nats-server is not installed (apt-get install nats-server)")
    hosts = [f"127.0.0.{71 + i}" for i in range(replicas)]
    ports = [free_ports(host, 2) for host in hosts]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, host in enumerate(hosts):
            store = folder / f"nats-{i}"
            store.mkdir(parents=True, exist_ok=True)
            conf = [
                f"listen: {host}:{ports[i][0]}",
                f"server_name: ingest-{i}",
                "max_payload: 1048576",
                f'jetstream {{\n  store_dir: "{store}"\n}}',
            ]
            if replicas > 1:
                routes = ", ".join(f"nats-route://{h}:{ports[j][1]}" for j, h in enumerate(hosts) if j != i)
                conf.append(f"cluster {{\n  name: ingest\n  listen: {host}:{ports[i][1]}\n  routes: [{routes}]\n}}")
            (store / "nats.conf").write_text("\n".join(conf) + "\n")
            procs.append(
                subprocess.Popen(
                    [binary, "-c", str(store / "nats.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        endpoints = [(host, ports[i][0]) for i, host in enumerate(hosts)]
        _create_stream(endpoints[0], replicas)
        yield endpoints, MultiMeter([ProcessMeter(proc.pid) for proc in procs])
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _create_stream(endpoint: tuple[str, int], replicas: int, timeout: float = 60.0) -> None:
    """Create the stream through JetStream's API, as often as it answers that it is not ready yet (a
    cluster elects its meta leader first)."""
    config = {"name": "INGEST", "subjects": ["ingest.>"], "storage": "file", "num_replicas": replicas}
    body = json.dumps(config).encode()
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(endpoint, timeout=5) as sock:
                sock.sendall(
                    b'CONNECT {"verbose":false}\r\nSUB _INBOX.create 1\r\n'
                    + f"PUB $JS.API.STREAM.CREATE.INGEST _INBOX.create {len(body)}\r\n".encode()
                    + body
                    + b"\r\n"
                )
                answer = b""
                while (b"\r\nMSG " not in answer and not answer.startswith(b"MSG ")) or answer.count(b"\r\n") < 3:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    answer += chunk
                    if b"-ERR" in answer:
                        break
            last = answer.decode(errors="replace")
            reply = last[last.find("MSG ") :].split("\r\n", 2)
            if len(reply) >= 2 and '"error"' not in reply[1] and '"config"' in reply[1]:
                return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.5)
    raise RuntimeError(f"JetStream did not create the stream: {last[-200:]}")


# --- the run -------------------------------------------------------------------------------------------


def _quantile(histogram: Sequence[int], q: float) -> float:
    total = sum(histogram)
    if not total:
        return 0.0
    rank = q * total
    running = 0
    for index, count in enumerate(histogram):
        running += count
        if running >= rank:
            return round(bucket_upper_ns(index) / 1e6, 3)
    return round(bucket_upper_ns(len(histogram) - 1) / 1e6, 3)


def run_ingest(config: IngestConfig) -> IngestResult:
    """One target at one window: start it, subscribe, publish for ``config.duration`` seconds, check."""
    folder = Path(tempfile.mkdtemp(prefix=f"ingest-{config.target}-", dir=_parent(config.folder)))
    context = multiprocessing.get_context("fork")
    errors: list[str] = []
    try:
        with _target(config, folder) as (endpoints, meter):
            subjects = [subject_name(i) for i in range(config.subjects)]
            subscribers = []
            for n in range(config.subscriber_processes):
                parent, child = context.Pipe()
                share = subjects[n :: config.subscriber_processes]
                # each subscriber on another endpoint than its subjects' publishers where there are several
                rotated = endpoints[1:] + endpoints[:1]
                proc = context.Process(
                    target=_subscriber_main, args=(config.target, rotated, share, child), daemon=True
                )
                proc.start()
                subscribers.append((proc, parent))
            publishers = []
            for index in range(config.publishers):
                parent, child = context.Pipe()
                endpoint = endpoints[index % len(endpoints)]
                proc = context.Process(
                    target=_publisher_main, args=(config.target, endpoint, index, config, child), daemon=True
                )
                proc.start()
                publishers.append((proc, parent))
            for _, pipe in subscribers + publishers:
                if not pipe.poll(120):
                    raise RuntimeError("a load process did not start in 120 s")
                message = pipe.recv()
                if message[0] != "ready":
                    raise RuntimeError(message[1])
            go = time.monotonic() + 0.5
            warm, end = go + config.warmup, go + config.warmup + config.duration
            for _, pipe in publishers:
                pipe.send(("go", go, warm, end))
            time.sleep(max(0.0, warm - time.monotonic()))
            cpu0 = meter.cpu_seconds()
            roles0 = role_usage(meter)
            profiler = None
            if config.profile is not None:
                label = f"{config.target}-K{config.window}"
                profiler = Profiler(config.profile, label, [m.pid for m in meter.meters], config.duration)
                why = profiler.start()
                if why:
                    errors.append(why)
            time.sleep(max(0.0, end - time.monotonic()))
            cpu1 = meter.cpu_seconds()
            roles1 = role_usage(meter)
            if profiler is not None:
                profiler.wait()
            rss = meter.rss_bytes()
            reports = []
            for proc, pipe in publishers:
                if not pipe.poll(DRAIN_SECONDS + 30):
                    raise RuntimeError("a publisher did not report")
                reports.append(pipe.recv())
                proc.join(10)
            time.sleep(1.0)  # the last acknowledged ones on their way to their subscribers
            seen: set[int] = set()
            duplicates = 0
            for proc, pipe in subscribers:
                pipe.send("stop")
                if not pipe.poll(60):
                    raise RuntimeError("a subscriber did not report")
                _, keys, dups = pipe.recv()
                seen.update(keys)
                duplicates += dups
                proc.join(10)
    except (RuntimeError, OSError) as exc:
        errors.append(str(exc))
        return _failed(config, errors)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    acked = sum(r[2][0] - r[1][0] for r in reports)
    histogram = [sum(r[4][i] for r in reports) for i in range(BUCKETS)]
    refused: dict[str, int] = {}
    acked_total = 0
    missing = 0
    for index, report in enumerate(reports):
        for why, count in report[5].items():
            refused[why] = refused.get(why, 0) + count
        acked_total += len(report[3])
        missing += sum(1 for number in report[3] if (index << 32 | number) not in seen)
    if missing:
        errors.append(f"{missing} acknowledged publications never reached their subscriber")
    if refused:
        errors.append(f"publications refused: {refused}")
    server_cpu = cpu1 - cpu0
    hops = {
        role: (round(1e6 * (cpu - roles0.get(role, (0.0, 0))[0]) / acked, 1) if acked else 0.0,
               round((switches - roles0.get(role, (0.0, 0))[1]) / acked, 2) if acked else 0.0)
        for role, (cpu, switches) in sorted(roles1.items())
    }  # fmt: skip
    return IngestResult(
        target=config.target,
        window=config.window,
        publishers=config.publishers,
        subjects=config.subjects,
        size=config.size,
        seconds=config.duration,
        acked=acked,
        per_second=round(acked / config.duration, 1),
        server_cpu_percent=round(100 * server_cpu / config.duration, 1),
        server_cpu_us_per_ack=round(1e6 * server_cpu / acked, 1) if acked else 0.0,
        publisher_cpu_percent=[round(100 * (r[2][1] - r[1][1]) / config.duration, 1) for r in reports],
        ack_p50_ms=_quantile(histogram, 0.5),
        ack_p99_ms=_quantile(histogram, 0.99),
        server_rss_mb=round(rss / 2**20, 1),
        acked_total=acked_total,
        delivered=len(seen),
        missing=missing,
        duplicates=duplicates,
        refused=refused,
        errors=errors,
        by_role=hops,
    )


def _role(pid: int) -> str:
    """What a server process is: this server's agent, worker or supervisor; a peer's process by its name."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    if comm == "migratory-agent":
        return "agent"
    if comm.startswith("migratory-w"):
        return "worker"
    return "main" if comm.startswith("python") else comm


def role_usage(meter: MultiMeter) -> dict[str, tuple[float, int]]:
    """CPU seconds and context switches (every thread's voluntary and involuntary: its wake-ups), summed
    per role over every process of the servers, from /proc."""
    usage: dict[str, tuple[float, int]] = {}
    for root in meter.meters:
        for pid in process_tree(root.pid):
            role = _role(pid)
            cpu, switches = usage.get(role, (0.0, 0))
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                cpu += (int(fields[11]) + int(fields[12])) / TICKS
                for task in Path(f"/proc/{pid}/task").iterdir():
                    for line in (task / "status").read_text().splitlines():
                        if "ctxt_switches:" in line:
                            switches += int(line.split()[1])
            except (OSError, ValueError, IndexError):
                continue
            usage[role] = (cpu, switches)
    return usage


def _parent(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


def _failed(config: IngestConfig, errors: list[str]) -> IngestResult:
    return IngestResult(
        config.target, config.window, config.publishers, config.subjects, config.size, config.duration,
        0, 0.0, 0.0, 0.0, [], 0.0, 0.0, 0.0, 0, 0, 0, 0, {}, errors,
    )  # fmt: skip
