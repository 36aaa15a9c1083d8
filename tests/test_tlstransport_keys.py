"""The lean transport's per-record work: kept keys after a sweep, and what one message's records share."""

from __future__ import annotations

from pathlib import Path

import pytest

from migratory.server.transport.tls import TLSServer, TLSTransport, expand_label
from migratory.server.transport.tls import keys as tls_keys
from migratory.server.transport.tls import records as tls_records
from tests.test_tlstransport import Pair, client_context, loop, pki, tls_server

__all__ = ["loop", "pki", "tls_server"]  # fixtures shared with test_tlstransport


def key_and_iv(transport: TLSTransport, secret: bytes) -> tuple[bytes, int]:
    """What HKDF makes of ``secret`` for this connection's suite."""
    suite = transport._suite
    assert suite is not None
    iv = expand_label(secret, b"iv", 12, suite.hash)
    return expand_label(secret, b"key", suite.key_len, suite.hash), int.from_bytes(iv, "big")


def no_hkdf(*_args: object) -> bytes:
    raise AssertionError("HKDF must not run again on wake-up")


def test_a_swept_connection_wakes_up_from_its_kept_keys(
    tls_server: TLSServer, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = Pair(tls_server, client_context(pki))
    pair.handshake(with_data=b"GET / HTTP/1.1\r\n\r\n")
    transport = pair.transport
    assert transport.lean
    assert (transport._wkey, transport._wiv) == key_and_iv(transport, transport._wsecret)
    assert (transport._rkey, transport._riv) == key_and_iv(transport, transport._rsecret)
    transport.write(b"first")
    assert pair.receive() == b"first"
    tls_server.sweep()
    tls_server.sweep()
    assert transport.write_cipher is None and transport._dec is None and tls_server.holding == 0
    monkeypatch.setattr(tls_keys, "expand_label", no_hkdf)
    for n in range(3):  # wake up, both ways, then idle again
        transport.write(b"after sweep %d" % n)
        assert pair.receive() == b"after sweep %d" % n
        pair.send(b"from the client %d" % n)
        assert pair.app.received.endswith(b"from the client %d" % n)
        assert tls_server.holding == 1
        tls_server.sweep()
        tls_server.sweep()
        assert transport.write_cipher is None and transport._dec is None


def test_key_updates_renew_the_kept_keys(
    tls_server: TLSServer, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tls_records, "KEY_UPDATE_AFTER", 3)
    pair = Pair(tls_server, client_context(pki))
    pair.handshake()
    transport = pair.transport
    first_key = transport._wkey
    for n in range(4):
        transport.write(b"m%d" % n)
        tls_server.sweep()
        tls_server.sweep()  # the next write rebuilds its cipher object from whatever key is current
    assert pair.receive() == b"m0m1m2m3"
    assert transport._wkey != first_key
    assert (transport._wkey, transport._wiv) == key_and_iv(transport, transport._wsecret)
    pair.send(b"still readable")
    assert pair.app.received.endswith(b"still readable")
    transport.connection_lost(None)
    assert transport._wkey == transport._rkey == b""


def test_one_message_is_framed_once_for_every_connection(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    pairs = [Pair(tls_server, client_context(pki)) for _ in range(3)]
    for pair in pairs:
        pair.handshake()
    frame = b"\x82\x05hello"
    for pair in pairs:
        pair.transport.write(frame)
    assert tls_server._frame is frame and tls_server._inner == frame + b"\x17"
    inner = tls_server._inner
    for pair in pairs:
        pair.transport.write(frame)
        assert tls_server._inner is inner  # shared, not made again
        assert pair.receive() == frame * 2
    # mutable buffers are sealed as they are now, and never kept
    buffer = bytearray(b"mutable")
    pairs[0].transport.write(buffer)
    buffer[:] = b"changed"
    pairs[0].transport.write(buffer)
    pairs[0].transport.write(memoryview(b"a view"))
    assert tls_server._frame is frame
    assert pairs[0].receive() == b"mutablechangeda view"
    # a record of the largest size, and one byte more (two records)
    for size in (tls_records.MAX_PLAINTEXT, tls_records.MAX_PLAINTEXT + 1):
        big = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
        pairs[1].transport.write(big)
        assert pairs[1].receive() == big
