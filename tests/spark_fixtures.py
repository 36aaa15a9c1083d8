"""Known-answer logs for the Spark tests, and an independent per-second reference in plain Python."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

T0 = int(datetime(2026, 11, 2, tzinfo=UTC).timestamp())
L443 = "127.0.0.1:443"
L80 = "127.0.0.1:80"


def stamp(second: int, ms: int = 0) -> str:
    return datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{ms:03d}Z"


@dataclass
class Logs:
    """Events of one node, written as the server writes them."""

    access: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)

    def event(self, second: int, event: str, session: str, addr: str, listener: str, tls: bool, **extra: Any) -> None:
        self.access.append(
            {
                "v": 1,
                "ts": stamp(second, 250),
                "event": event,
                "session": session,
                "addr": addr,
                "port": 50000,
                "listener": listener,
                "protocol": "wss" if tls else "ws",
                "tls": tls,
                **extra,
            }
        )

    def publish(
        self, second: int, subject: str, recipients: int, size: int, latency: int, sampling: float = 1.0
    ) -> None:
        self.messages.append(
            {
                "v": 1,
                "ts": stamp(second, 500),
                "event": "publish",
                "subject": subject,
                "size": size,
                "fields": 1,
                "addr": "10.9.9.9",
                "port": 40000,
                "session": "9-0-9",
                "protocol": "ws",
                "qos": "standard",
                "retained": True,
                "status": "OK" if recipients else "NO_SUBSCRIBER",
                "recipients": recipients,
                "bytes_out": recipients * (size + 40),
                "latency_us": latency,
                "seq": len(self.messages) + 1,
                "epoch": 9,
                "sampling": sampling,
            }
        )


def _lines(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)


CORRUPT_LINES = [
    "not json at all",
    '{"v":1,"ts":"2026-13-45T99:00:00.000Z","event":"connect","session":"x"}',  # no such time
    '{"v":2,"ts":"2026-11-02T00:00:01.000Z","event":"connect","session":"x"}',  # a schema this job does not know
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect","port":"eighty"}',  # wrongly typed field
]


def known_logs(root: Path) -> tuple[list[str], Logs, Logs]:
    """Two nodes' log folders with the answers the tests assert (see each comment)."""
    a, b = Logs(), Logs()
    # a session connected before the logs begin: a disconnect without a connect
    a.event(T0 + 5, "disconnect", "1-0-0", "10.0.0.9", L80, False, duration_ms=3_600_000, reason="client_closed")
    a.event(T0 + 10, "connect", "1-0-1", "10.0.0.1", L443, True)
    a.event(T0 + 10, "connect", "1-0-2", "10.0.0.2", L80, False)
    a.event(T0 + 20, "connect", "1-0-3", "10.0.0.3", L80, False)
    a.event(T0 + 20, "subscribe", "1-0-1", "10.0.0.1", L443, True, subject="/a", conflation_ms=0)
    a.event(T0 + 20, "subscribe", "1-0-2", "10.0.0.2", L80, False, subject="/a", conflation_ms=0)
    a.event(T0 + 20, "subscribe", "1-0-3", "10.0.0.3", L80, False, subject="/b", conflation_ms=500)
    a.event(T0 + 100, "disconnect", "1-0-1", "10.0.0.1", L443, True, duration_ms=90_000, reason="client_closed")
    a.event(T0 + 200, "disconnect", "1-0-2", "10.0.0.2", L80, False, duration_ms=190_000, reason="slow_consumer")
    # a reconnect storm: 25 short sessions from one address in 25 seconds
    for i in range(25):
        sid = f"1-0-{100 + i}"
        a.event(T0 + 300 + i, "connect", sid, "192.0.2.9", L80, False)
        a.event(T0 + 300 + i, "disconnect", sid, "192.0.2.9", L80, False, duration_ms=500, reason="connection_lost")
    deny = [("203.0.113.5", "subscribe", "invalid_subject", "bad")] * 3 + [
        ("203.0.113.6", "publish", "entitlement", "/secret"),
        ("203.0.113.6", "publish", "entitlement", "/secret"),
        ("203.0.113.6", "publish", "address_not_allowed", "/a"),
        ("203.0.113.7", "publish", "message_too_big", "/a"),
    ]
    for n, (addr, request, code, subject) in enumerate(deny):
        fields = {"request": request, "reason_code": code, "reason": "no", "subject": subject}
        a.event(T0 + 400 + n, "denied", "1-0-7", addr, L80, False, **fields)
    for i in range(100):  # /a: latencies 1..100 us, 2 recipients each
        a.publish(T0 + 30 + i, "/a", recipients=2, size=10, latency=i + 1)
    for i in range(10):  # /b in the second hour, sampled at 0.5: each line stands for 2
        a.publish(T0 + 3600 + 60 * i, "/b", recipients=1, size=20, latency=1000, sampling=0.5)
    for _ in range(5):  # /c the next day, nobody listening
        a.publish(T0 + 90_000, "/c", recipients=0, size=5, latency=5)
    # node b reuses node a's session id: sessions are per node
    b.event(T0 + 50, "connect", "1-0-1", "10.0.1.1", L80, False)

    node_a, node_b = root / "a", root / "b"
    node_a.mkdir(parents=True)
    node_b.mkdir(parents=True)
    # the rotated file holds the older half, as the server's rotation leaves it
    half = len(a.access) // 2
    (node_a / "access.log.1").write_text(_lines(a.access[:half]))
    (node_a / "access.log").write_text(_lines(a.access[half:]) + "\n".join(CORRUPT_LINES) + "\n\n")
    (node_a / "message.log").write_text(_lines(a.messages))
    (node_a / "access.log.bak").write_text("a file that is not a log: never read\n")
    (node_b / "access.log").write_text(_lines(b.access))
    return [str(node_a), str(node_b)], a, b


