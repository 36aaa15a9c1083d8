"""The lean TLS record layer after its security review: what it refuses to take over, and the records it reads.

D1: a connection is taken over only when what OpenSSL negotiated is what the lean record
layer implements (a client that negotiated max_fragment_length stays on OpenSSL's records,
counted and logged). D2: the records after a ``user_canceled`` alert are read, up to five such
alerts in a row. D3: a ``KeyUpdate`` may be split over records; other post-handshake messages
get ``unexpected_message``. D4: a malformed alert gets a fatal ``decode_error``.

The in-process tests drive a :class:`TLSTransport` with a real OpenSSL client (``Pair`` of
test_tlstransport); client records the ``ssl`` module cannot make (alerts, split handshake
messages) are sealed here with the client's key, and the server's answers are read by the real
client, whose error names the alert it got.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import shutil
import ssl
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from migratory.server.transport.tls import TLSServer, TLSTransport
from migratory.server.transport.tls import keylog as tls_keylog
from migratory.server.transport.tls import keyupdate as tls_keyupdate
from migratory.server.transport.tls import libssl as tls_libssl
from migratory.server.transport.tls import stats as tls_stats
from tests.conftest import ServerProcess
from tests.test_tlstransport import App, Pair, client_context, loop, pki, server_context, tls_server, tls_server_process

__all__ = ["loop", "pki", "tls_server"]  # fixtures shared with test_tlstransport

_TLSEXT_MAX_FRAGMENT_LENGTH_512 = 1
_LOGGER = "migratory.server.tls"

DECODE_ERROR = r"DECODE_ERROR|decode error"
UNEXPECTED_MESSAGE = r"UNEXPECTED_MESSAGE|unexpected message"
ILLEGAL_PARAMETER = r"ILLEGAL_PARAMETER|illegal parameter"


class ClientRecords:
    """Records as the pair's client would seal them next, from the client's traffic secret (which the server holds)."""

    def __init__(self, transport: TLSTransport) -> None:
        assert transport.lean and transport._suite is not None
        self.suite = transport._suite
        self.secret = transport._rsecret
        self.seq = transport._rseq
        self.key, self.iv = self.suite.keys(self.secret)

    def record(self, content: bytes, content_type: int) -> bytes:
        inner = content + bytes((content_type,))
        header = bytes((23, 3, 3)) + (len(inner) + 16).to_bytes(2, "big")
        nonce = (self.iv ^ self.seq).to_bytes(12, "big")
        self.seq += 1
        return header + self.suite.aead(self.key).encrypt(nonce, inner, header)

    def data(self, content: bytes) -> bytes:
        return self.record(content, 23)

    def alert(self, content: bytes) -> bytes:
        return self.record(content, 21)

    def handshake(self, content: bytes) -> bytes:
        return self.record(content, 22)

    def next_key(self) -> None:
        """The client's key after its KeyUpdate (RFC 8446 7.2), from sequence number 0."""
        self.secret = self.suite.next_secret(self.secret)
        self.key, self.iv = self.suite.keys(self.secret)
        self.seq = 0


def lean_pair(server: TLSServer, pki: dict[str, Path]) -> tuple[Pair, ClientRecords]:
    pair = Pair(server, client_context(pki))
    pair.handshake()
    assert pair.transport.lean
    return pair, ClientRecords(pair.transport)


def assert_fatal_alert(pair: Pair, alert: str) -> None:
    """The server sent ``alert`` (the real client names it) and closed TCP."""
    assert pair.tcp.closed and not pair.tcp.aborted
    with pytest.raises(ssl.SSLError, match=alert):
        pair.receive()


def with_max_fragment_length_512(context: ssl.SSLContext) -> ssl.SSLContext:
    """``context`` asking for max_fragment_length 512 (RFC 6066), as ``openssl s_client -maxfraglen 512`` does."""
    lib = tls_libssl._libssl()
    assert lib is not None
    pointer = tls_libssl.ssl_ctx_pointer(context, lib)
    assert pointer is not None
    lib.SSL_CTX_set_tlsext_max_fragment_length.restype = ctypes.c_int
    lib.SSL_CTX_set_tlsext_max_fragment_length.argtypes = [ctypes.c_void_p, ctypes.c_uint8]
    assert lib.SSL_CTX_set_tlsext_max_fragment_length(pointer, _TLSEXT_MAX_FRAGMENT_LENGTH_512) == 1
    return context


