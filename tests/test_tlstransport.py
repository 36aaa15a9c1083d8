"""The lean TLS transport (migratory/server/transport/tls.py): in-process against OpenSSL clients, and end to end.

In-process tests drive a :class:`TLSTransport` over a fake TCP transport with a real
OpenSSL client (``ssl.SSLObject`` over memory BIOs), so every byte and state can be
checked without timing; end-to-end tests run ``migratory serve`` with ``ListenEncrypted``
against real clients (the Python client, urllib, ``openssl s_client``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from migratory.certs import create_ca, issue_server_cert
from migratory.client import MigratoryClient
from migratory.protocol import Status
from migratory.server.transport import heap
from migratory.server.transport.tls import SUITES, TLSServer, TLSTransport, enable, expand_label
from migratory.server.transport.tls import base as tls_base
from migratory.server.transport.tls import libssl as tls_libssl
from migratory.server.transport.tls import records as tls_records
from tests.conftest import ServerProcess, free_port
from tests.test_tls import new_certificate_served, peer_serial


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pki")
    ca_cert, ca_key = create_ca(folder / "ca")
    cert, key = issue_server_cert(ca_cert, ca_key, ["localhost", "127.0.0.1"], folder / "srv")
    return {"ca": ca_cert, "ca_key": ca_key, "cert": cert, "key": key}


def server_context(pki: dict[str, Path]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.set_alpn_protocols(["http/1.1"])
    context.load_cert_chain(pki["cert"], pki["key"])
    return context


# --- in-process: a fake TCP transport, a real OpenSSL client -----------------------------


class FakeTCP:
    """What uvloop's TCP transport offers the TLS transport, recording what is written."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.out += data

    def take(self) -> bytes:
        data = bytes(self.out)
        self.out.clear()
        return data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.9", 4242) if name == "peername" else default

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class App(asyncio.Protocol):
    """The application protocol: records every callback."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.received = b""
        self.eof = False
        self.lost: list[Exception | None] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, TLSTransport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received += data

    def eof_received(self) -> bool | None:
        self.eof = True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.append(exc)


class Pair:
    """A TLSTransport (server side) and an OpenSSL client, joined by hand."""

    def __init__(self, server: TLSServer, client_context: ssl.SSLContext) -> None:
        self.server = server
        self.app = App()
        self.transport = TLSTransport(server, self.app)
        self.tcp = FakeTCP()
        self.transport.connection_made(self.tcp)  # type: ignore[arg-type]
        self.c_in, self.c_out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.client = client_context.wrap_bio(self.c_in, self.c_out, server_hostname="127.0.0.1")
        self.notified = False

    def handshake(self, *, with_data: bytes = b"") -> None:
        """Run the handshake; ``with_data`` travels in the same TCP segment as the client's Finished."""
        for _ in range(10):
            try:
                self.client.do_handshake()
                if with_data:
                    self.client.write(with_data)
                    with_data = b""
            except ssl.SSLWantReadError:
                pass
            sent = self.c_out.read()
            if sent:
                self.transport.data_received(sent)
            answer = self.tcp.take()
            if answer:
                self.c_in.write(answer)
            if not sent and not answer:
                return

    def send(self, data: bytes) -> None:
        self.client.write(data)
        self.transport.data_received(self.c_out.read())

    def receive(self) -> bytes:
        """What the client can read from what the server wrote; ``close_notify`` sets ``self.notified``."""
        self.c_in.write(self.tcp.take())
        out = b""
        try:
            while True:
                chunk = self.client.read(65536)
                if not chunk:  # close_notify received (CPython returns b"" for it)
                    self.notified = True
                    break
                out += chunk
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:  # a clean TLS close, not a truncation
            self.notified = True
        return out


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(params=["c-sealer", "python-sealer"])
def tls_server(pki: dict[str, Path], loop: asyncio.AbstractEventLoop, request: pytest.FixtureRequest) -> TLSServer:
    """Each in-process test twice: AES-GCM records sealed by the C extension, then by ``cryptography``."""
    server = TLSServer(server_context(pki), App, 5.0, loop)
    if request.param == "python-sealer":
        server.sealer = None
    else:
        assert server.sealer is not None, "the C record sealer (migratory/server/transport/_tlsseal.c) was not built"
    return server


