"""What tests/test_tls_fuzz.py needs: client record streams as values, sealed for one connection, and the outcome.

A stream is a list of :class:`Rec` (one record each) built from plaintext operations, so the very
same stream can be sealed for two connections with different keys: the lean record layer's and
OpenSSL's. :func:`run` makes a connection of a :class:`TLSServer` with a real OpenSSL client
(``Pair`` of test_tlstransport), seals the stream with that client's traffic secret (from its key
log), feeds it in the given chunks, and returns an :class:`Outcome`: what the application got,
whether the server closed (and how), and what the real client reads of the server's answer.
"""

from __future__ import annotations

import ctypes
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from migratory.server.transport.tls import SUITES, TLSServer
from migratory.server.transport.tls import libssl as tls_libssl
from tests.test_tlstransport import Pair

APPLICATION_DATA, ALERT, HANDSHAKE, CHANGE_CIPHER_SPEC = 23, 21, 22, 20
MAX_CIPHERTEXT = (1 << 14) + 256
MAX_INNER = (1 << 14) + 1
AFTER = b"the server's data after the stream"


@dataclass(frozen=True)
class Rec:
    """One record the client sends.

    ``content`` and ``content_type`` make the TLSInnerPlaintext with ``padding`` zeros
    (``content_type`` None: no type byte, the plaintext is ``content`` and the padding only);
    ``outer`` and ``version`` go in the header (which is the AEAD's additional data);
    ``tamper`` flips a bit of the tag; ``raw`` is sent as it is instead (header included);
    ``next_key`` moves the client to its next traffic secret after this record (a KeyUpdate's last part).
    """

    content: bytes = b""
    content_type: int | None = APPLICATION_DATA
    padding: int = 0
    outer: int = APPLICATION_DATA
    version: int = 0x0303
    tamper: bool = False
    raw: bytes | None = None
    next_key: bool = False


class Sealer:
    """The client's write side: its traffic secret, and the records it seals under it."""

    def __init__(self, suite_name: str, secret: bytes) -> None:
        self.suite = SUITES[suite_name]
        self.secret = secret
        self.key, self.iv = self.suite.keys(secret)
        self.seq = 0

    def seal(self, rec: Rec) -> bytes:
        if rec.raw is not None:
            return rec.raw
        inner = rec.content + (bytes((rec.content_type,)) if rec.content_type is not None else b"")
        inner += bytes(rec.padding)
        header = bytes((rec.outer,)) + rec.version.to_bytes(2, "big") + (len(inner) + 16).to_bytes(2, "big")
        nonce = (self.iv ^ self.seq).to_bytes(12, "big")
        body = bytearray(self.suite.aead(self.key).encrypt(nonce, inner, header))
        self.seq += 1
        if rec.tamper:
            body[-1] ^= 0x01
        if rec.next_key:
            self.secret = self.suite.next_secret(self.secret)
            self.key, self.iv = self.suite.keys(self.secret)
            self.seq = 0
        return header + bytes(body)


def client_context_for(pki: dict[str, Path], suite: str, keylog: Path) -> ssl.SSLContext:
    """A TLS 1.3 client context offering only ``suite`` (through libssl: the ssl module cannot), logging its keys."""
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    lib = tls_libssl._libssl()
    assert lib is not None
    pointer = tls_libssl.ssl_ctx_pointer(context, lib)
    assert pointer is not None
    lib.SSL_CTX_set_ciphersuites.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    assert lib.SSL_CTX_set_ciphersuites(pointer, suite.encode("ascii")) == 1
    context.keylog_filename = str(keylog)
    return context


def last_secret(keylog: Path, label: str) -> bytes:
    lines = [line.split() for line in keylog.read_text().splitlines()]
    return bytes.fromhex([line for line in lines if line and line[0] == label][-1][2])


_ALERT_NAME = re.compile(r"(?:SSLV3|TLSV1|TLSV13)_ALERT_([A-Z_]+)")


@dataclass
class Outcome:
    """What one connection made of a stream: the observable behaviour the two record layers must share."""

    delivered: bytes = b""  # the application's data, in order
    eof: bool = False  # the application was told of the peer's close_notify
    closed: bool = False  # the server closed TCP
    aborted: bool = False  # ... without waiting for its output to go
    answer: str = "none"  # what the real client read at the end: none, close_notify, or the alert's name
    client_read: bytes = b""  # the server's application data the client read
    notes: list[str] = field(default_factory=list)

    @property
    def alert_class(self) -> str:
        """none, close_notify or fatal: the class of what the server sent."""
        return self.answer if self.answer in ("none", "close_notify") else "fatal"


def client_reads(pair: Pair) -> tuple[bytes, str]:
    """What the real client reads of the server's output: its data, then none, close_notify or an alert name."""
    pair.c_in.write(pair.tcp.take())
    out = b""
    try:
        while True:
            chunk = pair.client.read(65536)
            if not chunk:
                return out, "close_notify"
            out += chunk
    except ssl.SSLWantReadError:
        return out, "none"
    except ssl.SSLZeroReturnError:
        return out, "close_notify"
    except ssl.SSLError as exc:
        match = _ALERT_NAME.search(str(exc))
        return out, match.group(1).lower() if match else f"client error: {exc}"


def run(
    server: TLSServer, context: ssl.SSLContext, keylog: Path, suite: str, wire_of: WireOf, chunks: list[int]
) -> Outcome:
    """One connection: handshake, the stream in ``chunks`` (sizes, cycled), then the server writes if it can."""
    keylog.write_bytes(b"")  # OpenSSL appends (O_APPEND) to the file it keeps open: only this handshake's lines
    pair = Pair(server, context)
    pair.handshake()
    assert pair.client.version() == "TLSv1.3" and pair.client.cipher()[0] == suite  # type: ignore[index]
    assert pair.transport.lean == server.lean
    # the tickets OpenSSL sent after the handshake: read now, so that what follows is the stream's answer
    ticket_data, ticket_answer = client_reads(pair)
    assert (ticket_data, ticket_answer) == (b"", "none")
    wire = wire_of(Sealer(suite, last_secret(keylog, "CLIENT_TRAFFIC_SECRET_0")))
    outcome = Outcome()
    pos = index = 0
    while pos < len(wire) and not pair.tcp.closed:
        size = chunks[index % len(chunks)] if chunks else len(wire)
        index += 1
        pair.transport.data_received(wire[pos : pos + size])
        pos += size
    if not pair.tcp.closed and not pair.transport.is_closing():
        pair.transport.write(AFTER)
    outcome.delivered = pair.app.received
    outcome.eof = pair.app.eof
    outcome.closed = pair.tcp.closed
    outcome.aborted = pair.tcp.aborted
    outcome.client_read, outcome.answer = client_reads(pair)
    pair.transport.connection_lost(None)
    server._active.clear()  # the sweep never runs here (the loop does not): nothing to keep
    return outcome


class WireOf:
    """The stream's records, sealed for one connection (a callable so each connection seals its own)."""

    def __init__(self, records: list[Rec]) -> None:
        self.records = records

    def __call__(self, sealer: Sealer) -> bytes:
        return b"".join(sealer.seal(rec) for rec in self.records)