# --- D1: fail closed on what OpenSSL negotiated ---------------------------------------------


def test_a_client_with_max_fragment_length_keeps_openssls_records(
    pki: dict[str, Path], loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    server = TLSServer(server_context(pki), App, 5.0, loop)
    assert server.lean
    pair = Pair(server, with_max_fragment_length_512(client_context(pki)))
    with caplog.at_level(logging.INFO, logger=_LOGGER):
        pair.handshake(with_data=b"GET / HTTP/1.1\r\n\r\n")
    assert pair.client.version() == "TLSv1.3" and pair.app.received == b"GET / HTTP/1.1\r\n\r\n"
    # the client enforces 512-byte records: one lean record of 5,120 bytes would end in record_overflow
    big = bytes(range(256)) * 20
    pair.transport.write(big)
    assert pair.receive() == big
    assert not pair.transport.lean and pair.transport._ssl is not None
    pair.send(b"more")
    assert pair.app.received.endswith(b"more")
    assert any(r.name == _LOGGER and "negotiated max_fragment_length" in r.getMessage() for r in caplog.records), (
        caplog.text
    )


def test_fallbacks_are_counted_by_reason(pki: dict[str, Path], loop: asyncio.AbstractEventLoop) -> None:
    server = TLSServer(server_context(pki), App, 5.0, loop)
    before = dict(tls_stats.fallbacks)
    pair = Pair(server, with_max_fragment_length_512(client_context(pki)))
    pair.handshake()
    assert not pair.transport.lean
    assert tls_stats.fallbacks["max_fragment_length"] == before.get("max_fragment_length", 0) + 1
    # a client without the extension: taken over, nothing counted
    counted = dict(tls_stats.fallbacks)
    plain = Pair(server, client_context(pki))
    plain.handshake()
    assert plain.transport.lean and tls_stats.fallbacks == counted
    # TLS 1.2 under its own reason
    old = Pair(server, client_context(pki, ssl.TLSVersion.TLSv1_2))
    old.handshake()
    assert not old.transport.lean and tls_stats.fallbacks["not_tls13"] == counted.get("not_tls13", 0) + 1
    assert set(tls_stats.fallbacks) <= set(tls_stats.FALLBACK_REASONS)
    # a listener with TLSLeanTransport = false counts nothing: all its connections stay with OpenSSL by design
    counted = dict(tls_stats.fallbacks)
    off = Pair(TLSServer(server_context(pki), App, 5.0, loop, lean=False), client_context(pki))
    off.handshake()
    assert not off.transport.lean and tls_stats.fallbacks == counted


@pytest.mark.parametrize(
    ("function", "value", "reason"),
    [
        ("SSL_get_early_data_status", 1, "early_data"),  # SSL_EARLY_DATA_REJECTED
        ("SSL_get_early_data_status", 2, "early_data"),  # SSL_EARLY_DATA_ACCEPTED
        ("SSL_has_pending", 1, "buffered"),
        ("SSL_version", 0x0303, "unverified"),
        ("SSL_is_server", 0, "unverified"),
        ("SSL_get_session", None, "unverified"),
    ],
)
def test_every_state_lean_does_not_implement_stays_with_openssl(
    pki: dict[str, Path],
    loop: asyncio.AbstractEventLoop,
    monkeypatch: pytest.MonkeyPatch,
    function: str,
    value: int | None,
    reason: str,
) -> None:
    """What libssl reports (early data, unread records, a pointer that is not this TLS 1.3 server's) decides."""
    lib = tls_libssl.negotiated_state_lib()
    assert lib is not None
    server = TLSServer(server_context(pki), App, 5.0, loop)
    before = tls_stats.fallbacks.get(reason, 0)
    monkeypatch.setattr(lib, function, lambda *_args: value)
    pair = Pair(server, client_context(pki))
    pair.handshake()
    assert not pair.transport.lean and pair.transport._ssl is not None
    assert tls_stats.fallbacks[reason] == before + 1
    pair.send(b"through OpenSSL")
    pair.transport.write(b"answer")
    assert pair.app.received == b"through OpenSSL" and pair.receive() == b"answer"


def test_no_ssl_pointer_means_no_take_over(
    pki: dict[str, Path], loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = TLSServer(server_context(pki), App, 5.0, loop)
    before = tls_stats.fallbacks.get("unverified", 0)
    refusal = TLSTransport._refusal

    def without_pointer(self: TLSTransport, sslobj: ssl.SSLObject) -> str | None:
        assert self._sslp  # the keylog callback named the SSL object
        self._sslp = 0  # as _on_keylog leaves it when two different pointers came
        return refusal(self, sslobj)

    monkeypatch.setattr(TLSTransport, "_refusal", without_pointer)
    pair = Pair(server, client_context(pki))
    pair.handshake()
    assert not pair.transport.lean and tls_stats.fallbacks["unverified"] == before + 1
    assert pair.transport._sslp is None  # not kept past the handshake


def test_the_pointer_the_keylog_callback_reports_is_checked() -> None:
    class Target:
        _sslp: int | None = None
        _wsecret = b""
        _rsecret = b""

    target = Target()
    tls_keylog._Capture.target = target  # type: ignore[assignment]
    try:
        tls_keylog._on_keylog(0x1000, b"SERVER_HANDSHAKE_TRAFFIC_SECRET 00 11")
        tls_keylog._on_keylog(0x1000, b"SERVER_TRAFFIC_SECRET_0 00 22")
        assert target._sslp == 0x1000 and target._wsecret == b"\x22"
        tls_keylog._on_keylog(0x2000, b"CLIENT_TRAFFIC_SECRET_0 00 33")
        assert target._sslp == 0  # two SSL objects in one handshake: neither is trusted
        tls_keylog._on_keylog(0x1000, b"EXPORTER_SECRET 00 44")
        assert target._sslp == 0
    finally:
        tls_keylog._Capture.target = None


def test_no_way_to_read_the_negotiated_state_means_no_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tls_libssl, "negotiated_state_lib", lambda: None)
    assert not tls_keylog.enable(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))


