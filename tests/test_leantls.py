"""The load generators' lean TLS 1.3 client (migratory/bench/leantls.py) against OpenSSL as the server.

Differential: the same bytes must cross as with OpenSSL's own record layer on the other side, for
each TLS 1.3 suite, through the server's session tickets, and through a ``KeyUpdate`` that
``openssl s_server`` sends and asks to be answered (its ``K`` command).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import ssl
from pathlib import Path

import pytest

from migratory.bench.leantls import LeanClient, lean_context, open_lean
from migratory.certs import create_ca, issue_server_cert
from migratory.server.transport.tls import ssl_ctx_pointer, traffic_secret
from migratory.server.transport.tls.libssl import _libssl
from tests.conftest import free_port


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("leanpki")
    ca_cert, ca_key = create_ca(folder / "ca")
    cert, key = issue_server_cert(ca_cert, ca_key, ["localhost", "127.0.0.1"], folder / "srv")
    return {"ca": ca_cert, "cert": cert, "key": key}


class Sink(asyncio.Protocol):
    """The application above the lean client: what it received, and whether it was told of the end."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.made = False
        self.lost: list[Exception | None] = []
        self.more = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made = True

    def data_received(self, data: bytes) -> None:
        self.received += data
        self.more.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.append(exc)
        self.more.set()


async def until(sink: Sink, size: int, timeout: float = 20.0) -> None:
    async def wait() -> None:
        while len(sink.received) < size and not sink.lost:
            sink.more.clear()
            await sink.more.wait()

    await asyncio.wait_for(wait(), timeout)


def openssl_server(pki: dict[str, Path], suite: str) -> ssl.SSLContext:
    """An OpenSSL server context offering only ``suite`` among the TLS 1.3 suites."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki["cert"], pki["key"])
    lib = _libssl()
    pointer = ssl_ctx_pointer(context, lib) if lib is not None else None
    assert lib is not None and pointer is not None
    assert lib.SSL_CTX_set_ciphersuites(pointer, suite.encode()) == 1
    return context


async def connect(port: int, ca: Path, sink: Sink) -> LeanClient:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    return await open_lean(loop, sock, str(ca), "localhost", sink)


@pytest.mark.parametrize("suite", ["TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256"])
def test_echo_through_openssls_record_layer(pki: dict[str, Path], suite: str) -> None:
    """Random writes of 0 to 40,000 bytes (several records each) echoed by an OpenSSL server come back equal."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=openssl_server(pki, suite))
        port = server.sockets[0].getsockname()[1]
        sink = Sink()
        client = await connect(port, pki["ca"], sink)
        assert sink.made and client.get_extra_info("cipher")[0] == suite
        rng = random.Random(suite)
        sent = bytearray()
        for _ in range(30):
            chunk = rng.randbytes(rng.choice((0, 1, 100, 16383, 16384, 16385, 40000)))
            client.write(chunk)
            sent += chunk
        await until(sink, len(sent))
        assert bytes(sink.received) == bytes(sent)
        client.close()
        await asyncio.sleep(0.1)
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_key_update_asked_by_openssl_s_server(pki: dict[str, Path]) -> None:
    """``openssl s_server``'s ``K`` (a command only without ``-quiet``): a KeyUpdate asking for ours; data
    flows both ways under the new keys."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl command is needed (Debian's openssl package)")
    port = free_port()

    async def main() -> None:
        server = await asyncio.create_subprocess_exec(
            "openssl", "s_server", "-accept", f"127.0.0.1:{port}", "-cert", str(pki["cert"]),
            "-key", str(pki["key"]), "-tls1_3", "-naccept", "1",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        assert server.stdin is not None and server.stdout is not None
        try:
            sink = Sink()
            for _ in range(100):
                try:
                    client = await connect(port, pki["ca"], sink)
                    break
                except ConnectionError:
                    await asyncio.sleep(0.1)
            else:
                pytest.fail("openssl s_server never accepted")

            async def server_saw(text: bytes) -> None:
                assert server.stdout is not None
                seen = b""
                while text not in seen:
                    line = await asyncio.wait_for(server.stdout.readline(), 20)
                    assert line, f"s_server ended before {text!r}; it said {seen!r}"
                    seen += line

            client.write(b"before the update\n")
            await server_saw(b"before the update")
            assert client._read is not None and client._write is not None
            secrets = (client._read.secret, client._write.secret)
            server.stdin.write(b"K\n")  # s_server: SSL_key_update(SSL_KEY_UPDATE_REQUESTED)
            await server.stdin.drain()
            await asyncio.sleep(0.5)
            server.stdin.write(b"under the server's next key\n")
            await server.stdin.drain()
            await until(sink, len(b"under the server's next key\n"))
            assert bytes(sink.received) == b"under the server's next key\n"
            assert client._read.secret != secrets[0] and client._write.secret != secrets[1]  # both moved on
            client.write(b"under the client's next key\n")  # readable only if our answer and new key were right
            await server_saw(b"under the client's next key")
            client.close()
        finally:
            if server.returncode is None:
                server.kill()
            await server.wait()

    asyncio.run(main())


def test_a_forged_record_ends_the_connection(pki: dict[str, Path]) -> None:
    """A record whose tag does not verify closes the connection and tells the application; nothing is delivered."""

    async def quiet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(quiet, "127.0.0.1", 0, ssl=openssl_server(pki, "TLS_AES_128_GCM_SHA256"))
        sink = Sink()
        client = await connect(server.sockets[0].getsockname()[1], pki["ca"], sink)
        client.data_received(bytes((23, 3, 3, 0, 40)) + bytes(40))
        await asyncio.wait_for(sink.more.wait(), 10)
        assert sink.lost and not sink.received and client.is_closing()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_a_server_certificate_the_ca_did_not_sign_is_refused(
    pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The handshake is OpenSSL's: a certificate from another CA fails it, with the reason."""
    other = tmp_path_factory.mktemp("otherca")
    other_ca, _ = create_ca(other / "ca")

    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: None, "127.0.0.1", 0, ssl=openssl_server(pki, "TLS_AES_128_GCM_SHA256")
        )
        with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            await connect(server.sockets[0].getsockname()[1], other_ca, Sink())
        server.close()

    asyncio.run(main())
    assert lean_context(str(other_ca)).minimum_version == ssl.TLSVersion.TLSv1_3


def test_both_ends_read_the_same_two_lines_of_openssls_key_log() -> None:
    """traffic_secret, shared by the server's hook and this client's: the two application traffic secrets,
    whose side, and nothing from any other line or from digits that are not hex."""
    random_hex = "ab" * 32
    secret = bytes(range(48))
    for label, server in (("SERVER_TRAFFIC_SECRET_0", True), ("CLIENT_TRAFFIC_SECRET_0", False)):
        line = f"{label} {random_hex} {secret.hex()}".encode()
        assert traffic_secret(line) == (server, bytearray(secret))
        assert traffic_secret(memoryview(line)) == (server, bytearray(secret))
    for line in (
        f"CLIENT_HANDSHAKE_TRAFFIC_SECRET {random_hex} {secret.hex()}",
        f"EXPORTER_SECRET {random_hex} {secret.hex()}",
        f"SERVER_TRAFFIC_SECRET_0 {random_hex} {secret.hex()[:-1]}",  # odd count of digits
        f"SERVER_TRAFFIC_SECRET_0 {random_hex} {secret.hex()[:-2]}zz",
        "SERVER_TRAFFIC_SECRET_0 ",
    ):
        assert traffic_secret(line.encode()) is None, line
