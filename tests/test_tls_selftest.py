"""The lean record layer's start-up self-tests and supported matrix, and how it keeps its secrets.

B: before the first take-over each process runs known-answer tests of both sealers and a loopback
handshake (:func:`tls_selftest.run_selftests`), once; outside the supported matrix (another OpenSSL
major, FIPS mode, an unknown CPython layout) or when a self-test fails, lean is off for every
listener, said in one WARNING line. C: the keylog hook keeps only the two application traffic
secrets of connections the lean layer may take over, in bytearrays that are wiped (zeros) when
the connection ends, when it stays on OpenSSL, or (for a secret a KeyUpdate replaced) at the
next sweep.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from migratory.server.transport._tlsseal import Sealer
from migratory.server.transport.tls import SUITES, TLSServer, TLSTransport
from migratory.server.transport.tls import keylog as tls_keylog
from migratory.server.transport.tls import libssl as tls_libssl
from migratory.server.transport.tls import sealer as tls_sealer
from migratory.server.transport.tls import selftest as tls_selftest
from migratory.server.transport.tls import stats as tls_stats
from tests.test_tls_review import lean_pair, with_max_fragment_length_512
from tests.test_tlstransport import App, Pair, client_context, pki, server_context

__all__ = ["pki"]  # the module-scoped certificate fixture, shared with test_tlstransport

_LOGGER = "migratory.server.tls"


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a new process: no verdict cached yet (the real one comes back after the test)."""
    monkeypatch.setattr(tls_selftest, "_verdict", [])
    monkeypatch.setattr(tls_stats, "record_layer", [0])
    monkeypatch.setattr(tls_stats, "counters", dict.fromkeys(tls_stats.counters, 0))


def lean_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == _LOGGER and r.levelno == logging.WARNING and "lean record layer off" in r.getMessage()
    ]


def assert_off_for_every_connection(pki: dict[str, Path], loop: asyncio.AbstractEventLoop) -> None:
    """A lean listener made now keeps OpenSSL's record layer, without even the keylog hook."""
    context = server_context(pki)
    server = TLSServer(context, App, 5.0, loop)
    assert not server.lean and server.sealer is None
    assert id(context) not in tls_keylog._enabled
    pair = Pair(server, client_context(pki))
    pair.handshake(with_data=b"GET / HTTP/1.1\r\n\r\n")
    assert pair.client.version() == "TLSv1.3" and not pair.transport.lean and pair.transport._ssl is not None
    assert pair.app.received == b"GET / HTTP/1.1\r\n\r\n"
    pair.transport.write(b"answer")
    assert pair.receive() == b"answer"


# --- B: the self-tests --------------------------------------------------------------------------


def test_the_self_tests_pass_here_and_are_cheap(fresh: None, caplog: pytest.LogCaptureFixture) -> None:
    assert tls_selftest.outside_matrix() is None  # CPython 3.11 with OpenSSL 3.0 is the supported matrix
    started = time.perf_counter()
    assert tls_selftest.run_selftests() is None
    elapsed = time.perf_counter() - started
    assert elapsed < 0.5, f"the self-tests took {elapsed * 1000:.0f} ms"  # about 4 ms; a loaded machine is slower
    with caplog.at_level(logging.DEBUG, logger=_LOGGER):
        assert tls_selftest.lean_verdict() is None
    assert not lean_warnings(caplog)
    assert tls_selftest.selftest_seconds and tls_selftest.selftest_seconds[0] < 1.0


def test_they_run_once_per_process_before_the_first_take_over(
    fresh: None, monkeypatch: pytest.MonkeyPatch, pki: dict[str, Path], loop: asyncio.AbstractEventLoop
) -> None:
    runs: list[int] = []
    real = tls_selftest.run_selftests

    def counted() -> str | None:
        runs.append(1)
        return real()

    monkeypatch.setattr(tls_selftest, "run_selftests", counted)
    first = TLSServer(server_context(pki), App, 5.0, loop)
    second = TLSServer(server_context(pki), App, 5.0, loop)
    assert first.lean and second.lean and runs == [1]
    off = TLSServer(server_context(pki), App, 5.0, loop, lean=False)  # TLSLeanTransport = false: nothing runs
    assert not off.lean and runs == [1]