def test_fallbacks_are_logged_at_info_on_powers_of_two(
    pki: dict[str, Path], loop: asyncio.AbstractEventLoop, caplog: pytest.LogCaptureFixture
) -> None:
    transport = TLSTransport(TLSServer(server_context(pki), App, 5.0, loop), App())
    tls_stats.fallbacks.pop("test-reason", None)
    with caplog.at_level(logging.DEBUG, logger=_LOGGER):
        for _ in range(9):
            transport._fell_back("test-reason")
    levels = [r.levelno for r in caplog.records if r.name == _LOGGER and "test-reason" in r.getMessage()]
    assert tls_stats.fallbacks.pop("test-reason") == 9
    assert [i + 1 for i, level in enumerate(levels) if level == logging.INFO] == [1, 2, 4, 8]
    assert levels.count(logging.DEBUG) == 5


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl command not installed")
def test_openssl_s_client_with_maxfraglen_512_end_to_end(
    server_factory: Callable[..., ServerProcess], pki: dict[str, Path]
) -> None:
    """``openssl s_client -tls1_3 -maxfraglen 512`` reads an answer of 5,000 bytes: no record_overflow."""
    server, port = tls_server_process(server_factory, pki)
    body = b"".join(b"%04d|" % i for i in range(1000))
    publish = urllib.request.Request(f"{server.http_url}/publish?subject=/review/mfl", data=body, method="POST")
    with urllib.request.urlopen(publish, timeout=10) as answer:
        assert answer.status == 200
    request = b"GET /snapshot?subject=/review/mfl HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    command = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-CAfile", str(pki["ca"])]
    command += ["-verify_return_error", "-tls1_3", "-maxfraglen", "512", "-ign_eof"]
    done = subprocess.run(command, input=request, capture_output=True, timeout=30)
    out = done.stdout + done.stderr
    # what s_client says of a record over the negotiated length (it sends record_overflow)
    assert b"data length too long" not in out and b"record overflow" not in out.lower(), out[-3000:]
    assert b"HTTP/1.1 200" in out and body in out, out[-3000:]
    server.stop()
    # the server says why (the client asked for 512-byte fragments: the log line is the proof it was negotiated)
    log = (server.log_folder / "server.log").read_text()
    assert "keeps OpenSSL's record layer: the client negotiated max_fragment_length" in log


# --- D2: warning alerts ------------------------------------------------------------------------


