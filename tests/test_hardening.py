"""Hardening of the node's own machinery: the worker bus, timers, crash loops, certificate reloads."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from migratory import bus as b
from migratory.client import MigratoryClient
from migratory.protocol import Status
from tests.conftest import ServerProcess, free_port, write_conf

ROOT = Path(__file__).resolve().parent.parent

FORGER = r"""
import os, socket, sys
sys.path.insert(0, {root!r})
from migratory import bus as b
name = sys.argv[1]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(name.encode().replace(b"@", b"\0", 1))
forged = b.Published("/forged/x", b"evil", {{}}, 1, 1, True, False)
try:
    sock.sendall(b.encode(b.Hello(0, b"guess")) + b.encode(forged))
except OSError as exc:  # the server may cut us off before we are done sending
    print("send", type(exc).__name__)
sock.settimeout(3)
try:
    print("read", len(sock.recv(100)))
except OSError as exc:
    print("closed", type(exc).__name__)
print("uid", os.getuid())
"""


def bus_sockets(supervisor: int) -> set[str]:
    """The abstract bus sockets of the server whose supervisor is ``supervisor`` (other servers may run)."""
    names = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[-1].startswith(f"@migratory-{supervisor}-"):
            names.add(parts[-1])
    return names


def wait_bus_sockets(supervisor: int, count: int) -> list[str]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        found = bus_sockets(supervisor)
        if len(found) >= count:
            return sorted(found)
        time.sleep(0.05)
    raise AssertionError(f"the server's bus sockets did not appear: {bus_sockets(supervisor)}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_another_local_user_cannot_publish_on_the_worker_bus(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"Workers": "2"})
    names = wait_bus_sockets(server.proc.pid, 2)
    assert len(names) == 2, names

    async def subscriber() -> list[bytes]:
        async with MigratoryClient([server.ws_url]) as client:
            assert (await client.subscribe(["/forged/x"]))["/forged/x"] is Status.OK
            for name in names:  # a process running as nobody (uid 65534) speaks on both workers' buses
                forged = subprocess.run(
                    [
                        "setpriv",
                        "--reuid",
                        "65534",
                        "--regid",
                        "65534",
                        "--clear-groups",
                        sys.executable,
                        "-c",
                        FORGER.format(root=str(ROOT)),
                        name,
                    ],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                assert "uid 65534" in forged.stdout, forged.stderr
            got = []
            try:
                while True:
                    got.append((await client.next_message(1.5)).content)
            except TimeoutError:
                return got

    assert asyncio.run(subscriber()) == []
    with pytest.raises(Exception, match="404"):
        import urllib.request

        urllib.request.urlopen(server.http_url + "/snapshot?subject=/forged/x", timeout=5)
    log = (server.log_folder / "server.log").read_text()
    assert log.count("bus: refused a process of uid 65534") >= 2
    assert "Traceback" not in log


def test_a_same_user_process_without_the_secret_is_refused(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory({"Workers": "2"})
    name = wait_bus_sockets(server.proc.pid, 2)[0]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(b"\0" + name[1:].encode())
    sock.sendall(b.encode(b.Hello(1, b"x" * 32)) + b.encode(b.Published("/forged/y", b"evil", {}, 1, 1, True, False)))
    sock.settimeout(5)
    assert sock.recv(10) == b""  # cut off
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(server.http_url + "/snapshot?subject=/forged/y", timeout=5)
    assert info.value.code == 404
    assert "bus: refused a peer without the node's secret" in (server.log_folder / "server.log").read_text()


def test_housekeeping_survives_a_failing_log_and_keeps_cutting_silent_peers(tmp_path: Path) -> None:
    from tests.conftest import start_server

    server = start_server(tmp_path / "srv", {"HandshakeTimeout": "1500", "LogMaxFileSize": "4096"})
    try:
        logs = server.log_folder
        moved = tmp_path / "logs-away"
        shutil.move(str(logs), str(moved))
        logs.write_text("not a folder any more")  # every log write and rotation now fails

        def get_health() -> bytes:
            # HandshakeTimeout is 1.5 s here: on a loaded machine a request can wait that long to be
            # read and be cut as silent (a reset), which is that feature working; ask again
            for attempt in range(3):
                try:
                    with socket.create_connection((server.host, server.port), timeout=5) as sock:
                        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                        return sock.recv(4096)
                except ConnectionResetError:
                    if attempt == 2:
                        raise
            raise AssertionError("unreachable")

        for _ in range(3):  # traffic that writes access.log lines
            get_health()
        time.sleep(2.5)
        silent = socket.create_connection((server.host, server.port), timeout=30)  # a dead tick would leave it open
        started = time.monotonic()
        with contextlib.suppress(ConnectionResetError):  # cut with a reset: just as good
            assert silent.recv(10) == b""  # still cut at HandshakeTimeout: the tick survived
        assert time.monotonic() - started < 30
        assert b'"timer_errors"' in get_health()
    finally:
        server.stop()
    err = server.proc.stderr.read().decode() if server.proc.stderr else ""
    assert "Traceback" not in err
    assert "housekeeping: writing access.log failed" in err


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_worker_that_cannot_start_ends_with_one_line_and_exit_2(tmp_path: Path, workers: str) -> None:
    folder = tmp_path / "srv"
    (folder / "logs" / "access.log").mkdir(parents=True)  # cannot be opened as a file, even by root
    conf = write_conf(folder, "127.0.0.1", free_port(), {"Workers": workers})
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "migratory_cli.main", "serve", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert time.monotonic() - started < 30
    assert "Traceback" not in proc.stderr
    assert re.search(r"cannot start: .*access\.log", proc.stderr), proc.stderr


def test_a_restarted_worker_serves_the_reloaded_certificate(tmp_path: Path) -> None:
    from migratory.certs import create_ca, issue_server_cert
    from tests.conftest import start_server
    from tests.test_tls import peer_serial

    pki = tmp_path / "pki"
    ca, ca_key = create_ca(pki)
    cert, key = issue_server_cert(ca, ca_key, ["localhost", "127.0.0.1"], pki)
    port = free_port()
    server = start_server(
        tmp_path / "srv",
        {"Workers": "2", "ListenEncrypted": f"127.0.0.1:{port}", "TLSCertificate": str(cert), "TLSKey": str(key)},
    )
    try:
        old = peer_serial(port, ca)
        issue_server_cert(ca, ca_key, ["localhost", "127.0.0.1"], pki)
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        # every worker (the kernel spreads the probes) serves a certificate other than the old one
        while time.monotonic() < deadline and old in {peer_serial(port, ca) for _ in range(8)}:
            time.sleep(0.2)
        new = peer_serial(port, ca)
        assert new != old
        workers = [int(p) for p in Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()]
        for pid in workers:  # every worker restarted after the reload serves the new certificate
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        serials: set[int] = set()
        while time.monotonic() < deadline:
            try:
                serials = {peer_serial(port, ca) for _ in range(8)}
                break
            except OSError:
                time.sleep(0.2)
        assert serials == {new}
    finally:
        server.stop()


def test_an_oversized_websocket_publish_is_answered_too_large_at_once(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory({"MessageSizeLimit": "1K"})

    async def scenario() -> None:
        async with MigratoryClient([server.ws_url]) as client:
            assert client.max_message_size == 1024  # CONNECTED (protocol version 2) says so
            started = time.monotonic()
            assert await client.publish("/big/x", b"x" * 4096) is Status.TOO_LARGE
            assert time.monotonic() - started < 1.0
            assert await client.publish("/big/x", b"fits") is Status.NO_SUBSCRIBER

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_connect_returns_as_soon_as_the_server_accepted(server_factory: Callable[..., ServerProcess]) -> None:
    server = server_factory()

    async def scenario() -> float:
        client = MigratoryClient([server.ws_url], request_timeout=30)
        started = time.monotonic()
        await client.connect()
        elapsed = time.monotonic() - started
        await client.close()
        return elapsed

    assert asyncio.run(scenario()) < 15  # not the whole request_timeout