class WrongByteSealer:
    """The C sealer, but the last byte of every record it seals is wrong."""

    def __init__(self, key: bytes, iv: bytes) -> None:
        self.sealer = Sealer(key, iv)

    def seal(self, seq: int, inner: bytes, header: bytes) -> bytes:
        record = bytearray(self.sealer.seal(seq, inner, header))
        record[-1] ^= 1
        return bytes(record)

    def send(self, fd: int, seq: int, inner: bytes, header: bytes) -> bytes | None:
        return self.sealer.send(fd, seq, inner, header)


def test_a_wrong_byte_from_the_c_sealer_turns_lean_off_with_one_warning(
    fresh: None,
    monkeypatch: pytest.MonkeyPatch,
    pki: dict[str, Path],
    loop: asyncio.AbstractEventLoop,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert tls_sealer.c_sealer() is Sealer
    monkeypatch.setattr(tls_sealer, "_sealer", [WrongByteSealer])
    with caplog.at_level(logging.DEBUG, logger=_LOGGER):
        assert_off_for_every_connection(pki, loop)
        assert_off_for_every_connection(pki, loop)  # a second listener: no second line
    warnings = lean_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "self-test seal-rfc8448-c failed" in warnings[0]
    assert "every connection keeps OpenSSL's record layer" in warnings[0]
    assert [r.levelno for r in caplog.records if r.levelno >= logging.WARNING] == [logging.WARNING]
    # not one log line only (issue 52, I1): the worker's record layer and a counter say so, for /stats and /metrics
    assert tls_stats.RECORD_LAYERS[tls_stats.record_layer[0]] == "openssl: a self-test failed"
    assert tls_stats.counters["selftest_failures"] == 1
    from migratory.server.node.counters import TLS_FIELDS, tls_values

    assert tls_values()[TLS_FIELDS.index("record_layer")] == 4


class WrongByteChaCha:
    """ChaCha20-Poly1305 whose records have a wrong first byte of ciphertext."""

    def __init__(self, key: bytes) -> None:
        self.aead = ChaCha20Poly1305(key)

    def encrypt(self, nonce: bytes, data: bytes, associated_data: bytes | None) -> bytes:
        sealed = bytearray(self.aead.encrypt(nonce, data, associated_data))
        sealed[0] ^= 0x80
        return bytes(sealed)

    def decrypt(self, nonce: bytes, data: bytes, associated_data: bytes | None) -> bytes:
        return self.aead.decrypt(nonce, data, associated_data)


def test_a_wrong_byte_from_the_python_sealer_turns_lean_off_with_one_warning(
    fresh: None,
    monkeypatch: pytest.MonkeyPatch,
    pki: dict[str, Path],
    loop: asyncio.AbstractEventLoop,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(SUITES["TLS_CHACHA20_POLY1305_SHA256"], "aead", WrongByteChaCha)
    with caplog.at_level(logging.INFO, logger=_LOGGER):
        assert_off_for_every_connection(pki, loop)
    warnings = lean_warnings(caplog)
    assert len(warnings) == 1 and "self-test chacha20-poly1305-rfc8439 failed" in warnings[0]
    # and past that known answer, the transport's own ChaCha20 records are checked too
    monkeypatch.setattr(
        tls_selftest,
        "_RFC8439_SEALED",
        WrongByteChaCha(tls_selftest._RFC8439_KEY).encrypt(
            tls_selftest._RFC8439_NONCE, tls_selftest._RFC8439_PLAINTEXT, tls_selftest._RFC8439_AAD
        ),
    )
    assert tls_selftest.run_selftests() == "seal-TLS_CHACHA20_POLY1305_SHA256-python"


def test_the_self_tests_cover_the_top_of_the_sequence_space_and_the_key_update(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A nonce that is wrong only past 2^63 (a sign or width mistake) fails them; so does a key update's."""
    real = Sealer

    class HighBitWrong(WrongByteSealer):
        def seal(self, seq: int, inner: bytes, header: bytes) -> bytes:
            return self.sealer.seal(seq & ((1 << 63) - 1), inner, header)

        def send(self, fd: int, seq: int, inner: bytes, header: bytes) -> bytes | None:
            return self.sealer.send(fd, seq & ((1 << 63) - 1), inner, header)

    monkeypatch.setattr(tls_sealer, "_sealer", [HighBitWrong])
    assert tls_selftest.run_selftests() == "seal-TLS_AES_128_GCM_SHA256-c"
    monkeypatch.setattr(tls_sealer, "_sealer", [real])
    update = TLSTransport._update_write_key

    def no_new_iv(self: TLSTransport, *, requested: bool) -> bytes:
        iv = self._wiv
        record = update(self, requested=requested)
        self._wiv = iv  # the next key, with the old IV
        return record

    monkeypatch.setattr(TLSTransport, "_update_write_key", no_new_iv)
    assert tls_selftest.run_selftests() == "seal-TLS_AES_128_GCM_SHA256-python"


def test_a_failing_loopback_turns_lean_off_with_one_warning(
    fresh: None,
    monkeypatch: pytest.MonkeyPatch,
    pki: dict[str, Path],
    loop: asyncio.AbstractEventLoop,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The loopback's client sends a KeyUpdate; a record layer that does not follow it fails there."""

    def ignore_key_updates(self: TLSTransport, content: bytes, plain: list[bytes]) -> bool:
        return True

    monkeypatch.setattr(TLSTransport, "_post_handshake", ignore_key_updates)
    with caplog.at_level(logging.INFO, logger=_LOGGER):
        assert_off_for_every_connection(pki, loop)
    warnings = lean_warnings(caplog)
    assert len(warnings) == 1 and "self-test loopback (RuntimeError: KeyUpdate from the client) failed" in warnings[0]


def test_a_loopback_that_is_not_taken_over_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TLSTransport, "_take_over", lambda *_args: False)
    counted = dict(tls_stats.fallbacks)
    assert tls_selftest.run_selftests() == "loopback (RuntimeError: not taken over after the handshake)"
    assert tls_stats.fallbacks == counted  # the self-test's own connection is not counted


@pytest.mark.parametrize(
    ("version", "info", "expected"),
    [
        (
            "OpenSSL 1.1.1w  11 Sep 2023",
            (1, 1, 1, 23, 15),
            "OpenSSL 1.1.1w  11 Sep 2023 is outside the supported matrix",
        ),
        ("OpenSSL 4.0.0  1 Apr 2026", (4, 0, 0, 0, 0), "is outside the supported matrix (OpenSSL 3)"),
        ("LibreSSL 3.8.2", (3, 8, 2, 0, 0), "LibreSSL 3.8.2 is outside the supported matrix"),
    ],
)
def test_another_openssl_is_outside_the_matrix(
    fresh: None,
    monkeypatch: pytest.MonkeyPatch,
    pki: dict[str, Path],
    loop: asyncio.AbstractEventLoop,
    caplog: pytest.LogCaptureFixture,
    version: str,
    info: tuple[int, ...],
    expected: str,
) -> None:
    def not_run() -> str | None:
        raise AssertionError("no self-test outside the matrix")

    monkeypatch.setattr(tls_selftest, "run_selftests", not_run)
    monkeypatch.setattr(ssl, "OPENSSL_VERSION", version)
    monkeypatch.setattr(ssl, "OPENSSL_VERSION_INFO", info)
    with caplog.at_level(logging.INFO, logger=_LOGGER):
        server = TLSServer(server_context(pki), App, 5.0, loop)
        TLSServer(server_context(pki), App, 5.0, loop)
    assert not server.lean
    warnings = lean_warnings(caplog)
    assert len(warnings) == 1 and expected in warnings[0], warnings


def test_fips_mode_and_an_unknown_python_are_outside_the_matrix(
    fresh: None,
    monkeypatch: pytest.MonkeyPatch,
    pki: dict[str, Path],
    loop: asyncio.AbstractEventLoop,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert tls_selftest.fips_mode() is False  # asked of libcrypto: EVP_default_properties_is_fips_enabled
    monkeypatch.setattr(tls_selftest, "fips_mode", lambda: True)
    with caplog.at_level(logging.INFO, logger=_LOGGER):
        assert_off_for_every_connection(pki, loop)
    warnings = lean_warnings(caplog)
    assert len(warnings) == 1 and "is in FIPS mode" in warnings[0]
    monkeypatch.setattr(tls_selftest, "_verdict", [])
    monkeypatch.setattr(tls_selftest, "fips_mode", lambda: False)
    monkeypatch.setattr(tls_libssl, "LAYOUT_VERSIONS", ((3, 0), (3, 1)))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=_LOGGER):
        assert not TLSServer(server_context(pki), App, 5.0, loop).lean
    warnings = lean_warnings(caplog)
    assert len(warnings) == 1 and "outside the supported matrix (CPython 3.0 to 3.1)" in warnings[0]


# --- C: the secrets ------------------------------------------------------------------------------


def test_the_keylog_hook_keeps_only_the_two_traffic_secrets() -> None:
    class Target:
        _sslp: int | None = None
        _wsecret: bytes | bytearray = b""
        _rsecret: bytes | bytearray = b""

    target = Target()
    tls_keylog._Capture.target = target  # type: ignore[assignment]
    try:
        for label in (
            b"CLIENT_HANDSHAKE_TRAFFIC_SECRET",
            b"SERVER_HANDSHAKE_TRAFFIC_SECRET",
            b"EXPORTER_SECRET",
            b"CLIENT_RANDOM",
            b"SERVER_TRAFFIC_SECRET_1",
        ):
            tls_keylog._on_keylog(0x1000, memoryview(label + b" 00 " + b"ab" * 32))
        assert target._wsecret == b"" and target._rsecret == b""
        tls_keylog._on_keylog(0x1000, memoryview(b"SERVER_TRAFFIC_SECRET_0 00 " + b"cd" * 32))
        tls_keylog._on_keylog(0x1000, memoryview(b"CLIENT_TRAFFIC_SECRET_0 00 " + b"EF" * 48))
        assert type(target._wsecret) is bytearray and target._wsecret == b"\xcd" * 32
        assert type(target._rsecret) is bytearray and target._rsecret == b"\xef" * 48
        first = target._wsecret
        tls_keylog._on_keylog(0x1000, b"SERVER_TRAFFIC_SECRET_0 00 " + b"12" * 32)
        assert target._wsecret == b"\x12" * 32 and first == bytes(32)  # the one it replaces is wiped
        tls_keylog._on_keylog(0x1000, b"SERVER_TRAFFIC_SECRET_0 00 zz")  # not hex: ignored
        tls_keylog._on_keylog(0x1000, b"SERVER_TRAFFIC_SECRET_0 00 abc")
        assert target._wsecret == b"\x12" * 32
    finally:
        tls_keylog._Capture.target = None


def test_nothing_is_kept_for_tls12_or_a_listener_without_lean(
    pki: dict[str, Path], loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tls_selftest.lean_verdict() is None  # the self-tests' own handshake is not counted below
    parsed: list[int] = []
    unhex = tls_keylog._unhex

    def counting(digits: bytes | memoryview) -> bytearray | None:
        parsed.append(len(digits))
        return unhex(digits)

    monkeypatch.setattr(tls_keylog, "_unhex", counting)
    context = server_context(pki)
    lean = TLSServer(context, App, 5.0, loop)
    pair = Pair(lean, client_context(pki))
    pair.handshake()
    assert pair.transport.lean and len(parsed) == 2  # the two traffic secrets of a TLS 1.3 take-over
    parsed.clear()
    old = Pair(lean, client_context(pki, ssl.TLSVersion.TLSv1_2))
    old.handshake()
    assert not old.transport.lean and parsed == [] and old.transport._wsecret == b""
    # the same context (its hook set) behind a listener with TLSLeanTransport = false: nothing kept
    off = Pair(TLSServer(context, App, 5.0, loop, lean=False), client_context(pki))
    off.handshake()
    assert not off.transport.lean and parsed == [] and off.transport._rsecret == b""


def kept(transport: TLSTransport) -> list[bytearray]:
    buffers = [transport._wsecret, transport._rsecret, transport._wkey, transport._rkey]
    assert all(type(b) is bytearray and any(b) for b in buffers)
    return buffers  # type: ignore[return-value]


def all_zero(buffers: list[bytearray]) -> bool:
    return all(buffer and not any(buffer) for buffer in buffers)


def released(transport: TLSTransport) -> bool:
    return transport._wsecret == transport._rsecret == transport._wkey == transport._rkey == b""


def test_secrets_are_wiped_when_the_connection_ends(pki: dict[str, Path], loop: asyncio.AbstractEventLoop) -> None:
    server = TLSServer(server_context(pki), App, 5.0, loop)
    pair = Pair(server, client_context(pki))
    pair.handshake(with_data=b"hello")
    buffers = kept(pair.transport)
    pair.transport.write(b"answer")
    assert pair.receive() == b"answer"
    pair.transport.connection_lost(None)
    assert all_zero(buffers) and released(pair.transport)
    # close (close_notify), abort, and a fatal alert: wiped at once, before TCP has even gone
    for end in ("close", "abort", "alert"):
        pair = Pair(server, client_context(pki))
        pair.handshake()
        buffers = kept(pair.transport)
        if end == "close":
            pair.transport.close()
        elif end == "abort":
            pair.transport.abort()
        else:
            pair.transport.data_received(b"\x17\x03\x03\x00\x20" + bytes(32))  # does not decrypt
        assert all_zero(buffers) and released(pair.transport), end
        assert pair.transport.lean  # still said of the connection


def test_secrets_of_a_handshake_that_never_ends_are_wiped(
    pki: dict[str, Path], loop: asyncio.AbstractEventLoop
) -> None:
    """The traffic secrets come before the client's Finished: a client that stops there leaves them to wipe."""
    server = TLSServer(server_context(pki), App, 0.05, loop)
    pair = Pair(server, client_context(pki))
    with contextlib.suppress(ssl.SSLWantReadError):
        pair.client.do_handshake()
    pair.transport.data_received(pair.c_out.read())  # ClientHello: the server's flight, its secret logged
    buffers = [b for b in (pair.transport._wsecret, pair.transport._rsecret) if isinstance(b, bytearray)]
    assert buffers and buffers[0] is pair.transport._wsecret and all(any(b) for b in buffers)
    loop.run_until_complete(asyncio.sleep(0.2))  # HandshakeTimeout
    assert pair.tcp.aborted and all_zero(buffers) and released(pair.transport)


def test_secrets_of_a_connection_left_on_openssl_are_wiped_at_once(
    pki: dict[str, Path], loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = TLSServer(server_context(pki), App, 5.0, loop)
    seen: list[bytearray] = []
    refusal = TLSTransport._refusal

    def watching(self: TLSTransport, sslobj: ssl.SSLObject) -> str | None:
        seen.extend((self._wsecret, self._rsecret))  # type: ignore[arg-type]
        return refusal(self, sslobj)

    monkeypatch.setattr(TLSTransport, "_refusal", watching)
    pair = Pair(server, with_max_fragment_length_512(client_context(pki)))
    pair.handshake()
    assert not pair.transport.lean and len(seen) == 2
    assert all_zero(seen) and released(pair.transport)


def test_a_secret_replaced_by_a_key_update_is_wiped_at_the_next_sweep(
    pki: dict[str, Path], loop: asyncio.AbstractEventLoop
) -> None:
    server = TLSServer(server_context(pki), App, 5.0, loop)
    pair, records = lean_pair(server, pki)
    transport = pair.transport
    old_read, old_read_key = transport._rsecret, transport._rkey
    update = records.handshake(b"\x18\x00\x00\x01\x01")  # theirs, asking for ours
    records.next_key()
    pair.transport.data_received(update)
    assert transport._rsecret is not old_read and transport._wsecret is not old_read
    assert not any(old_read_key)  # a key is wiped as soon as it is replaced
    spent = transport._spent
    assert spent is not None and any(spent)  # one replaced secret waits for the sweep
    server.sweep()
    assert transport._spent is None and not any(spent) and not any(old_read)
    pair.transport.data_received(records.data(b"still readable"))
    assert pair.app.received == b"still readable"
