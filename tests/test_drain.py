"""Lame-duck drain (issue 51 item 1, docs/operations.md "Draining"): a stopping server stops accepting, says
"draining" on /health (503) and sends its clients elsewhere a few at a time, then stops; in a Guaranteed
cluster nothing acknowledged is lost and no subscriber is resynchronised."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from migratory import protocol as p
from migratory.bench.cluster import LocalCluster
from migratory.client import EventKind, MigratoryClient, StatusEvent
from migratory.message import MessageType
from migratory.protocol import Status
from tests.conftest import ServerProcess, free_port

CLIENTS = 250


def _health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_stopping_node_drains_its_clients_a_few_at_a_time(server_factory: Callable[..., ServerProcess]) -> None:
    """250 clients at 100 a second (DrainTime 4 s allows 62.5 a second: the floor decides): they leave over
    about 2.5 s with close 1013, /health says 503 draining meanwhile, no new client is taken, then exit 0."""
    monitor = free_port()
    server = server_factory({"DrainTime": "4000", "MonitorHTTP.Listen": f"127.0.0.1:{monitor}"})
    monitor_url = f"http://127.0.0.1:{monitor}"

    async def scenario() -> tuple[list[tuple[float, int | None]], list[tuple[int, str]], bool]:
        sockets = []
        for _ in range(CLIENTS):
            ws = await connect(server.ws_url, subprotocols=[Subprotocol("migratory.v1")], compression=None)
            await ws.send(p.encode_connect(""))
            sockets.append(ws)
        await asyncio.sleep(0.5)
        closes: list[tuple[float, int | None]] = []

        async def watch(ws: Any) -> None:
            try:
                async for _ in ws:
                    pass
            except ConnectionClosed:
                pass
            closes.append((time.monotonic(), ws.close_code))

        watchers = [asyncio.create_task(watch(ws)) for ws in sockets]
        server.proc.send_signal(signal.SIGTERM)
        healths: list[tuple[int, str]] = []
        refused = False
        while len(closes) < CLIENTS:
            code, doc = await asyncio.to_thread(_health, monitor_url)
            healths.append((code, str(doc.get("status"))))
            try:
                late = await connect(server.ws_url, open_timeout=1)
                await late.close()
            except (OSError, TimeoutError):
                refused = True
            await asyncio.sleep(0.1)
        await asyncio.gather(*watchers)
        return closes, healths, refused

    closes, healths, refused = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert server.proc.wait(20) == 0
    assert {code for _, code in closes} == {1013}, "every client was told to go elsewhere"
    times = sorted(at for at, _ in closes)
    assert 1.5 <= times[-1] - times[0] <= 6.0, f"the drain took {times[-1] - times[0]:.2f} s, not about 2.5 s"
    assert (503, "draining") in healths, healths
    assert refused, "a new client was accepted while draining"
    assert "draining 250 clients" in (server.log_folder / "server.log").read_text()


def test_migratory_drain_stops_a_server_of_this_machine(server_factory: Callable[..., ServerProcess]) -> None:
    """``migratory drain URL``: SIGTERM to the supervisor behind the URL, the drain followed to its end; one line
    and a distinct exit code when nothing answers there. Two workers: the answering one is a child of the
    supervisor the signal is for."""
    server = server_factory({"Workers": "2"})

    async def clients() -> list[int | None]:
        sockets = [
            await connect(server.ws_url, subprotocols=[Subprotocol("migratory.v1")], compression=None) for _ in range(5)
        ]
        for ws in sockets:
            await ws.send(p.encode_connect(""))
        await asyncio.sleep(0.3)
        drained = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "migratory_cli.main", "drain", server.http_url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert drained.returncode == 0, drained.stderr
        assert "drained and stopped" in drained.stdout
        codes = []
        for ws in sockets:
            await ws.wait_closed()
            codes.append(ws.close_code)
        return codes

    assert asyncio.run(asyncio.wait_for(clients(), 60)) == [1013] * 5
    assert server.proc.wait(5) == 0
    nobody = subprocess.run(
        [sys.executable, "-m", "migratory_cli.main", "drain", server.http_url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert nobody.returncode == 3 and nobody.stderr.count("\n") == 1, nobody.stderr
    assert "cannot reach the server" in nobody.stderr and "Traceback" not in nobody.stderr


@pytest.mark.slow
def test_a_drained_guaranteed_member_loses_nothing_and_resyncs_no_one(tmp_path: Path) -> None:
    """SIGTERM of the member holding every subscriber while publications go on through another member: the
    subscribers move to the survivors with their positions, get every acknowledged message in order, and no
    NOTIFY_DATA_RESYNC; the member's agent stops after its workers drained (the cluster served them meanwhile)."""
    subjects = [f"/drain/s{i}" for i in range(8)]
    with LocalCluster(tmp_path, 3, mode="Guaranteed", extra={"DrainTime": "3000"}) as cluster:
        cluster.start_all()
        urls = [cluster[i].ws_url for i in range(3)]

        async def scenario() -> tuple[dict[str, list[bytes]], list[str], list[str]]:
            resyncs: list[str] = []
            got: dict[str, list[bytes]] = {s: [] for s in subjects}
            subscribers = []
            for n in range(20):

                def on_status(event: StatusEvent) -> None:
                    if event.kind is EventKind.NOTIFY_DATA_RESYNC:
                        resyncs.append(str(event.subject))

                # member 0 (which will drain) first, nearly always; the others after it
                client = MigratoryClient([(urls[0], 1000.0), (urls[1], 1.0), (urls[2], 1.0)], on_status=on_status)
                await client.connect()
                await client.subscribe([subjects[n % len(subjects)]])
                subscribers.append(client)
            acked: list[str] = []
            async with MigratoryClient([urls[1]]) as publisher:
                for r in range(120):
                    subject = subjects[r % len(subjects)]
                    status = await publisher.publish(subject, f"{r}".encode(), guaranteed=True, retries=3)
                    if status in (Status.OK, Status.NO_SUBSCRIBER):
                        acked.append(f"{subject} {r}")
                    if r == 30:
                        await asyncio.to_thread(cluster.stop, 0, 30.0)  # the drain runs meanwhile
                    await asyncio.sleep(0.02)
            await asyncio.sleep(2)
            for n, client in enumerate(subscribers):
                subject = subjects[n % len(subjects)]
                while True:
                    try:
                        message = await client.next_message(0.5)
                    except TimeoutError:
                        break
                    if message.subject == subject and message.type is not MessageType.SNAPSHOT:
                        got.setdefault(f"{n}", []).append(message.content)
                await client.close()
            return got, acked, resyncs

        got, acked, resyncs = run(scenario())
        assert not resyncs, resyncs
        for n in range(20):
            subject = subjects[n % len(subjects)]
            want = [line.split()[1].encode() for line in acked if line.split()[0] == subject]
            assert got.get(f"{n}") == want, (n, got.get(f"{n}"), want)
        drained = re.search(r"draining (\d+) clients", cluster.server_log(0))
        assert drained is not None and int(drained.group(1)) >= 15, "the subscribers were not on member 0"
        for survivor in (1, 2):  # a planned stop reads as one: announced, at INFO, no WARNING about links
            text = cluster.server_log(survivor)
            assert "member 0 is leaving the cluster" in text and "closed: the member stopped, as it announced" in text
            lines = text.splitlines()
            warned = [line for line in lines if '"WARNING"' in line and ("link" in line or "quorum" in line)]
            assert not warned, warned


def run(coro: Any, timeout: float = 180) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))