def client_context(pki: dict[str, Path], version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    context.maximum_version = version
    return context


def test_the_context_hook_is_verified_and_set(pki: dict[str, Path]) -> None:
    context = server_context(pki)
    assert enable(context) and enable(context)  # idempotent
    lib = tls_libssl._libssl()
    assert lib is not None
    pointer = tls_libssl.ssl_ctx_pointer(context, lib)
    assert pointer is not None and lib.SSL_CTX_get_options(pointer) == int(context.options)
    # each context its own SSL_CTX, and libssl sees an option change made through Python
    other = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    other.options |= ssl.OP_NO_TICKET
    other_pointer = tls_libssl.ssl_ctx_pointer(other, lib)
    assert other_pointer not in (None, pointer)
    assert lib.SSL_CTX_get_options(other_pointer) & int(ssl.OP_NO_TICKET)


def test_expand_label_matches_rfc8448() -> None:
    """RFC 8448 section 3: the server's handshake write key and IV from its handshake traffic secret."""
    secret = bytes.fromhex("b67b7d690cc16c4e75e54213cb2d37b4e9c912bcded9105d42befd59d391ad38")
    assert expand_label(secret, b"key", 16, "sha256") == bytes.fromhex("3fce516009c21727d0f2e4e86ee403bc")
    assert expand_label(secret, b"iv", 12, "sha256") == bytes.fromhex("5d313eb2671276ee13000b30")


def test_tls13_leaves_openssl_and_idle_connections_hold_no_cipher_state(
    tls_server: TLSServer, pki: dict[str, Path]
) -> None:
    pair = Pair(tls_server, client_context(pki))
    pair.handshake()
    transport = pair.transport
    assert pair.app.transport is transport and transport.lean
    assert transport._ssl is None and transport._incoming is None and transport._outgoing is None
    assert pair.client.version() == "TLSv1.3"
    pair.send(b"GET / HTTP/1.1\r\n\r\n")
    assert pair.app.received == b"GET / HTTP/1.1\r\n\r\n"
    transport.write(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
    assert pair.receive() == b"HTTP/1.1 101 Switching Protocols\r\n\r\n"
    # active: cipher objects held; after two sweeps without traffic: none (only the secrets stay)
    assert transport.write_cipher is not None and transport._dec is not None and tls_server.holding == 1
    tls_server.sweep()
    assert transport.write_cipher is not None  # used since the last sweep
    tls_server.sweep()
    assert transport.write_cipher is None and transport._dec is None and tls_server.holding == 0
    assert transport._rbuf == b"" and transport._ssl is None
    # and the connection goes on with the next record numbers
    transport.write(b"x" * 100)
    assert pair.receive() == b"x" * 100
    pair.send(b"ping")
    assert pair.app.received.endswith(b"ping")


def test_data_with_the_clients_finished_and_large_writes(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    pair = Pair(tls_server, client_context(pki))
    pair.handshake(with_data=b"GET /early HTTP/1.1\r\n\r\n")
    assert pair.transport.lean
    assert pair.app.received == b"GET /early HTTP/1.1\r\n\r\n"
    big = bytes(range(256)) * 300  # 76,800 bytes: five records, one TCP write
    pair.transport.write(big)
    written = bytes(pair.tcp.out)
    assert written.count(b"\x17\x03\x03") >= 5
    assert pair.receive() == big
    many = b"".join(bytes((i,)) * 1000 for i in range(40))
    pair.client.write(many)
    wire = pair.c_out.read()
    for i in range(0, len(wire), 7):  # records split anywhere
        pair.transport.data_received(wire[i : i + 7])
    assert pair.app.received.endswith(many)


def test_our_key_update_before_the_aead_limit_and_the_clients_close_notify(
    tls_server: TLSServer, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tls_records, "KEY_UPDATE_AFTER", 3)
    pair = Pair(tls_server, client_context(pki))
    pair.handshake()
    secret = pair.transport._wsecret
    for n in range(7):
        pair.transport.write(b"m%d" % n)
    assert pair.transport._wsecret != secret  # updated (twice) and the client follows
    assert pair.receive() == b"m0m1m2m3m4m5m6"
    with contextlib.suppress(ssl.SSLWantReadError):
        pair.client.unwrap()
    pair.transport.data_received(pair.c_out.read())
    assert pair.app.eof and pair.tcp.closed
    # our close_notify answered theirs
    assert pair.receive() == b"" and pair.notified


def test_tampered_record_is_refused_with_an_alert(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    pair = Pair(tls_server, client_context(pki))
    pair.handshake()
    pair.client.write(b"hello")
    record = bytearray(pair.c_out.read())
    record[-1] ^= 1
    pair.transport.data_received(bytes(record))
    assert pair.app.received == b"" and pair.tcp.closed
    with pytest.raises(ssl.SSLError, match=r"BAD_RECORD_MAC|bad record mac"):
        pair.receive()
    # the connection's end reaches the application once
    pair.transport.connection_lost(None)
    pair.transport.connection_lost(None)
    assert pair.app.lost == [None]


def test_server_close_sends_close_notify(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    pair = Pair(tls_server, client_context(pki))
    pair.handshake()
    pair.transport.write(b"bye")
    pair.transport.close()
    assert pair.tcp.closed and not pair.tcp.aborted and pair.transport.is_closing()
    pair.transport.write(b"ignored after close")
    assert pair.receive() == b"bye" and pair.notified


def test_tls12_keeps_openssl_for_the_records(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    pair = Pair(tls_server, client_context(pki, ssl.TLSVersion.TLSv1_2))
    pair.handshake(with_data=b"GET / HTTP/1.1\r\n\r\n")
    assert pair.client.version() == "TLSv1.2" and not pair.transport.lean
    assert pair.transport._ssl is not None
    assert pair.app.received == b"GET / HTTP/1.1\r\n\r\n"
    pair.transport.write(b"answer")
    assert pair.receive() == b"answer"
    pair.transport.close()
    assert pair.tcp.closed and pair.receive() == b"" and pair.notified


def test_no_hook_means_openssl_records_all_along(pki: dict[str, Path], loop: asyncio.AbstractEventLoop) -> None:
    server = TLSServer(server_context(pki), App, 5.0, loop)
    server.lean = False  # as when the SSL_CTX could not be verified
    pair = Pair(server, client_context(pki))
    pair.handshake()
    assert not pair.transport.lean and pair.transport._ssl is not None
    pair.send(b"abc")
    pair.transport.write(b"def")
    assert pair.app.received == b"abc" and pair.receive() == b"def"


def test_handshake_timeout_in_process(pki: dict[str, Path], loop: asyncio.AbstractEventLoop) -> None:
    server = TLSServer(server_context(pki), App, 0.05, loop)
    pair = Pair(server, client_context(pki))
    loop.run_until_complete(asyncio.sleep(0.2))
    assert pair.tcp.aborted and pair.app.transport is None


def test_garbage_instead_of_a_client_hello(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    pair = Pair(tls_server, client_context(pki))
    pair.transport.data_received(b"GET / HTTP/1.1\r\n\r\n")
    assert pair.tcp.closed and pair.app.transport is None


# --- end to end: migratory serve -----------------------------------------------------------


def tls_server_process(
    server_factory: Callable[..., ServerProcess], pki: dict[str, Path], **extra: str
) -> tuple[ServerProcess, int]:
    port = free_port()
    server = server_factory(
        {"ListenEncrypted": f"127.0.0.1:{port}", "TLSCertificate": str(pki["cert"]), "TLSKey": str(pki["key"]), **extra}
    )
    return server, port


def test_wss_https_and_tls12_end_to_end(server_factory: Callable[..., ServerProcess], pki: dict[str, Path]) -> None:
    server, port = tls_server_process(server_factory, pki)
    tls13 = client_context(pki)
    tls12 = client_context(pki, ssl.TLSVersion.TLSv1_2)

    async def scenario() -> None:
        async with (
            MigratoryClient([f"wss://127.0.0.1:{port}"], ssl=tls13) as new,
            MigratoryClient([f"wss://127.0.0.1:{port}"], ssl=tls12) as old,
        ):
            await new.subscribe(["/e/1"])
            await old.subscribe(["/e/1"])
            assert await old.publish("/e/1", b"x" * 40000) == Status.OK  # several records each way
            assert (await new.next_message(5)).content == b"x" * 40000
            assert (await old.next_message(5)).content == b"x" * 40000

    asyncio.run(asyncio.wait_for(scenario(), 30))
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/snapshot?subject=/e/1", context=tls13, timeout=5) as answer:
        assert answer.read() == b"x" * 40000
    server.stop()
    access = [json.loads(line) for line in (server.log_folder / "access.log").read_text().splitlines()]
    connects = [a for a in access if a["event"] == "connect"]
    assert len(connects) == 2 and all(a["protocol"] == "wss" and a["tls"] for a in connects)
    assert any(a["protocol"] == "https" for a in access if a["event"] == "http")
    assert not [a for a in access if a["event"] == "disconnect" and a["reason"] == "connection_lost"]


def test_handshake_timeout_for_a_silent_tls_client(
    server_factory: Callable[..., ServerProcess], pki: dict[str, Path]
) -> None:
    _server, port = tls_server_process(server_factory, pki, HandshakeTimeout="500")
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
        assert silent.recv(100) == b""  # closed by the server, not by our 10 s timeout
    assert time.monotonic() - started < 5
    with socket.create_connection(("127.0.0.1", port), timeout=10) as partial:
        partial.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # the start of a ClientHello
        with contextlib.suppress(ConnectionResetError):
            assert partial.recv(100) == b""
    assert time.monotonic() - started < 10


def test_sighup_reload_keeps_lean_connections(
    server_factory: Callable[..., ServerProcess], pki: dict[str, Path], tmp_path: Path
) -> None:
    # a certificate of our own, so the module's one stays as it is for the other tests
    cert, key = issue_server_cert(pki["ca"], pki["ca_key"], ["localhost", "127.0.0.1"], tmp_path / "own")
    server, port = tls_server_process(server_factory, {**pki, "cert": cert, "key": key})
    context = client_context(pki)

    before = peer_serial(port, pki["ca"])

    async def scenario() -> None:
        async with MigratoryClient([f"wss://127.0.0.1:{port}"], ssl=context) as client:
            await client.subscribe(["/t/r"])
            issue_server_cert(pki["ca"], pki["ca_key"], ["localhost", "127.0.0.1"], tmp_path / "own")
            server.proc.send_signal(signal.SIGHUP)
            await new_certificate_served(port, pki["ca"], before)
            assert await client.publish("/t/r", b"after-reload") == Status.OK
            assert (await client.next_message(5)).content == b"after-reload"

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert server.proc.poll() is None


def s_client(port: int, pki: dict[str, Path], *args: str, commands: bytes = b"") -> str:
    """``openssl s_client`` sending ``commands`` (its K/k lines: key updates), then GET /health.

    Its commands work only without ``-ign_eof``, so its input stays open until the answer
    has arrived (or 20 s have passed), then it is stopped.
    """
    proc = subprocess.Popen(
        [
            "openssl",
            "s_client",
            "-connect",
            f"127.0.0.1:{port}",
            "-CAfile",
            str(pki["ca"]),
            "-verify_return_error",
            *args,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdin is not None and proc.stdout is not None
    out = b""
    os.set_blocking(proc.stdout.fileno(), False)
    try:
        if commands:  # s_client takes a whole read as one command: the request goes once it has taken this one
            proc.stdin.write(commands)
            proc.stdin.flush()
            deadline = time.monotonic() + 20  # not a fixed sleep: a loaded machine may take longer than that
            while b"KEYUPDATE" not in out and time.monotonic() < deadline and proc.poll() is None:
                ready, _, _ = select.select([proc.stdout], [], [], 0.2)
                if ready:
                    out += proc.stdout.read() or b""
        proc.stdin.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 20
        while b'"status":"ok"' not in out and time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([proc.stdout], [], [], 0.2)
            if ready:
                out += proc.stdout.read() or b""
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    return out.decode(errors="replace")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl command not installed")
def test_every_tls13_suite_key_updates_and_minimum_version(
    server_factory: Callable[..., ServerProcess], pki: dict[str, Path]
) -> None:
    _server, port = tls_server_process(server_factory, pki, TLSMinVersion="TLSv1.3")
    for suite in SUITES:
        out = s_client(port, pki, "-ciphersuites", suite)
        assert f"Cipher is {suite}" in out and '"status":"ok"' in out, out[-2000:]
    # KeyUpdate from the client, with and without a request for ours
    for command in (b"k\n", b"K\n"):
        out = s_client(port, pki, commands=command)
        assert "KEYUPDATE" in out and '"status":"ok"' in out, out[-2000:]
    refused = subprocess.run(
        ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-tls1_2"], input=b"", capture_output=True, timeout=30
    )
    assert refused.returncode != 0 and b"alert protocol version" in refused.stdout + refused.stderr


def test_a_sweep_after_many_handshakes_gives_the_heap_back(
    tls_server: TLSServer, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a connection storm the handshakes' freed OpenSSL objects go back to the system, once per storm."""
    trims: list[int] = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1) or True)
    pairs = []
    for _ in range(tls_base.TRIM_AFTER - 1):
        pair = Pair(tls_server, client_context(pki))
        pair.handshake()
        pairs.append(pair)
    tls_server.sweep()
    assert trims == []  # a handful of reconnections costs no heap walk
    pair = Pair(tls_server, client_context(pki))
    pair.handshake()
    pairs.append(pair)
    tls_server.sweep()
    assert trims == [1]
    tls_server.sweep()
    assert trims == [1]  # nothing freed since: no second walk


def test_tls_records_ride_on_the_workers_epoll_set(pki: dict[str, Path]) -> None:
    """LeanTransport: a TLS connection sits on a RawTransport (no event-loop transport under it), both ways."""
    from migratory.server.transport import raw as rawtransport

    apps: list[App] = []

    def app() -> App:
        apps.append(App())
        return apps[-1]

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        poller = rawtransport.Poller(loop)
        server = rawtransport.RawServer(loop, sock, TLSServer(server_context(pki), app, 5.0, loop), poller, 16)
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", sock.getsockname()[1], ssl=client_context(pki), server_hostname="localhost"
            )
            writer.write(b"hello over tls")
            deadline = loop.time() + 10
            while not (apps and apps[0].received == b"hello over tls"):
                assert loop.time() < deadline, "the server's application never got the data"
                await asyncio.sleep(0.01)
            transport = apps[0].transport
            assert isinstance(transport, TLSTransport) and transport.lean
            assert isinstance(transport._tcp, rawtransport.RawTransport)
            assert transport.get_extra_info("peername")[0] == "127.0.0.1"
            transport.write(b"x" * 40_000)  # more than one record, more than one socket write may take
            assert await asyncio.wait_for(reader.readexactly(40_000), 10) == b"x" * 40_000
            transport.close()  # close_notify, then TCP
            assert await asyncio.wait_for(reader.read(), 10) == b""
            writer.close()
            deadline = loop.time() + 10
            while not apps[0].lost:
                assert loop.time() < deadline, "connection_lost never came"
                await asyncio.sleep(0.01)
            assert poller.transports == {}
        finally:
            server.close()
            poller.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