INDICATORS = (
    "connected_clients",
    "connections_per_second",
    "disconnections_per_second",
    "messages_in_per_second",
    "messages_out_per_second",
    "bytes_in_per_second",
    "bytes_out_per_second",
)


def reference_series(nodes: list[Logs]) -> dict[int, dict[str, float]]:
    """The seven indicators per second, by plain loops over the events (independent of the Spark code)."""
    seconds: dict[int, dict[str, float]] = {}
    first = last = None
    for logs in nodes:
        for r in logs.access + logs.messages:
            s = int(datetime.strptime(r["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp())
            first = s if first is None else min(first, s)
            last = s if last is None else max(last, s)
    assert first is not None and last is not None
    for s in range(first, last + 1):
        seconds[s] = dict.fromkeys(INDICATORS, 0.0)
    for logs in nodes:
        for r in logs.access:
            s = int(datetime.strptime(r["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp())
            if r["event"] == "connect":
                seconds[s]["connections_per_second"] += 1
            elif r["event"] == "disconnect":
                seconds[s]["disconnections_per_second"] += 1
        for r in logs.messages:
            s = int(datetime.strptime(r["ts"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp())
            weight = 1 / r["sampling"]
            seconds[s]["messages_in_per_second"] += weight
            seconds[s]["messages_out_per_second"] += r["recipients"] * weight
            seconds[s]["bytes_in_per_second"] += r["size"] * weight
            seconds[s]["bytes_out_per_second"] += r["bytes_out"] * weight
    level, lowest, levels = 0.0, 0.0, {}
    for s in sorted(seconds):
        level += seconds[s]["connections_per_second"] - seconds[s]["disconnections_per_second"]
        levels[s] = level
        lowest = min(lowest, level)
    for s, value in levels.items():
        seconds[s]["connected_clients"] = value - lowest
    return seconds


# --- logs that used to break the report -------------------------------------------------------

# subjects are user data: Rich markup, mathtext, HTML, emoji codes
HOSTILE_SUBJECTS = ("/t/[/red]", "/m/$x^$", "/px/$USD/$EUR", "/h/<script>alert(1)</script>", "/e/:smile:")

# each of these is one corrupt line (and no event): not exactly one JSON object
NOT_ONE_OBJECT = [
    '[{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"},{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"}]',
    "[]",
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"}{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"}',
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"} xyz',
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"}}',
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"}] [{"v":1}',
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect","subject":"/a\rb"}',  # a bare CR inside the line
]
# one object each, as the server writes them or as an editor may leave them
ONE_OBJECT = [
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"subscribe","subject":"/t/[/red]"}',
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"subscribe","subject":"/a]}"}',
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"}\r',  # a CRLF file
    ' {"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect","extra":{"n":[1,2]}} ',
]
# corrupt as well, beside NOT_ONE_OBJECT: what follows the object, or no object of the schema
NOT_ONE_OBJECT_EITHER = [
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"},{"v":1}',
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"},"k":1',
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"}]}junk',
    '{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"connect"}] }junk',
    "null",
    "{}",
    '"text"',
]
# a truncated line (no closing brace) with bytes that are not UTF-8, longer than the example kept
INVALID_UTF8 = b'{"v":1,"ts":"2026-11-02T00:00:01.000Z","event":"publish","subject":"/\xff\xfe' + b"x" * 400 + b'"\n'


def hostile_logs(root: Path) -> tuple[list[str], Logs]:
    """One node: hostile subjects, HTTP requests (some failed before their head was parsed), lines that
    are not one JSON object, and a gzipped rotation holding the oldest events."""
    logs = Logs()
    for n, subject in enumerate(HOSTILE_SUBJECTS):
        sid = f"1-0-{n + 1}"
        logs.event(T0 + n, "connect", sid, f"10.0.0.{n + 1}", L80, False)
        logs.event(T0 + n, "subscribe", sid, f"10.0.0.{n + 1}", L80, False, subject=subject, conflation_ms=0)
        for i in range(n + 1):
            logs.publish(T0 + 10 + n, subject, recipients=1, size=10, latency=100 + i)
        logs.event(
            T0 + 20,
            "denied",
            sid,
            f"10.0.0.{n + 1}",
            L80,
            False,
            request="publish",
            reason_code="entitlement",
            reason="no",
            subject=subject,
        )
    http = [
        ("GET", "/health", 200, 2),
        ("POST", "/publish", 200, 3),
        ("POST", "/publish", 403, 1),
        ("GET", "/$x^$/[/red]", 404, 1),
        (None, None, 400, 2),  # malformed request line: answered before the head was parsed
        (None, None, 413, 1),
    ]
    for method, path, status, times in http:
        for i in range(times):
            logs.event(
                T0 + 30 + i,
                "http",
                f"1-0-{90 + i}",
                "10.0.9.9",
                L80,
                False,
                method=method,
                path=path,
                status=status,
                subject=None,
                bytes_out=100,
            )
    node = root / "hostile"
    node.mkdir(parents=True)
    older = [logs.access.pop(0), logs.access.pop(0)]  # the first connect and subscribe: rotated and gzipped
    with gzip.open(node / "access.log.1.gz", "wb") as handle:
        handle.write(_lines(older).encode())
    body = _lines(logs.access) + "\n".join(NOT_ONE_OBJECT) + "\n"
    (node / "access.log").write_text(body)
    (node / "message.log").write_text(_lines(logs.messages))
    (node / "access.log.3.zst").write_bytes(b"(not a format Spark reads)")
    logs.access[:0] = older
    return [str(node)], logs


def broken_utf8_logs(root: Path) -> list[str]:
    """A node whose message.log ends with a corrupt line that is not UTF-8."""
    logs = Logs()
    logs.event(T0 + 1, "connect", "1-0-1", "10.0.0.1", L80, False)
    logs.publish(T0 + 2, "/a", recipients=0, size=5, latency=10)
    node = root / "utf8"
    node.mkdir(parents=True)
    (node / "access.log").write_text(_lines(logs.access))
    (node / "message.log").write_bytes(_lines(logs.messages).encode() + INVALID_UTF8)
    return [str(node)]


def quiet_logs(root: Path) -> list[str]:
    """A clean node with no denied request, no HTTP request and no message.log (MessageLog off)."""
    logs = Logs()
    logs.event(T0 + 1, "connect", "1-0-1", "10.0.0.1", L80, False)
    logs.event(T0 + 2, "subscribe", "1-0-1", "10.0.0.1", L80, False, subject="/a", conflation_ms=0)
    logs.event(T0 + 90, "disconnect", "1-0-1", "10.0.0.1", L80, False, duration_ms=89_000, reason="client_closed")
    node = root / "quiet"
    node.mkdir(parents=True)
    (node / "access.log").write_text(_lines(logs.access))
    return [str(node)]
