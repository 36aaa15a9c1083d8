"""The C record sealer (migratory/server/transport/_tlsseal.c): the records of ``cryptography``, and its write.

CI builds it (``pip install -e .`` with a C compiler); a missing build fails here rather than
leaving every wss:// delivery on the slower Python seal unnoticed.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from migratory.server.transport import raw as rawtransport
from migratory.server.transport._tlsseal import Sealer
from migratory.server.transport.tls import TLSServer, TLSTransport, c_sealer
from tests.test_tlstransport import App, client_context, pki, server_context

__all__ = ["pki"]  # the module-scoped fixture, shared with test_tlstransport.py


def header_of(inner: bytes) -> bytes:
    return bytes((23, 3, 3)) + (len(inner) + 16).to_bytes(2, "big")


def python_record(key: bytes, iv: bytes, seq: int, inner: bytes) -> bytes:
    header = header_of(inner)
    nonce = (int.from_bytes(iv, "big") ^ seq).to_bytes(12, "big")
    return header + AESGCM(key).encrypt(nonce, inner, header)


def test_the_extension_is_built_and_bound_to_libcrypto() -> None:
    assert c_sealer() is Sealer


@pytest.mark.parametrize("key_len", [16, 32])
def test_records_match_cryptography(key_len: int) -> None:
    key, iv = os.urandom(key_len), os.urandom(12)
    assert c_sealer() is Sealer
    sealer = Sealer(key, iv)
    for seq in (0, 1, 2, 255, 256, (1 << 24) - 1, 1 << 40, (1 << 64) - 1):
        for size in (1, 2, 17, 80, 1500, 16385):
            inner = os.urandom(size - 1) + b"\x17"
            assert sealer.seal(seq, inner, header_of(inner)) == python_record(key, iv, seq, inner), (seq, size)


def test_bad_arguments_are_refused_cleanly() -> None:
    assert c_sealer() is Sealer
    sealer = Sealer(os.urandom(16), os.urandom(12))
    inner = b"x\x17"
    with pytest.raises(ValueError, match="16 or 32"):
        Sealer(os.urandom(24), os.urandom(12))
    with pytest.raises(ValueError, match="16 or 32"):
        Sealer(os.urandom(16), os.urandom(8))
    with pytest.raises(ValueError, match="2\\^14"):
        sealer.seal(0, b"x" * (16385 + 1), header_of(b"x"))
    with pytest.raises(ValueError, match="2\\^14"):
        sealer.seal(0, b"", header_of(b""))
    with pytest.raises(TypeError):
        sealer.seal(0, bytearray(inner), header_of(inner))  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        sealer.seal(-1, inner, header_of(inner))
    with pytest.raises(ValueError, match="file descriptor"):
        sealer.send(-1, 0, inner, header_of(inner))
    with pytest.raises(TypeError):
        sealer.send(0, 0, inner)  # type: ignore[call-arg]


def test_send_writes_the_record_keeps_what_the_socket_refused_and_raises_on_a_dead_socket() -> None:
    assert c_sealer() is Sealer
    key, iv = os.urandom(16), os.urandom(12)
    sealer = Sealer(key, iv)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        inner = b"y" * 999 + b"\x17"
        assert sealer.send(ours.fileno(), 7, inner, header_of(inner)) is None
        assert theirs.recv(65536) == python_record(key, iv, 7, inner)
        # fill the socket, then a record comes back whole (EAGAIN) or in part: never lost
        sent = bytearray()
        seq = 100
        while True:
            record = python_record(key, iv, seq, inner)
            rest = sealer.send(ours.fileno(), seq, inner, header_of(inner))
            if rest is not None:
                assert record.endswith(rest) and len(rest) > 0
                sent += record[: len(record) - len(rest)]
                break
            sent += record
            seq += 1
        received = bytearray()
        theirs.setblocking(False)
        while len(received) < len(sent):
            received += theirs.recv(1 << 20)
        assert received == sent
        theirs.close()
        with pytest.raises(OSError):  # EPIPE (Python ignores SIGPIPE) or ECONNRESET
            for n in range(10):
                sealer.send(ours.fileno(), seq + 1 + n, inner, header_of(inner))


def test_a_reader_that_stops_reading_gets_every_record_in_order(pki: dict[str, Path]) -> None:
    """Fan-out records written by the C call on a RawTransport: paused, queued, then all delivered in order."""
    apps: list[App] = []
    paused: list[bool] = []

    class Pausing(App):
        def pause_writing(self) -> None:
            paused.append(True)

        def resume_writing(self) -> None:
            paused.append(False)

    def app() -> App:
        apps.append(Pausing())
        return apps[-1]

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # accepted sockets inherit it
        sock.bind(("127.0.0.1", 0))
        poller = rawtransport.Poller(loop)
        tls = TLSServer(server_context(pki), app, 5.0, loop)
        assert tls.sealer is Sealer
        server = rawtransport.RawServer(loop, sock, tls, poller, 16)
        try:
            context: ssl.SSLContext = client_context(pki)
            client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
            client.setblocking(False)
            await loop.sock_connect(client, sock.getsockname())
            reader, writer = await asyncio.open_connection(
                sock=client, ssl=context, server_hostname="localhost", limit=1 << 22
            )
            writer.write(b"hi")
            deadline = loop.time() + 10
            while not (apps and apps[0].received == b"hi"):
                assert loop.time() < deadline, "the server's application never got the data"
                await asyncio.sleep(0.01)
            transport = apps[0].transport
            assert isinstance(transport, TLSTransport) and isinstance(transport._tcp, rawtransport.RawTransport)
            assert transport._c
            writer.transport.pause_reading()  # the client stops reading: the socket fills up
            messages = [b"message %06d " % n + b"z" * 200 for n in range(4000)]
            for message in messages:  # ~850 KB: past the kernel's buffers and the high-water mark
                transport.write(message)
            assert paused and paused[0] is True
            assert transport._tcp._buffer is not None  # the rest waits in RawTransport
            writer.transport.resume_reading()
            expected = b"".join(messages)
            assert await asyncio.wait_for(reader.readexactly(len(expected)), 30) == expected
            assert paused[-1] is False  # drained: writing resumed
            writer.close()
        finally:
            server.close()
            poller.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_seal_probe_measures_both_sealers() -> None:
    """``python -m migratory.bench.tlsprobe --seal`` (bench/tls.md, section (g)) reports Python and C."""
    from migratory.bench.tlsprobe import seal_report

    report = seal_report(connections=20, rounds=1, passes=2)
    assert set(report) == {"python us per record", "c us per record"}
    assert all(value > 0 for value in report.values())
