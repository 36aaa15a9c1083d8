"""Realistic synthetic logs in the server's schema (docs/logs.md), for the benchmark and for trying the report.

Per node: sessions arrive and leave (durations spread from seconds to hours,
the server's disconnect reasons), subscribe to popular subjects more often
than to rare ones (Zipf-like), publications follow a daily rhythm with fan-out
from the subject's popularity and a long-tailed latency, a trickle of denied
requests, HTTP requests (health checks, publishes, snapshots, a few answered
with an error before their head was parsed), one reconnect storm per hour and
a few corrupt lines; and stats.log, the server's own figures of that traffic
every minute (one corrupt line in it per node). Lines are formatted by hand (not ``json.dumps``) so that
gigabytes take seconds to write. Deterministic for a given seed.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import random
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime

__all__ = ["GenerateResult", "generate"]

_REASONS = (
    ("client_closed", 70),
    ("connection_lost", 15),
    ("keepalive_timeout", 6),
    ("slow_consumer", 2),
    ("protocol_error", 2),
    ("server_shutdown", 5),
)
_DENIED = (
    ("invalid_subject", "subscribe", "subject must start with /"),
    ("entitlement", "subscribe", "not entitled"),
    ("entitlement", "publish", "not entitled"),
    ("message_too_big", "publish", "content exceeds MessageSizeLimit"),
    ("address_not_allowed", "publish", "publishing not allowed from this address"),
    ("subscription_limit", "subscribe", "too many subscriptions"),
    ("rate_limited", "connect", "too many connections per second"),
)
# HTTP requests: (method, path, status, bytes out, weight); no method and path for a request
# answered before its head was parsed (malformed, too large)
_HTTP = (
    ("GET", "/health", 200, 60, 50),
    ("POST", "/publish", 200, 80, 30),
    ("POST", "/publish", 403, 90, 4),
    ("GET", "/snapshot", 200, 400, 10),
    ("GET", "/snapshot", 404, 90, 3),
    ("GET", "/favicon.ico", 404, 90, 2),
    (None, None, 400, 70, 1),
    (None, None, 413, 70, 1),
)


@dataclass(frozen=True)
class GenerateResult:
    """What was written."""

    folders: list[str]
    access_lines: int
    message_lines: int
    corrupt_lines: int
    bytes: int
    first: datetime
    last: datetime
    stats_lines: int = 0  # good stats.log lines (its corrupt ones are in corrupt_lines)
    stats: list[dict[str, object]] = field(default_factory=list, repr=False)  # every good stats.log line


def _stamp(second: int, ms: int) -> str:
    return datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{ms:03d}Z"


def _choice(rng: random.Random, weighted: tuple[tuple[str, int], ...]) -> str:
    total = sum(w for _, w in weighted)
    pick = rng.uniform(0, total)
    for name, w in weighted:
        pick -= w
        if pick <= 0:
            return name
    return weighted[-1][0]


def generate(
    out: str,
    size_bytes: int,
    nodes: int = 1,
    start: datetime | None = None,
    publish_rate: float = 400.0,
    clients: int = 2000,
    subjects: int = 2000,
    seed: int = 7,
    rotate_bytes: int = 256 * 1024 * 1024,
) -> GenerateResult:
    """Write about ``size_bytes`` of logs in total into ``out/node-N`` folders."""
    rng = random.Random(seed)
    begin = start or datetime(2026, 11, 2, tzinfo=UTC)
    first_second = int(begin.timestamp())
    names = [f"/Stocks/NYSE/S{i:05d}" for i in range(subjects)]
    popularity = [1.0 / (i + 1) ** 1.1 for i in range(subjects)]
    cumulative = []
    acc = 0.0
    for p in popularity:
        acc += p
        cumulative.append(acc)
    folders = [os.path.join(out, f"node-{n}") for n in range(nodes)]
    writers = []
    for folder in folders:
        os.makedirs(folder, exist_ok=True)
        writers.append(
            {
                "access": _Rotating(folder, "access.log", rotate_bytes),
                "message": _Rotating(folder, "message.log", rotate_bytes),
                "stats": _Rotating(folder, "stats.log", rotate_bytes),
            }
        )
    per_node = size_bytes / nodes
    access_lines = message_lines = corrupt_lines = 0
    last_second = first_second
    stats_written: list[dict[str, object]] = []
    for node, files in enumerate(writers):
        access, message = files["access"], files["message"]
        figures = _Figures(files["stats"], "node" if nodes == 1 else f"member-{node + 1}", 1_700_000_000 + node)
        epoch = 1_700_000_000 + node
        listener = f"10.0.{node}.1:443"
        plain_listener = f"10.0.{node}.1:80"
        counter = 0
        leaving: list[
            tuple[int, int, str, str, int, str, int, bool]
        ] = []  # (end, ms, session, addr, port, listener, start, tls)
        second = first_second
        while access.total + message.total < per_node:
            day_phase = math.sin((second % 86400) / 86400 * 2 * math.pi - math.pi / 2)
            load = 0.55 + 0.45 * day_phase  # quiet at night, busy in the afternoon
            # connections: keep the population near ``clients`` times the daily load
            target = clients * (0.3 + 0.7 * load)
            arrivals = max(0, int(rng.gauss((target - len(leaving)) / 30 + 2, 2)))
            if second % 3600 == 1800:  # a reconnect storm: one address, 40 short sessions
                storm_addr = f"192.0.2.{node + 1}"
                for k in range(40):
                    counter += 1
                    session = f"{epoch}-0-{counter}"
                    ms = (k * 23) % 1000
                    common = f'"session":"{session}","addr":"{storm_addr}","port":{20000 + k},"listener":"{plain_listener}","protocol":"ws","tls":false'
                    access.write(f'{{"v":1,"ts":"{_stamp(second, ms)}","event":"connect",{common}}}\n')
                    heapq.heappush(
                        leaving, (second + 1, ms, session, storm_addr, 20000 + k, plain_listener, second, False)
                    )
                    access_lines += 1
                figures.now["connections_per_second"] += 40
            figures.now["connections_per_second"] += arrivals
            for _ in range(arrivals):
                counter += 1
                session = f"{epoch}-{counter % 2}-{counter}"
                addr = f"10.{rng.randrange(1, 250)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
                port = rng.randrange(1024, 65535)
                tls = rng.random() < 0.8
                lst = listener if tls else plain_listener
                ms = rng.randrange(1000)
                common = f'"session":"{session}","addr":"{addr}","port":{port},"listener":"{lst}","protocol":"{"wss" if tls else "ws"}","tls":{"true" if tls else "false"}'
                access.write(f'{{"v":1,"ts":"{_stamp(second, ms)}","event":"connect",{common}}}\n')
                access_lines += 1
                for _ in range(1 + int(rng.expovariate(0.5))):
                    subject = names[_pick(rng, cumulative)]
                    access.write(
                        f'{{"v":1,"ts":"{_stamp(second, ms)}","event":"subscribe",{common},"subject":"{subject}","conflation_ms":0}}\n'
                    )
                    access_lines += 1
                duration = int(rng.lognormvariate(6.5, 1.6))  # median ~11 minutes
                heapq.heappush(leaving, (second + max(1, duration), ms, session, addr, port, lst, second, tls))
            while leaving and leaving[0][0] <= second:
                end, ms, session, addr, port, lst, began, tls = heapq.heappop(leaving)
                figures.now["disconnections_per_second"] += 1
                reason = _choice(rng, _REASONS)
                common = f'"session":"{session}","addr":"{addr}","port":{port},"listener":"{lst}","protocol":"{"wss" if tls else "ws"}","tls":{"true" if tls else "false"}'
                access.write(
                    f'{{"v":1,"ts":"{_stamp(second, ms)}","event":"disconnect",{common},"duration_ms":{(end - began) * 1000},'
                    f'"reason":"{reason}","msgs_in":0,"msgs_out":{rng.randrange(5000)},"bytes_in":{rng.randrange(200, 2000)},'
                    f'"bytes_out":{rng.randrange(10_000, 2_000_000)}}}\n'
                )
                access_lines += 1
            if rng.random() < 0.3:  # an HTTP request (health checks, HTTP publishes, snapshots, errors)
                method, path, code_http, answer, _ = _HTTP[_weighted(rng, _HTTP_WEIGHTS)]
                quoted = "null" if method is None else f'"{method}"'
                where = "null" if path is None else f'"{path}"'
                named = f'"{names[rng.randrange(subjects)]}"' if path in ("/publish", "/snapshot") else "null"
                access.write(
                    f'{{"v":1,"ts":"{_stamp(second, rng.randrange(1000))}","event":"http","session":"{epoch}-1-0",'
                    f'"addr":"10.250.1.{rng.randrange(1, 20)}","port":{rng.randrange(1024, 65535)},'
                    f'"listener":"{plain_listener}","protocol":"http","tls":false,"method":{quoted},"path":{where},'
                    f'"status":{code_http},"subject":{named},"bytes_out":{answer}}}\n'
                )
                access_lines += 1
            if rng.random() < 0.2:
                code, request, text = _DENIED[rng.randrange(len(_DENIED))]
                subject = "null" if request == "connect" else f'"{names[rng.randrange(subjects)]}"'
                access.write(
                    f'{{"v":1,"ts":"{_stamp(second, rng.randrange(1000))}","event":"denied","session":"{epoch}-0-0",'
                    f'"addr":"203.0.113.{rng.randrange(1, 20)}","port":{rng.randrange(1024, 65535)},"listener":"{listener}",'
                    f'"protocol":"wss","tls":true,"request":"{request}","reason_code":"{code}","reason":"{text}",'
                    f'"subject":{subject}}}\n'
                )
                access_lines += 1
                figures.denied[code] = figures.denied.get(code, 0) + 1
            publications = max(0, int(rng.gauss(publish_rate * load, math.sqrt(publish_rate))))
            lines = []
            for _ in range(publications):
                index = _pick(rng, cumulative)
                recipients = max(0, int(len(leaving) * popularity[index] * rng.uniform(0.5, 1.5)))
                size = rng.randrange(40, 400)
                status = "OK" if recipients else "NO_SUBSCRIBER"
                latency = int(rng.lognormvariate(3.5, 0.8)) + recipients // 4
                counter += 1
                figures.publication(size, recipients, recipients * (size + 40))
                lines.append(
                    f'{{"v":1,"ts":"{_stamp(second, rng.randrange(1000))}","event":"publish","subject":"{names[index]}",'
                    f'"size":{size},"fields":{rng.randrange(4)},"addr":"10.250.0.{node + 1}","port":40000,'
                    f'"session":"{epoch}-0-1","protocol":"ws","qos":"standard","retained":true,"status":"{status}",'
                    f'"recipients":{recipients},"bytes_out":{recipients * (size + 40)},"latency_us":{latency},'
                    f'"seq":{counter},"epoch":{epoch},"sampling":1.0}}\n'
                )
            message.write("".join(lines))
            message_lines += publications
            if second % 7200 == 3600:
                access.write('{"v":1,"ts":"not a time","event":"connect"}\n{"truncated\n')
                corrupt_lines += 2
            figures.now["connected_clients"] = len(leaving)
            if figures.second(second, first_second):
                corrupt_lines += 1
            last_second = max(last_second, second)
            second += 1
        access.close()
        message.close()
        figures.file.close()
        stats_written.extend(figures.written)
    total = sum(f["access"].total + f["message"].total for f in writers)
    return GenerateResult(
        folders=folders,
        access_lines=access_lines,
        message_lines=message_lines,
        corrupt_lines=corrupt_lines,
        bytes=total,
        first=begin,
        last=datetime.fromtimestamp(last_second, UTC),
        stats_lines=len(stats_written),
        stats=stats_written,
    )


_HTTP_WEIGHTS = [float(weight) for *_, weight in _HTTP]


def _weighted(rng: random.Random, weights: list[float]) -> int:
    pick = rng.uniform(0, sum(weights))
    for index, weight in enumerate(weights):
        pick -= weight
        if pick <= 0:
            return index
    return len(weights) - 1


def _pick(rng: random.Random, cumulative: list[float]) -> int:
    """Index drawn with the Zipf-like weights (binary search over the running sum)."""
    import bisect

    return min(len(cumulative) - 1, bisect.bisect_left(cumulative, rng.random() * cumulative[-1]))


class _Rotating:
    """Appends to NAME and, past ``limit`` bytes, renames it as the server does (NAME -> NAME.1 -> NAME.2 ...)."""

    def __init__(self, folder: str, name: str, limit: int) -> None:
        self.folder, self.name, self.limit = folder, name, limit
        self.path = os.path.join(folder, name)
        self.handle = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self.size = 0
        self.total = 0

    def write(self, text: str) -> None:
        data = len(text)  # ASCII only
        if self.size and self.size + data > self.limit:
            self.handle.close()
            rotated = sorted(
                (int(n.rsplit(".", 1)[1]) for n in os.listdir(self.folder) if n.startswith(self.name + ".")),
                reverse=True,
            )
            for number in rotated:
                os.replace(f"{self.path}.{number}", f"{self.path}.{number + 1}")
            os.replace(self.path, f"{self.path}.1")
            self.handle = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
            self.size = 0
        self.handle.write(text)
        self.size += data
        self.total += data

    def close(self) -> None:
        self.handle.close()


_STATS_INDICATORS = (
    "connected_clients",
    "connections_per_second",
    "disconnections_per_second",
    "messages_in_per_second",
    "messages_out_per_second",
    "bytes_in_per_second",
    "bytes_out_per_second",
)
_STATS_TOTALS = (
    ("connections_total", "connections_per_second"),
    ("messages_in", "messages_in_per_second"),
    ("messages_out", "messages_out_per_second"),
    ("bytes_in", "bytes_in_per_second"),
    ("bytes_out", "bytes_out_per_second"),
)


class _Figures:
    """A node's own statistics of the generated traffic, written to stats.log as the server does (docs/logs.md):
    every minute, each indicator's last second and its maxima and averages over 1, 5 and 15 minutes."""

    def __init__(self, file: _Rotating, server: str, epoch: int) -> None:
        self.file, self.server, self.epoch = file, server, epoch
        self.now: dict[str, float] = dict.fromkeys(_STATS_INDICATORS, 0.0)
        self.history: deque[dict[str, float]] = deque(maxlen=900)
        self.totals: dict[str, int] = {name: 0 for name, _ in _STATS_TOTALS}
        self.denied: dict[str, int] = {}
        self.written: list[dict[str, object]] = []

    def publication(self, size: int, recipients: int, bytes_out: int) -> None:
        now = self.now
        now["messages_in_per_second"] += 1
        now["messages_out_per_second"] += recipients
        now["bytes_in_per_second"] += size
        now["bytes_out_per_second"] += bytes_out

    def second(self, second: int, first_second: int) -> bool:
        """Close the second; on a minute, write the stats line. True when a corrupt line was written too."""
        self.history.append(self.now)
        for total, indicator in _STATS_TOTALS:
            self.totals[total] += int(self.now[indicator])
        self.now = dict.fromkeys(_STATS_INDICATORS, 0.0)
        self.now["connected_clients"] = self.history[-1]["connected_clients"]
        if second % 60 != 59:
            return False
        history = list(self.history)
        record: dict[str, object] = {
            "v": 1,
            "ts": _stamp(second, 0),
            "event": "stats",
            "node": self.server,
            "epoch": self.epoch,
            "uptime_s": second + 1 - first_second,
            "history_s": second + 1 - first_second,
        }
        for name in _STATS_INDICATORS:
            figures: dict[str, float] = {"current": history[-1][name]}
            for window, seconds in (("1m", 60), ("5m", 300), ("15m", 900)):
                values = [row[name] for row in history[-seconds:]]
                figures[f"{window}_max"] = max(values)
                figures[f"{window}_avg"] = round(sum(values) / len(values), 3)
            record[name] = figures
        record["totals"] = {"connections": int(history[-1]["connected_clients"]), **self.totals}
        record["denied"] = {code: count for code, count in sorted(self.denied.items()) if count}
        self.file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self.written.append({**record, "folder": os.path.abspath(os.path.dirname(self.file.path))})
        if second % 3600 == 1859:  # once an hour, a line cut short (a disk that filled up)
            self.file.write('{"v":1,"ts":"' + _stamp(second, 1) + '","event":"stats","node":\n')
            return True
        return False