def test_records_after_a_user_canceled_alert_in_the_same_read_are_read(
    tls_server: TLSServer, pki: dict[str, Path]
) -> None:
    pair, records = lean_pair(tls_server, pki)
    wire = (
        records.data(b"GET /1 HTTP/1.1\r\n\r\n")
        + records.alert(b"\x01\x5a")  # warning user_canceled
        + records.data(b"GET /2 HTTP/1.1\r\n\r\n")
    )
    third = records.data(b"GET /3 HTTP/1.1\r\n\r\n")
    pair.transport.data_received(wire + third[:9])  # the next record begins in the same read
    assert pair.app.received == b"GET /1 HTTP/1.1\r\n\r\nGET /2 HTTP/1.1\r\n\r\n"
    pair.transport.data_received(third[9:])
    pair.transport.data_received(records.data(b"GET /4 HTTP/1.1\r\n\r\n"))
    assert pair.app.received == b"".join(b"GET /%d HTTP/1.1\r\n\r\n" % n for n in (1, 2, 3, 4))
    assert not pair.tcp.closed and pair.transport.lean
    pair.transport.write(b"still here")
    assert pair.receive() == b"still here"


def test_five_user_canceled_alerts_in_a_row_are_fatal(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    pair, records = lean_pair(tls_server, pki)
    canceled = b"\x01\x5a"
    # four, then data (which starts the count again), then four more with empty records between
    pair.transport.data_received(b"".join(records.alert(canceled) for _ in range(4)) + records.data(b"a"))
    pair.transport.data_received(b"".join(records.alert(canceled) + records.data(b"") for _ in range(4)))
    assert pair.app.received == b"a" and not pair.tcp.closed
    # a fifth in a row (empty records do not count as a break, as in OpenSSL)
    pair.transport.data_received(records.alert(canceled) + records.data(b"never delivered"))
    assert pair.app.received == b"a"
    assert_fatal_alert(pair, UNEXPECTED_MESSAGE)


# --- D3: post-handshake handshake messages ------------------------------------------------


def test_a_key_update_split_over_records(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    pair, records = lean_pair(tls_server, pki)
    transport = pair.transport
    old_secret = transport._rsecret
    # KeyUpdate(update_not_requested) in three records, two reads
    wire = records.data(b"before ")
    wire += records.handshake(b"\x18")
    wire += records.handshake(b"\x00\x00")
    pair.transport.data_received(wire)
    last = records.handshake(b"\x01\x00")
    records.next_key()
    pair.transport.data_received(last + records.data(b"after"))
    assert pair.app.received == b"before after" and not pair.tcp.closed
    assert transport._rsecret == records.secret == transport._suite.next_secret(old_secret)  # type: ignore[union-attr]
    # KeyUpdate(update_requested) in two records: the answer is ours, which the real client follows
    wsecret = transport._wsecret
    pair.transport.data_received(records.handshake(b"\x18\x00\x00\x01"))
    last = records.handshake(b"\x01")
    records.next_key()
    pair.transport.data_received(last + records.data(b" again"))
    assert pair.app.received == b"before after again" and transport._wsecret != wsecret
    transport.write(b"under our next key")
    assert pair.receive() == b"under our next key"


@pytest.mark.parametrize(
    ("fragments", "alert"),
    [
        pytest.param([b"\x04\x00\x00\x04\x00\x00\x00\x00"], UNEXPECTED_MESSAGE, id="new-session-ticket"),
        pytest.param([b"\x04"], UNEXPECTED_MESSAGE, id="first-byte-of-a-new-session-ticket"),
        pytest.param([b"\x0b\x00"], UNEXPECTED_MESSAGE, id="certificate-not-asked-for"),
        pytest.param([b"\x18\x00\x00\x01\x00\x18\x00\x00\x01\x00"], UNEXPECTED_MESSAGE, id="two-key-updates"),
        pytest.param([b"\x18\x00\x00\x01\x00\x04"], UNEXPECTED_MESSAGE, id="bytes-after-a-key-update"),
        pytest.param([b""], UNEXPECTED_MESSAGE, id="empty-handshake-record"),
        pytest.param([b"\x18\x00", "data"], UNEXPECTED_MESSAGE, id="data-inside-a-key-update"),
        pytest.param([b"\x18\x00\x00", "alert"], UNEXPECTED_MESSAGE, id="alert-inside-a-key-update"),
        pytest.param([b"\x18\x00\x00\x02\x00\x00"], DECODE_ERROR, id="key-update-of-2-bytes"),
        pytest.param([b"\x18\x00", b"\x00\x00"], DECODE_ERROR, id="split-key-update-of-0-bytes"),
        pytest.param([b"\x18\x00\x00\x01\x02"], ILLEGAL_PARAMETER, id="key-update-request-2"),
    ],
)
def test_post_handshake_messages_get_the_right_alert(
    tls_server: TLSServer, pki: dict[str, Path], fragments: list[bytes | str], alert: str
) -> None:
    pair, records = lean_pair(tls_server, pki)
    wire = records.data(b"kept")
    for fragment in fragments:
        if fragment == "data":
            wire += records.data(b"interleaved")
        elif fragment == "alert":
            wire += records.alert(b"\x01\x5a")
        else:
            assert isinstance(fragment, bytes)
            wire += records.handshake(fragment)
    pair.transport.data_received(wire)
    assert pair.app.received == b"kept"
    assert_fatal_alert(pair, alert)


# --- D4: malformed alerts -------------------------------------------------------------------


@pytest.mark.parametrize("body", [b"\x01", b"\x01\x00\x00", b"\x02\x28\x00\x00"], ids=["1", "3", "4"])
def test_a_malformed_alert_gets_a_fatal_decode_error(tls_server: TLSServer, pki: dict[str, Path], body: bytes) -> None:
    pair, records = lean_pair(tls_server, pki)
    pair.transport.data_received(records.data(b"kept") + records.alert(body) + records.data(b"dropped"))
    assert pair.app.received == b"kept"
    assert_fatal_alert(pair, DECODE_ERROR)


def test_an_empty_alert_record_gets_unexpected_message(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    """N1 (issue 52): RFC 8446 5.4 forbids empty alert records; OpenSSL answers unexpected_message (tlsfuzzer
    test_tls13_empty_alert), as it does for an empty handshake record."""
    pair, records = lean_pair(tls_server, pki)
    pair.transport.data_received(records.data(b"kept") + records.alert(b"") + records.data(b"dropped"))
    assert pair.app.received == b"kept"
    assert_fatal_alert(pair, UNEXPECTED_MESSAGE)


@pytest.mark.parametrize("reads", ["one-read", "one-read-each", "two-reads"])
def test_every_key_update_request_gets_its_answer_however_the_reads_fall(
    tls_server: TLSServer, pki: dict[str, Path], reads: str
) -> None:
    """N2 (issue 52): 32 KeyUpdate(update_requested) get 32 answers (OpenSSL's count), whether they come in one
    read, one per read or split across two; each answer moves our write key one step, and the real client
    follows every step (it reads what we write after them)."""
    pair, records = lean_pair(tls_server, pki)
    transport = pair.transport
    assert transport._suite is not None
    secret = bytes(transport._wsecret)  # a copy: the transport wipes its spent secrets in place
    wires = []
    for _ in range(32):
        wires.append(records.handshake(b"\x18\x00\x00\x01\x01"))
        records.next_key()
    if reads == "one-read":
        transport.data_received(b"".join(wires))
    elif reads == "one-read-each":
        for wire in wires:
            transport.data_received(wire)
    else:
        joined = b"".join(wires)
        transport.data_received(joined[:777])
        transport.data_received(joined[777:])
    steps = 0
    while transport._wsecret != secret and steps < 100:
        secret = transport._suite.next_secret(secret)
        steps += 1
    assert steps == 32  # 32 answers, not one and not 33
    transport.write(b"after 32 answers")
    assert pair.receive() == b"after 32 answers"
    assert not pair.tcp.closed


def test_a_bounded_number_of_key_update_answers_waits_while_tcp_takes_nothing(
    tls_server: TLSServer, pki: dict[str, Path]
) -> None:
    """The bound on N2's rule: while TCP is paused, more than MAX_OWED_KEY_UPDATES requests share answers."""
    pair, records = lean_pair(tls_server, pki)
    transport = pair.transport
    transport.pause_writing()
    for _ in range(tls_keyupdate.MAX_OWED_KEY_UPDATES * 3):
        transport.data_received(records.handshake(b"\x18\x00\x00\x01\x01"))
        records.next_key()
    assert transport._owed == tls_keyupdate.MAX_OWED_KEY_UPDATES


def test_a_record_of_an_unknown_type_is_refused_at_its_header(tls_server: TLSServer, pki: dict[str, Path]) -> None:
    """N3 (issue 52): a header announcing a record of content type 0x99 gets unexpected_message at once, as
    OpenSSL does, not once the 16 KB it announces have come."""
    pair, _ = lean_pair(tls_server, pki)
    pair.transport.data_received(bytes((0x99, 3, 3)) + (16000).to_bytes(2, "big"))
    assert_fatal_alert(pair, UNEXPECTED_MESSAGE)
