"""The benchmark kit against real servers: this one, NATS, Mosquitto and the WebSocket peers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from migratory import protocol as p
from migratory.bench.loader import bucket_of, bucket_upper_ns
from migratory.bench.roaming import RoamingCodec, RoamState
from migratory.bench.runner import BenchConfig, run
from migratory.bench.wire import TARGETS, MqttCodec, NatsCodec, StreamCodec
from migratory.websocket import OP_BINARY, build_frame


@pytest.mark.parametrize("target", TARGETS)
def test_every_message_is_delivered_and_counted(target: str) -> None:
    config = BenchConfig(
        target=target, clients=40, subjects=2, messages=30, burst=10, processes=2, spawn=True, workers=2
    )
    report = run(config)
    assert report.errors == []
    assert report.connected == 40
    assert report.published == 30
    per_message = 40 if target in ("ws-broadcast", "websockets") else 20  # two subjects, half the clients each
    assert report.expected_deliveries == 30 * per_message
    assert report.delivered == report.expected_deliveries
    assert report.server_cpu_seconds >= 0 and report.server_rss_mb_connected > 0
    assert 0 < report.latency_ms["p50"] <= report.latency_ms["p99"] <= report.latency_ms["max"]


def test_paced_rate_and_idle_memory() -> None:
    report = run(BenchConfig(clients=30, subjects=3, subjects_per_client=3, rate=50, messages=20, spawn=True))
    assert report.errors == [] and report.delivered == 20 * 30
    assert report.publish_seconds >= 0.3  # 20 messages at 50/s take at least 0.38 s
    phases = ["started", "connected", "publishing", "drained", "stopping", "closed"]
    assert list(report.timeline) == phases  # in order, each in the members' log format
    assert all(len(t) == 24 and t.endswith("Z") and t[10] == "T" for t in report.timeline.values())
    assert sorted(report.timeline.values()) == list(report.timeline.values())
    idle = run(BenchConfig(clients=50, messages=0, spawn=True))
    assert idle.connected == 50 and idle.delivered == 0


def test_cli_writes_json_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "migratory_cli.main",
            "bench",
            "run",
            "--spawn",
            "--clients",
            "20",
            "--messages",
            "10",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["delivered"] == 200 and report["target"] == "migratory"
    assert "server CPU per delivery" in result.stdout


def test_latency_buckets_are_monotonic_and_about_five_percent_wide() -> None:
    assert bucket_of(1_000) == 0
    for ns in (10_000, 1_000_000, 1_000_000_000):
        index = bucket_of(ns)
        assert bucket_upper_ns(index) >= ns
        assert bucket_upper_ns(index) <= ns * 1.06


def test_peer_codecs_parse_split_input() -> None:
    nats = NatsCodec()
    wire = b"MSG a.b 1 5\r\nhello\r\nPING\r\nMSG a.b 1 3\r\nabc\r\n"
    got: list[bytes] = []
    answers = b""
    for i in range(len(wire)):
        payloads, answer = nats.feed(wire[i : i + 1])
        got += payloads
        answers += answer
    assert got == [b"hello", b"abc"] and answers == b"PONG\r\n"
    mqtt = MqttCodec()
    publish = bytes((0x30, 9)) + b"\x00\x03a/bpayl"
    payloads, _ = mqtt.feed(publish[:4])
    payloads2, _ = mqtt.feed(publish[4:])
    assert payloads + payloads2 == [b"payl"]


def test_http_stream_target_delivers_everything() -> None:
    """migratory-stream: GET /stream, CONNECT and SUBSCRIBE POSTed (relayed between workers), deliveries streamed."""
    report = run(
        BenchConfig(
            target="migratory-stream", clients=30, subjects=3, messages=24, burst=6, processes=2, spawn=True, workers=2
        )
    )
    assert report.errors == [] and report.connected == 30
    assert report.expected_deliveries == 24 * 10
    assert report.delivered == report.expected_deliveries
    paced = run(BenchConfig(target="migratory-stream", clients=20, rate=40, messages=10, spawn=True))
    assert paced.errors == [] and paced.delivered == 10 * 20
    assert paced.server_pss_mb_connected > 0


def test_stream_codec_parses_split_chunks() -> None:
    codec = StreamCodec()
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Migratory-Stream: w0.7.abc\r\n\r\n"
    frames = [
        p.encode_subscribe_status(p.Status.OK, "/a"),
        b"",  # a keep-alive
        p.encode_delivery("/a", b"old", {}, 1, 1, snapshot=True),
        p.encode_delivery("/a", b"new-one", {}, 2, 1),
        p.encode_delivery("/a", b"new-two", {}, 3, 1),
    ]
    body = b"".join(len(f).to_bytes(4, "big") + f for f in frames)
    wire = head + b"%x\r\n%b\r\n" % (7, body[:7]) + b"%x\r\n%b\r\n" % (len(body) - 7, body[7:])
    got: list[bytes] = []
    for i in range(len(wire)):
        payloads, answer = codec.feed(wire[i : i + 1])
        got += payloads
        assert answer == b""
    assert got == [b"new-one", b"new-two"] and codec.stream_id == "w0.7.abc" and codec.is_ready(1)
    requests, count = codec.posts("127.0.0.1", ["/a", "/b"])
    assert count == 2 and requests.count(b"POST /stream/w0.7.abc HTTP/1.1") == 2
    assert requests.count(b"Connection: close") == 1


def test_seed_preset_shape() -> None:
    from migratory.bench.presets import preset

    shape = preset("seed-10m")
    assert shape["clients"] == 1_000_000 and shape["subjects"] == 10_000 and shape["size"] == 512
    assert shape["rate"] * 60 == shape["subjects"]  # one message a minute for every subject, hence client
    assert shape["messages"] == round(shape["rate"] * 600)  # held ten minutes
    assert shape["processes"] * 18_000 >= 1_000_000 and shape["workers"] == shape["processes"]
    small = preset("seed-10m", 50_000)
    assert small["subjects"] == 500 and small["processes"] == 3
    assert 0 < shape["loader_poll"] <= 0.05  # its wait is part of the latency reported: kept well under 100 ms
    with pytest.raises(ValueError, match="unknown preset"):
        preset("seed-1b")


@pytest.mark.timeout(1200)
def test_fifty_thousand_connections_on_a_cluster_member(tmp_path: Path) -> None:
    """Issue 18's correctness check: 50,000 subscribed clients on ten workers of one member, every message delivered.

    The seed-10m shape at 50,000 clients (500 subjects, 512-byte messages, one a minute for
    every client), the publisher alone on a second member so that each delivery crosses the
    member link; nothing here is timed (bench/million.md has the measurements).
    """
    out = tmp_path / "seed-50k.json"
    command = [sys.executable, "-m", "migratory_cli.main", "bench", "run", "--spawn", "--preset", "seed-10m"]
    command += ["--clients", "50000", "--workers", "10", "--processes", "4", "--members", "2", "--hold", "15"]
    command += ["--set", "BusBatchingTime=20", "--drain", "300", "--json", str(out)]  # as bench/million.sh runs it
    result = subprocess.run(command, capture_output=True, text=True, timeout=1100)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == []
    assert report["connected"] == 50_000 and report["connect_errors"] == 0
    assert report["published"] == round(500 / 60 * 15)
    assert report["expected_deliveries"] == report["published"] * 100
    assert report["delivered"] == report["expected_deliveries"]
    assert 0 < report["latency_ms"]["p50"] <= report["latency_ms"]["p99"] <= report["latency_ms"]["max"]
    assert report["latency_ms"]["mean"] > 0
    assert report["sockstat_connected"]["inuse"] >= 100_000  # both ends of every client connection
    assert report["server_processes"] >= 10 + 2 + 2  # ten workers, two supervisors, two member agents
    assert report["server_pss_bytes_per_connection"] > 0
    assert report["loader_cpu_seconds"] > 0 and report["loader_cpu_us_per_delivery"] > 0  # the loaders' own share


def test_member_warnings_keep_every_cluster_line_and_count_the_workers_pauses() -> None:
    """A million-client run logs hundreds of worker pauses; the link drops that explain lost messages stay visible."""
    from typing import cast

    from migratory.bench.cluster import LocalCluster
    from migratory.bench.clusterbench import _member_warnings

    def record(level: str, msg: str) -> str:
        return json.dumps({"ts": "2026-11-24T00:10:15.065Z", "level": level, "msg": msg})

    pauses = [
        record("WARNING", f"worker {i}: event loop stalled for {1 + i / 10:.1f} s (saturated cores)") for i in range(30)
    ]
    pauses += [
        record("WARNING", "worker 3: garbage collection of generation 1 held the process for 0.49 s (0 objects)")
    ]
    first = [
        *pauses,
        record("WARNING", "cluster link with member 1 dropped: no heartbeat for 3.0 s"),
        "not json",
        record("INFO", "member 0 ready"),
        record("WARNING", "member agent: event loop stalled for 2.2 s"),
    ]
    logs = [
        "\n".join(first),
        record("INFO", "member 1 ready"),
    ]

    class Fake:
        members = [0, 1]

        def server_log(self, index: int) -> str:
            return logs[index]

    assert _member_warnings(cast(LocalCluster, Fake())) == [
        "member 0: 2026-11-24T00:10:15.065Z cluster link with member 1 dropped: no heartbeat for 3.0 s",
        "member 0: 2026-11-24T00:10:15.065Z member agent: event loop stalled for 2.2 s",
        "member 0: 31 worker stalls or long garbage collections, the longest 3.9 s",
    ]


def test_pauses_land_in_the_phase_their_timestamp_falls_in() -> None:
    """The report's ``pauses``: the exact lines pauses.py logs, each in the run's phase by its time, by kind."""
    from typing import cast

    from migratory.bench.cluster import LocalCluster
    from migratory.bench.clusterbench import pauses_by_phase

    def record(ts: str, msg: str) -> str:
        return json.dumps({"ts": f"2026-11-27T12:{ts}Z", "level": "WARNING", "msg": msg})

    log = "\n".join(
        [
            record(
                "34:00.000",
                "worker 7: event loop stalled for 2.0 s, 0.0 s of it on the CPU (waiting for a core, or blocked)",
            ),
            record(
                "39:05.000",
                "worker 3: garbage collection of generation 2 held the process for 1.10 s (0 objects collected)",
            ),
            record(
                "39:06.000",
                "worker 4: garbage collection of generation 2 held the process for 0.40 s (0 objects collected)",
            ),
            record("50:25.000", "member agent: event loop stalled for 2.6 s, 0.3 s of it on the CPU (a long task)"),
            record("50:26.000", "cluster link with member 1 dropped: no heartbeat for 3.0 s"),
            record(
                "50:27.000",
                "member agent: event loop stalled for 1.9 s, 0.1 s of it on the CPU, 0.2 s waiting for a core"
                " (blocked)",
            ),
            record(
                "50:28.000",
                "member agent: event loop stalled for 1.2 s, 0.1 s of it on the CPU, 1.1 s waiting for a core"
                " (waiting for a core)",
            ),
        ]
    )

    class Fake:
        members = [0]

        def server_log(self, index: int) -> str:
            return log

    timeline = {
        "started": "2026-11-27T12:33:30.000Z",
        "connected": "2026-11-27T12:38:07.000Z",
        "publishing": "2026-11-27T12:38:09.000Z",
        "drained": "2026-11-27T12:50:09.000Z",
    }
    assert pauses_by_phase(cast(LocalCluster, Fake()), timeline) == {
        "started": {"member 0 worker starved": {"count": 1, "longest_s": 2.0}},
        "publishing": {"member 0 worker collection (generation 2)": {"count": 2, "longest_s": 1.1}},
        "drained": {
            "member 0 agent long task": {"count": 1, "longest_s": 2.6},
            "member 0 agent blocked": {"count": 1, "longest_s": 1.9},
            "member 0 agent starved": {"count": 1, "longest_s": 1.2},
        },
    }


def test_a_refused_publication_is_not_waited_for() -> None:
    """bench/cluster.md: a publisher whose publications were answered FAILED waited forever for their
    deliveries; the codec records which subject each refused one was for, and the drain stops expecting it.
    FAILED is an unknown outcome in a cluster (issue 48): the codec first sends the publication again with
    its publish id, as the library's publish(retries=N) does, and counts it refused only if it never gets OK."""
    from migratory import protocol as p
    from migratory.bench.runner import Report, _deliverable
    from migratory.bench.wire import PUBLISH_RETRIES, MigratoryCodec

    codec = MigratoryCodec()
    codec.ready = True
    sent = [
        codec.publish(subject, b"x") for subject in ("/bench/s0", "/bench/s0", "/bench/s1", "/bench/s1", "/bench/s2")
    ]

    def answer(status: p.Status, closure: str, reason: str = "") -> None:
        a = p.encode_publish_status(status, closure, reason)
        codec.feed(bytes((0x82, len(a))) + a)

    for _ in range(PUBLISH_RETRIES):
        answer(p.Status.FAILED, "/bench/s0 1", "no quorum")
        answer(p.Status.FAILED, "/bench/s0 2", "no quorum")
    assert codec.take_retries() == (sent[0] + sent[1]) * PUBLISH_RETRIES  # the same frames: the same publish ids
    assert codec.unpublished == {} and codec.unanswered == 5
    answer(p.Status.FAILED, "/bench/s0 1", "no quorum")  # the retries are spent: refused for good
    answer(p.Status.FAILED, "/bench/s0 2", "no quorum")
    answer(p.Status.NO_SUBSCRIBER, "/bench/s1 3")  # published: its deliveries still come
    answer(p.Status.OK, "/bench/s1 4")
    answer(p.Status.FAILED, "/bench/s2 5", "the subject's coordinator changed; retry with the same publish id")
    assert codec.take_retries() == sent[4]
    answer(p.Status.OK, "/bench/s2 5")  # the retry was numbered: not refused
    report = Report("migratory", 10, 2, 1, 64, 0)
    report.expected_deliveries = 100
    assert codec.unpublished == {"/bench/s0": 2}
    assert _deliverable(report, codec, {"/bench/s0": 10, "/bench/s1": 5}) == 80
    assert sum(codec.refused.values()) == 3
    assert codec.unanswered == 0 and codec.retried == 2 * PUBLISH_RETRIES + 1


