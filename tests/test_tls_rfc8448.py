"""Known answers for the lean TLS record layer (migratory/server/transport/tls.py), without OpenSSL.

The vectors are RFC 8448 ("Example Handshake Traces for TLS 1.3"), section 3 "Simple 1-RTT
Handshake" (TLS_AES_128_GCM_SHA256): the two application traffic secrets, the write keys and
IVs derived from them, the server's NewSessionTicket record (its sequence number 0), the
application data records each side sends (50 bytes 00 01 ... 31; client sequence number 0,
server 1) and the close_notify alerts (client 1, server 2). A regression in HKDF-Expand-Label,
the nonce (IV xor sequence number), the inner content type or the record header shows here
byte for byte, whatever OpenSSL does. The secrets after one KeyUpdate are not in RFC 8448;
those below are Botan's (src/tests/test_tls_cipher_state.cpp), an independent implementation.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from migratory.server.transport.tls import SUITES, TLSServer, TLSTransport, expand_label
from migratory.server.transport.tls import base as tls_base
from migratory.server.transport.tls import keylog as tls_keylog
from migratory.server.transport.tls import libssl as tls_libssl
from tests.test_tlstransport import FakeTCP as TCP

SUITE = SUITES["TLS_AES_128_GCM_SHA256"]


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", "").replace("\n", ""))


CLIENT_SECRET = h("9e 40 64 6c e7 9a 7f 9d c0 5a f8 88 9b ce 65 52 87 5a fa 0b 06 df 00 87 f7 92 eb b7 c1 75 04 a5")
SERVER_SECRET = h("a1 1a f9 f0 55 31 f8 56 ad 47 11 6b 45 a9 50 32 82 04 b4 f4 4b fb 6b 3a 4b 4f 1f 3f cb 63 16 43")
SERVER_KEY = h("9f 02 28 3b 6c 9c 07 ef c2 6b b9 f2 ac 92 e3 56")
SERVER_IV = h("cf 78 2b 88 dd 83 54 9a ad f1 e9 84")
CLIENT_KEY = h("17 42 2d da 59 6e d5 d9 ac d8 90 e3 c6 3f 50 51")
CLIENT_IV = h("5b 78 92 3d ee 08 57 90 33 e5 23 d9")

# {server} send handshake record (NewSessionTicket), under the server application key, sequence number 0
NEW_SESSION_TICKET_RECORD = h(
    """17 03 03 00 de 3a 6b 8f 90 41 4a 97 d6 95 9c 34 87 68 0d e5 13 4a 2b 24 0e 6c ff ac 11 6e 95 d4 1d
    6a f8 f6 b5 80 dc f3 d1 1d 63 c7 58 db 28 9a 01 59 40 25 2f 55 71 3e 06 1d c1 3e 07 88 91 a3 8e fb
    cf 57 53 ad 8e f1 70 ad 3c 73 53 d1 6d 9d a7 73 b9 ca 7f 2b 9f a1 b6 c0 d4 a3 d0 3f 75 e0 9c 30 ba
    1e 62 97 2a c4 6f 75 f7 b9 81 be 63 43 9b 29 99 ce 13 06 46 15 13 98 91 d5 e4 c5 b4 06 f1 6e 3f c1
    81 a7 7c a4 75 84 00 25 db 2f 0a 77 f8 1b 5a b0 5b 94 c0 13 46 75 5f 69 23 2c 86 51 9d 86 cb ee ac
    87 aa c3 47 d1 43 f9 60 5d 64 f6 50 db 4d 02 3e 70 e9 52 ca 49 fe 51 37 12 1c 74 bc 26 97 68 7e 24
    87 46 d6 df 35 30 05 f3 bc e1 86 96 12 9c 81 53 55 6b 3b 6c 67 79 b3 7b f1 59 85 68 4f"""
)
APP_DATA = bytes(range(50))
CLIENT_APP_RECORD = h(
    """17 03 03 00 43 a2 3f 70 54 b6 2c 94 d0 af fa fe 82 28 ba 55 cb ef ac ea 42 f9 14 aa 66 bc ab 3f 2b
    98 19 a8 a5 b4 6b 39 5b d5 4a 9a 20 44 1e 2b 62 97 4e 1f 5a 62 92 a2 97 70 14 bd 1e 3d ea e6 3a ee
    bb 21 69 49 15 e4"""
)
SERVER_APP_RECORD = h(
    """17 03 03 00 43 2e 93 7e 11 ef 4a c7 40 e5 38 ad 36 00 5f c4 a4 69 32 fc 32 25 d0 5f 82 aa 1b 36 e3
    0e fa f9 7d 90 e6 df fc 60 2d cb 50 1a 59 a8 fc c4 9c 4b f2 e5 f0 a2 1c 00 47 c2 ab f3 32 54 0d d0
    32 e1 67 c2 95 5d"""
)
CLIENT_CLOSE_NOTIFY_RECORD = h("17 03 03 00 13 c9 87 27 60 65 56 66 b7 4d 7f f1 15 3e fd 6d b6 d0 b0 e3")
SERVER_CLOSE_NOTIFY_RECORD = h("17 03 03 00 13 b5 8f d6 71 66 eb f5 99 d2 47 20 cf be 7e fa 7a 88 64 a9")

# not RFC 8448: the traffic secrets after one KeyUpdate ("traffic upd"), from Botan's tests
CLIENT_SECRET_1 = h("fc df cc 72 72 5a ae e4 8b f6 4e 4f d8 b7 49 cd bd ba b3 9d 90 da 0b 26 e2 24 5c a6 ea 16 72 07")
SERVER_SECRET_1 = h("51 92 1b 8a a3 00 19 76 eb 40 1d 0a 43 19 a8 51 64 16 a6 c5 60 01 a3 57 e5 d1 62 03 1e 84 f9 16")


class App(asyncio.Protocol):
    def __init__(self, keep_open: bool = False) -> None:
        self.received = b""
        self.eof = 0
        self.keep_open = keep_open

    def data_received(self, data: bytes) -> None:
        self.received += data

    def eof_received(self) -> bool | None:
        self.eof += 1
        return self.keep_open


@pytest.fixture
def server() -> Iterator[TLSServer]:
    loop = asyncio.new_event_loop()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    yield TLSServer(context, App, 5.0, loop)
    loop.close()


class FakeSSLObject:
    """What :meth:`TLSTransport._take_over` asks of the ``SSLObject`` after the RFC 8448 handshake."""

    def version(self) -> str:
        return "TLSv1.3"

    def cipher(self) -> tuple[str, str, int]:
        return ("TLS_AES_128_GCM_SHA256", "TLSv1.3", 128)

    def pending(self) -> int:
        return 0


def rfc8448_connection(server: TLSServer, app: App) -> tuple[TLSTransport, TCP]:
    """The server of RFC 8448 section 3 right after the handshake, taken over as :meth:`_handshake` does."""
    server.lean = True
    transport = TLSTransport(server, app)
    tcp = TCP()
    transport._tcp = tcp  # type: ignore[assignment]
    transport._wsecret, transport._rsecret = SERVER_SECRET, CLIENT_SECRET  # as the keylog callback sets them
    assert transport._take_over(FakeSSLObject(), NEW_SESSION_TICKET_RECORD)  # type: ignore[arg-type]
    transport._state = tls_base._RECORDS
    transport._made = True
    return transport, tcp


def test_write_keys_and_ivs_from_the_application_traffic_secrets() -> None:
    assert expand_label(SERVER_SECRET, b"key", 16, "sha256") == SERVER_KEY
    assert expand_label(SERVER_SECRET, b"iv", 12, "sha256") == SERVER_IV
    assert expand_label(CLIENT_SECRET, b"key", 16, "sha256") == CLIENT_KEY
    assert expand_label(CLIENT_SECRET, b"iv", 12, "sha256") == CLIENT_IV
    aead, iv = SUITE.cipher(SERVER_SECRET)
    assert iv == int.from_bytes(SERVER_IV, "big")
    header = SERVER_APP_RECORD[:5]
    assert header + aead.encrypt((iv ^ 1).to_bytes(12, "big"), APP_DATA + b"\x17", header) == SERVER_APP_RECORD
    assert SUITE.key_len == 16 and SUITE.hash_len == 32


def test_key_update_secrets_match_an_independent_implementation() -> None:
    assert SUITE.next_secret(CLIENT_SECRET) == CLIENT_SECRET_1
    assert SUITE.next_secret(SERVER_SECRET) == SERVER_SECRET_1


def test_the_new_session_ticket_fixes_the_first_sequence_number(server: TLSServer) -> None:
    transport, _ = rfc8448_connection(server, App())
    assert transport._wseq == 1  # the ticket was record 0 under the server application key
    # a ticket that does not decrypt at 0 (here: one byte changed), or one that is not a handshake message: no take-over
    other = TLSTransport(server, App())
    other._wsecret, other._rsecret = SERVER_SECRET, CLIENT_SECRET
    tampered = bytearray(NEW_SESSION_TICKET_RECORD)
    tampered[40] ^= 1
    assert not other._take_over(FakeSSLObject(), bytes(tampered))  # type: ignore[arg-type]
    assert not other._take_over(FakeSSLObject(), SERVER_APP_RECORD)  # type: ignore[arg-type]


def test_server_application_record_byte_for_byte(server: TLSServer) -> None:
    transport, tcp = rfc8448_connection(server, App())
    transport.write(APP_DATA)  # the one-record path of the fan-out
    assert tcp.take() == SERVER_APP_RECORD
    transport, tcp = rfc8448_connection(server, App())
    transport.write(memoryview(bytearray(APP_DATA)))  # not bytes
    assert tcp.take() == SERVER_APP_RECORD
    transport, tcp = rfc8448_connection(server, App())
    transport._release()  # idle: cipher objects dropped, rebuilt from the secret on the next write
    transport.write(APP_DATA)
    assert tcp.take() == SERVER_APP_RECORD
    transport, tcp = rfc8448_connection(server, App())
    transport.writelines([APP_DATA[:20], APP_DATA[20:]])
    assert tcp.take() == SERVER_APP_RECORD


def test_client_records_and_both_close_notify_alerts(server: TLSServer) -> None:
    app = App()
    transport, tcp = rfc8448_connection(server, app)
    transport.data_received(CLIENT_APP_RECORD)
    assert app.received == APP_DATA and transport._rseq == 1
    transport.write(APP_DATA)
    assert tcp.take() == SERVER_APP_RECORD
    transport.data_received(CLIENT_CLOSE_NOTIFY_RECORD)
    assert app.eof == 1 and tcp.closed
    assert tcp.take() == SERVER_CLOSE_NOTIFY_RECORD  # our answer: close_notify at sequence number 2


def test_records_split_anywhere_and_together(server: TLSServer) -> None:
    app = App()
    transport, _ = rfc8448_connection(server, app)
    wire = CLIENT_APP_RECORD + CLIENT_CLOSE_NOTIFY_RECORD
    for i in range(0, len(wire), 3):
        transport.data_received(wire[i : i + 3])
    assert app.received == APP_DATA and app.eof == 1


def client_record(seq: int, inner: bytes) -> bytes:
    """A record the RFC 8448 client could send at ``seq``: ``inner`` is content, type and padding."""
    header = bytes((23, 3, 3)) + (len(inner) + 16).to_bytes(2, "big")
    nonce = (int.from_bytes(CLIENT_IV, "big") ^ seq).to_bytes(12, "big")
    return header + AESGCM(CLIENT_KEY).encrypt(nonce, inner, header)


def test_client_record_construction_matches_the_rfc() -> None:
    assert client_record(0, APP_DATA + b"\x17") == CLIENT_APP_RECORD
    assert client_record(1, b"\x01\x00\x15") == CLIENT_CLOSE_NOTIFY_RECORD


def test_padding_and_the_inner_content_type(server: TLSServer) -> None:
    app = App()
    transport, tcp = rfc8448_connection(server, app)
    transport.data_received(client_record(0, b"abc\x17" + bytes(100)))  # padded application data
    assert app.received == b"abc"
    transport.data_received(client_record(1, bytes(20)))  # no content type at all
    assert tcp.closed and app.received == b"abc"
    alert = AESGCM(SERVER_KEY).decrypt(
        (int.from_bytes(SERVER_IV, "big") ^ 1).to_bytes(12, "big"), tcp.take()[5:], bytes((23, 3, 3, 0, 19))
    )
    assert alert == b"\x02\x0a\x15"  # fatal unexpected_message, as an alert record


def test_data_after_close_notify_is_ignored_even_if_the_application_keeps_the_connection(server: TLSServer) -> None:
    app = App(keep_open=True)
    transport, tcp = rfc8448_connection(server, app)
    transport.data_received(CLIENT_APP_RECORD + CLIENT_CLOSE_NOTIFY_RECORD + client_record(2, b"late\x17"))
    assert app.received == APP_DATA and app.eof == 1 and not tcp.closed
    transport.data_received(client_record(2, b"later\x17"))
    transport.data_received(client_record(3, b"still later\x17"))
    assert app.received == APP_DATA and app.eof == 1 and not tcp.closed
    assert transport._rsecret == b"" and transport._rbuf == b""
    transport.write(APP_DATA)  # sending after the peer's close_notify is allowed (half-close)
    assert tcp.take() == SERVER_APP_RECORD


def test_oversized_records_are_refused_with_record_overflow(server: TLSServer) -> None:
    app = App()
    transport, tcp = rfc8448_connection(server, app)
    # a header announcing 2^14 + 257 bytes: refused before anything of it is buffered
    transport.data_received(bytes((23, 3, 3)) + ((1 << 14) + 257).to_bytes(2, "big"))
    assert tcp.closed and transport._rbuf == b""
    alert = AESGCM(SERVER_KEY).decrypt(
        (int.from_bytes(SERVER_IV, "big") ^ 1).to_bytes(12, "big"), tcp.take()[5:], bytes((23, 3, 3, 0, 19))
    )
    assert alert == b"\x02\x16\x15"  # record_overflow
    # a record within 2^14 + 256 whose plaintext is over 2^14 + 1 bytes
    app = App()
    transport, tcp = rfc8448_connection(server, app)
    transport.data_received(client_record(0, b"x" * (1 << 14) + b"\x17" + bytes(1)))
    assert tcp.closed and app.received == b""
    # exactly 2^14 bytes of data is fine
    app = App()
    transport, tcp = rfc8448_connection(server, app)
    transport.data_received(client_record(0, b"y" * (1 << 14) + b"\x17"))
    assert app.received == b"y" * (1 << 14) and not tcp.closed


def test_empty_write_sends_no_record(server: TLSServer) -> None:
    transport, tcp = rfc8448_connection(server, App())
    transport.write(b"")
    assert tcp.take() == b"" and transport._wseq == 1
    transport.write(APP_DATA)
    assert tcp.take() == SERVER_APP_RECORD


def test_ctypes_layout_is_tried_only_where_it_is_known() -> None:
    assert tls_libssl.layout_known("cpython", (3, 11, 4))
    assert not tls_libssl.layout_known("cpython", (3, 99, 0))
    assert not tls_libssl.layout_known("cpython", (3, 7, 0))
    assert not tls_libssl.layout_known("pypy", (3, 11, 0))


def test_the_pointer_check_leaves_the_context_as_it_was() -> None:
    lib = tls_libssl._libssl()
    assert lib is not None
    for extra in (0, ssl.OP_NO_RENEGOTIATION):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.options |= extra
        before = int(context.options)
        pointer = tls_libssl.ssl_ctx_pointer(context, lib)
        assert pointer is not None and int(context.options) == before
        assert lib.SSL_CTX_get_options(pointer) == before


def test_unknown_layout_means_no_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tls_libssl, "LAYOUT_VERSIONS", ((3, 0), (3, 1)))
    lib = tls_libssl._libssl()
    assert lib is not None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    assert tls_libssl.ssl_ctx_pointer(context, lib) is None
    assert not tls_keylog.enable(context)
