"""``TLSLeanTransport``: the operator's way back to OpenSSL's record layer, through the same TLSServer."""

from __future__ import annotations

import asyncio
import signal
import socket
import ssl
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from migratory.certs import issue_server_cert
from migratory.client import MigratoryClient
from migratory.config import Config, ConfigError
from migratory.protocol import Status
from migratory.server.transport.tls import TLSServer
from migratory.server.transport.tls import keylog as tls_keylog
from tests.conftest import ServerProcess
from tests.test_tls import new_certificate_served, peer_serial
from tests.test_tlstransport import App, Pair, client_context, pki, server_context, tls_server_process

__all__ = ["pki"]  # the module-scoped certificate fixture, shared with test_tlstransport


def test_the_key_parses_like_every_boolean() -> None:
    assert Config.from_text("Listen = *:1\n", "c.conf").tls_lean_transport is True
    assert Config.from_text("Listen = *:1\nTLSLeanTransport = false\n", "c.conf").tls_lean_transport is False
    assert Config.from_text("Listen = *:1\nTLSLeanTransport = Yes\n", "c.conf").tls_lean_transport is True
    with pytest.raises(ConfigError) as info:
        Config.from_text("Listen = *:1\n\nTLSLeanTransport = sometimes\n", "c.conf")
    assert info.value.errors == ["c.conf:3: TLSLeanTransport: expected true or false, got 'sometimes'"]


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_lean_false_keeps_openssl_and_never_sets_the_hook(
    pki: dict[str, Path], loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(context: ssl.SSLContext) -> bool:
        raise AssertionError("the keylog hook must not be set with TLSLeanTransport = false")

    monkeypatch.setattr(tls_keylog, "enable", refuse)
    server = TLSServer(server_context(pki), App, 5.0, loop, lean=False)
    assert not server.lean
    pair = Pair(server, client_context(pki))
    pair.handshake(with_data=b"GET / HTTP/1.1\r\n\r\n")
    assert pair.client.version() == "TLSv1.3" and not pair.transport.lean and pair.transport._ssl is not None
    assert pair.app.received == b"GET / HTTP/1.1\r\n\r\n"
    pair.transport.write(b"answer")
    assert pair.receive() == b"answer"
    pair.transport.close()
    assert pair.tcp.closed and pair.receive() == b"" and pair.notified


def test_wss_with_tls_lean_transport_false_end_to_end(
    server_factory: Callable[..., ServerProcess], pki: dict[str, Path], tmp_path: Path
) -> None:
    """wss://, TLSMinVersion and certificate reload on SIGHUP, all on OpenSSL's record layer."""
    cert, key = issue_server_cert(pki["ca"], pki["ca_key"], ["localhost", "127.0.0.1"], tmp_path / "own")
    server, port = tls_server_process(
        server_factory,
        {**pki, "cert": cert, "key": key},
        TLSLeanTransport="false",
        TLSMinVersion="TLSv1.3",
    )
    context = client_context(pki)

    old = client_context(pki, ssl.TLSVersion.TLSv1_2)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, pytest.raises(ssl.SSLError):
        old.wrap_socket(raw, server_hostname="127.0.0.1")
    before = peer_serial(port, pki["ca"])

    async def scenario() -> None:
        async with (
            MigratoryClient([f"wss://127.0.0.1:{port}"], ssl=context) as one,
            MigratoryClient([f"wss://127.0.0.1:{port}"], ssl=context) as two,
        ):
            await one.subscribe(["/lean/off"])
            assert await two.publish("/lean/off", b"y" * 40000) == Status.OK  # several records
            assert (await one.next_message(5)).content == b"y" * 40000
            issue_server_cert(pki["ca"], pki["ca_key"], ["localhost", "127.0.0.1"], tmp_path / "own")
            server.proc.send_signal(signal.SIGHUP)
            await new_certificate_served(port, pki["ca"], before)
            assert await two.publish("/lean/off", b"after-reload") == Status.OK
            assert (await one.next_message(5)).content == b"after-reload"

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert server.proc.poll() is None