@pytest.mark.parametrize(("status", "attempts"), [(503, 6), (400, 1)])
def test_a_roaming_client_tries_a_refused_upgrade_again_as_the_loaders_do(
    status: int, attempts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first connection answered 503 (a worker waiting for its agent's word) is tried again, up to
    REFUSED_RETRIES times and counted; any other refusal ends the client at once, as an error."""
    import asyncio

    from migratory.bench import roaming
    from migratory.bench.loader import REFUSED_RETRIES, LoaderSpec

    monkeypatch.setattr(roaming.random, "uniform", lambda a, b: 0.01)
    seen: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 %d Refused\r\nContent-Length: 0\r\nConnection: close\r\n\r\n" % status)
        await writer.drain()
        writer.close()

    async def main() -> RoamState:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        spec = LoaderSpec("migratory", "127.0.0.1", port, "127.0.0.1", [["/bench/s0"]])
        state = RoamState()
        first: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(roaming._client(spec, 0, ["/bench/s0"], state, asyncio.Semaphore(1), first, set()), 30)
        server.close()
        assert first.result() is False
        return state

    state = asyncio.run(main())
    assert len(seen) == attempts and all(b"Upgrade" in request for request in seen)
    assert state.refused == (REFUSED_RETRIES if status == 503 else 0) and REFUSED_RETRIES + 1 == 6
    assert sum(state.reasons.values()) == 1 and str(status) in next(iter(state.reasons))  # one failure, its cause


def test_a_roaming_client_counts_every_skipped_or_repeated_message() -> None:
    """roaming.py's check: a seq that skips is a message lost, one seen again a duplicate, a snapshot only
    sets the position, a NOTIFY_DATA_RESYNC is counted and lets the snapshot that follows reposition."""
    state = RoamState()
    positions: dict[str, tuple[int, int]] = {}
    codec = RoamingCodec(state, positions)
    codec.ready = True  # past the upgrade

    def delivery(seq: int, *, snapshot: bool = False, recovered: bool = False, epoch: int = 1) -> bytes:
        stamp = (0).to_bytes(8, "big")
        message = p.encode_delivery("/s", stamp, {}, seq, epoch, snapshot=snapshot, recovered=recovered)
        return build_frame(OP_BINARY, message)

    live, _ = codec.deliveries(delivery(4, snapshot=True) + delivery(5) + delivery(6, epoch=2))
    assert [f.seq for f in live] == [5, 6] and (state.gaps, state.duplicates) == (0, 0)  # a new epoch continues
    live, _ = codec.deliveries(delivery(6) + delivery(9))
    assert [f.seq for f in live] == [9] and (state.duplicates, state.gaps) == (1, 2)
    assert positions["/s"] == (1, 9)
    # after a reconnection: recovered messages are checked and counted, not timed; DATA_SYNC ends the recovery
    resumed = RoamingCodec(state, positions, resume=True)
    resumed.ready = True
    hello = resumed.after_upgrade(["/s"])
    assert resumed.pending_sync == 1 and hello  # resubscribed with the position
    sync = build_frame(OP_BINARY, p.encode_notify(p.NotifyCode.DATA_SYNC, "/s"))
    live, _ = resumed.deliveries(delivery(10, recovered=True) + sync)
    assert live == [] and state.recovered == 1 and state.synced == 1 and resumed.pending_sync == 0
    live, _ = resumed.deliveries(delivery(9) + delivery(10))  # at or before the resubscription's position
    assert live == [] and state.redelivered == 1 and state.duplicates == 2  # 9: dropped as seen; 10: a duplicate
    resync = build_frame(OP_BINARY, p.encode_notify(p.NotifyCode.DATA_RESYNC, "/s"))
    resumed.deliveries(resync + delivery(20, snapshot=True) + delivery(21))
    assert state.resyncs == 1 and state.gaps == 2 and positions["/s"] == (1, 21)


def test_a_failover_run_that_would_kill_nothing_is_refused_in_one_line() -> None:
    """--kill-after past the end of publishing would "pass" with no failover: refused before anything starts."""
    command = [str(Path(sys.executable).with_name("migratory")), "bench", "run", "--spawn"]
    command += ["--preset", "seed-10m-failover", "--clients", "100", "--rate", "1", "--hold", "5", "--kill-after", "9"]
    env = {**os.environ, "COLUMNS": "300"}  # the error box on one line
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "must come before publishing ends" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_wss_clients_over_a_cluster_on_the_lean_tls_client(tmp_path: Path) -> None:
    """The million's shape over wss:// (issue 35, item 3), small: a 2-member cluster serving ListenEncrypted with
    a test CA, the load generators on the lean TLS 1.3 client; every message reaches every client."""
    out = tmp_path / "wss.json"
    command = [sys.executable, "-m", "migratory_cli.main", "bench", "run", "--spawn", "--target", "migratory-wss"]
    command += ["--preset", "seed-10m", "--clients", "2000", "--members", "2", "--workers", "2", "--processes", "2"]
    command += ["--hold", "12", "--set", "BusBatchingTime=20", "--drain", "120", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["target"].startswith("migratory-wss (2 members") and report["tls_client"] == "lean"
    assert report["errors"] == [] and report["connected"] == 2000
    assert report["published"] == round(20 / 60 * 12) and report["expected_deliveries"] == report["published"] * 100
    assert report["delivered"] == report["expected_deliveries"]


def test_an_unknown_tls_client_is_refused_in_one_line() -> None:
    command = [str(Path(sys.executable).with_name("migratory")), "bench", "run", "--spawn", "--target"]
    command += ["migratory-wss", "--tls-client", "gnutls"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "300"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "expected lean or openssl" in done.stdout + done.stderr and "Traceback" not in done.stdout + done.stderr


def test_a_frame_no_client_can_decode_once_subscribed_fails_the_run() -> None:
    """Both load generators count a subscribed client that received what it could not decode, close it,
    and the run reports it as an error: before, the count was kept and never sent, and a server writing
    corrupt frames passed as one whose clients were merely slow (or, roaming, merely reconnected)."""
    import asyncio
    import multiprocessing

    from migratory.bench import loader, roaming
    from migratory.bench.runner import Report, _collect_closed
    from migratory.bench.wire import MigratoryCodec

    class Transport:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    # a message whose subject's length runs past the frame: what no client of the protocol can decode
    garbage = build_frame(OP_BINARY, bytes((p.Op.MESSAGE, 0xFF, 0xFF, 0xFF)))

    async def feed() -> tuple[loader._State, RoamState, list[Transport]]:
        state = loader._State()
        codec = MigratoryCodec()
        codec.ready = True
        client = loader._Client(state, codec, 1)
        roam_state = RoamState()
        roaming_codec = RoamingCodec(roam_state, {})
        roaming_codec.ready = True
        roamer = roaming.Roamer(roaming_codec, 1)
        transports = [Transport(), Transport()]
        client.transport, roamer.transport = transports  # type: ignore[assignment]
        client.ready.set_result(None)
        roamer.ready.set_result(None)
        client.data_received(garbage)
        roamer.data_received(garbage)
        return state, roam_state, transports

    state, roam_state, transports = asyncio.run(feed())
    assert all(t.aborted for t in transports)
    assert state.malformed.count == 1 and roam_state.malformed.count == 1
    assert state.malformed.examples[0] == roam_state.malformed.examples[0]

    report = Report("migratory", 10, 2, 1, 64, 0)
    ours, theirs = multiprocessing.Pipe()
    theirs.send(("closed", 0, 0, roam_state.malformed.as_tuple()))

    class Process:
        def join(self, timeout: float) -> None:
            pass

        def is_alive(self) -> bool:
            return False

    _collect_closed([(Process(), ours)], [0], [0.0], [{}], report)
    assert len(report.errors) == 1
    assert report.errors[0].startswith("load generator 0: 1 clients received what they could not decode")
