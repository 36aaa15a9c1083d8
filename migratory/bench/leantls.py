"""A lean TLS 1.3 client for the load generators: OpenSSL for the handshake, then a small record layer.

Why: a million ``wss://`` clients (issue 35) cannot each keep OpenSSL's ``SSL`` object and the
event loop's TLS transport, about 25 KB a connection (bench/tls.md): 25 GB of load generators on a
24 GB machine that must also hold the server. The server already leaves OpenSSL after a TLS 1.3
handshake (``migratory.server.transport.tls``); this is the same idea for the client side,
without what a server needs (fallbacks, flood limits, counters, sweeps), since it only ever
talks to the server under test:

* **Handshake**: an ``SSLObject`` over two memory BIOs, from the loader's ``SSLContext``
  (certificate checked against the run's CA, host name, TLS 1.3 only). The traffic secrets come
  from OpenSSL's keylog callback, set on that context through libssl as the server does
  (:func:`migratory.server.transport.tls.ssl_ctx_pointer`).
* **Records** (RFC 8446 section 5): application data both ways, ``NewSessionTicket`` read and
  dropped, ``KeyUpdate`` followed (and answered when the server asks), alerts close the
  connection. The connection keeps two secrets, two keys and IVs and two sequence numbers; a
  cipher object is made per read or write (about 1 us), not kept.

Anything else (another protocol version or suite, a secret not captured) fails the connection
with a clear reason instead of guessing.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import ssl
from typing import Any, cast

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from migratory.server.transport.tls.keylog import _strlen, traffic_secret
from migratory.server.transport.tls.keys import SUITES, wipe
from migratory.server.transport.tls.libssl import _KEYLOG_CALLBACK, _libssl, ssl_ctx_pointer

__all__ = ["LeanClient", "lean_context", "open_lean", "unavailable"]

_HANDSHAKE, _APPLICATION, _ALERT, _CCS = 22, 23, 21, 20
_NEW_SESSION_TICKET, _KEY_UPDATE = 4, 24
_MAX_PLAINTEXT = 1 << 14
_MAX_CIPHERTEXT = _MAX_PLAINTEXT + 256


class _Target:
    """The connection whose handshake OpenSSL is running now (the keylog callback writes into it)."""

    client: LeanClient | None = None


def _on_keylog(_ssl_pointer: int | None, line_pointer: int | None) -> None:
    client = _Target.client
    if client is None or not line_pointer or _strlen is None:
        return
    line = memoryview((ctypes.c_char * _strlen(line_pointer)).from_address(line_pointer)).cast("B")
    found = traffic_secret(line)
    if found is None:
        return
    server, secret = found
    if server:
        client._rsecret = bytes(secret)
    else:
        client._wsecret = bytes(secret)
    wipe(secret)


_callback = _KEYLOG_CALLBACK(_on_keylog)  # alive as long as the process


_UNREACHABLE = "the lean TLS client cannot reach OpenSSL's keylog hook on this interpreter; use --tls-client openssl"


def _set_hook(context: ssl.SSLContext) -> bool:
    """Set the keylog hook on ``context``; False where libssl or the context's ``SSL_CTX`` cannot be reached."""
    lib = _libssl()
    pointer = ssl_ctx_pointer(context, lib) if lib is not None else None
    if lib is None or pointer is None or _strlen is None:
        return False
    lib.SSL_CTX_set_keylog_callback(pointer, _callback)
    return True


def unavailable() -> str | None:
    """Why the lean client cannot run on this interpreter (OpenSSL's keylog hook out of reach), or None."""
    return None if _set_hook(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)) else _UNREACHABLE


@functools.cache
def lean_context(ca: str) -> ssl.SSLContext:
    """The loader's client context for ``ca`` (one a process: loading the CA a connection would dominate),
    TLS 1.3 only, with the keylog hook set; ``ValueError`` if libssl cannot be reached."""
    context = ssl.create_default_context(cafile=ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    if not _set_hook(context):
        raise ValueError(_UNREACHABLE)
    return context


class _Keys:
    """One direction's traffic secret, key, IV and sequence number."""

    __slots__ = ("aead", "iv", "key", "secret", "seq")

    def __init__(self, secret: bytes, suite: str) -> None:
        self.aead = SUITES[suite].aead
        self._derive(secret, suite)

    def _derive(self, secret: bytes, suite: str) -> None:
        self.secret = secret
        self.key, self.iv = SUITES[suite].keys(secret)
        self.seq = 0

    def cipher(self) -> AESGCM | ChaCha20Poly1305:
        return self.aead(self.key)

    def nonce(self) -> bytes:
        nonce = (self.iv ^ self.seq).to_bytes(12, "big")
        self.seq += 1
        return nonce

    def update(self, suite: str) -> None:
        """The next generation (RFC 8446 7.2), after a KeyUpdate."""
        self._derive(SUITES[suite].next_secret(self.secret), suite)


class LeanClient(asyncio.Protocol, asyncio.Transport):
    """The TCP connection's protocol and the application protocol's transport."""

    __slots__ = (
        "_app",
        "_closing",
        "_hbuf",
        "_incoming",
        "_made",
        "_outgoing",
        "_rbuf",
        "_read",
        "_rsecret",
        "_ssl",
        "_suite",
        "_tcp",
        "_write",
        "_wsecret",
        "up",
    )

    def __init__(self, context: ssl.SSLContext, host: str, app: asyncio.Protocol) -> None:
        super().__init__()
        self._app = app
        self._made = False  # the application's connection_made ran (then, and only then, its connection_lost)
        self._tcp: asyncio.Transport | None = None
        self._incoming: ssl.MemoryBIO | None = ssl.MemoryBIO()
        self._outgoing: ssl.MemoryBIO | None = ssl.MemoryBIO()
        self._ssl: ssl.SSLObject | None = context.wrap_bio(self._incoming, self._outgoing, server_hostname=host)
        self._suite = ""
        self._wsecret = b""
        self._rsecret = b""
        self._write: _Keys | None = None
        self._read: _Keys | None = None
        self._rbuf = b""
        self._hbuf = b""
        self._closing = False
        self.up: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # --- toward TCP ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._tcp = cast(asyncio.Transport, transport)
        self._handshake(b"")

    def data_received(self, data: bytes) -> None:
        if self._ssl is not None:
            self._handshake(data)
        elif self._read is not None:
            self._records(data)

    def eof_received(self) -> bool | None:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        if not self.up.done():
            self.up.set_exception(ConnectionError(f"TLS handshake: connection lost ({exc})"))
        if self._made:
            self._app.connection_lost(exc)

    # --- the handshake -------------------------------------------------------------------------

    def _handshake(self, data: bytes) -> None:
        sslobj, incoming, outgoing = self._ssl, self._incoming, self._outgoing
        assert sslobj is not None and incoming is not None and outgoing is not None and self._tcp is not None
        if data:
            incoming.write(data)
        _Target.client = self
        try:
            sslobj.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        except ssl.SSLError as exc:
            self._fail(f"TLS handshake: {exc}")
            return
        finally:
            _Target.client = None
        flight = outgoing.read()
        if flight:
            self._tcp.write(flight)
        if not done:
            return
        cipher = sslobj.cipher()
        version = sslobj.version()
        if version != "TLSv1.3" or cipher is None or cipher[0] not in SUITES:
            self._fail(f"TLS handshake: negotiated {version} {cipher[0] if cipher else None}, not a TLS 1.3 suite")
            return
        if not self._wsecret or not self._rsecret:
            self._fail("TLS handshake: the traffic secrets were not captured")
            return
        self._suite = cipher[0]
        self._write = _Keys(self._wsecret, self._suite)
        self._read = _Keys(self._rsecret, self._suite)
        self._wsecret = self._rsecret = b""  # held by the keys from here on (and replaced there by a KeyUpdate)
        if sslobj.pending():
            self._fail("TLS handshake: OpenSSL holds application data already read; not taken over")
            return
        rest = incoming.read()  # records after the server's Finished (OpenSSL reads no further)
        self._ssl = self._incoming = self._outgoing = None  # OpenSSL's SSL object and BIOs are freed here
        self.up.set_result(None)
        self._made = True
        self._app.connection_made(self)
        if rest:
            self._records(rest)

    def _fail(self, reason: str) -> None:
        if not self.up.done():
            self.up.set_exception(ConnectionError(reason))
        if self._tcp is not None:
            self._tcp.abort()

    # --- records ----------------------------------------------------------------------------

    def _records(self, data: bytes) -> None:
        buffer = self._rbuf + data if self._rbuf else data
        keys = self._read
        assert keys is not None
        cipher = None
        plain: list[bytes] = []
        offset = 0
        while len(buffer) - offset >= 5:
            kind = buffer[offset]
            length = int.from_bytes(buffer[offset + 3 : offset + 5], "big")
            if length > _MAX_CIPHERTEXT:
                self._fail("TLS: record overflow from the server")
                return
            end = offset + 5 + length
            if end > len(buffer):
                break
            header = buffer[offset : offset + 5]
            body = buffer[offset + 5 : end]
            offset = end
            if kind == _CCS:
                continue  # middlebox compatibility (RFC 8446 D.4): never encrypted, never meaningful
            if kind != _APPLICATION:
                self._fail(f"TLS: unprotected record of type {kind} after the handshake")
                return
            if cipher is None:
                cipher = keys.cipher()
            try:
                inner = cipher.decrypt(keys.nonce(), body, header)
            except Exception:  # cryptography's InvalidTag: the record was not the server's
                self._fail("TLS: bad record MAC")
                return
            inner = inner.rstrip(b"\x00")
            if not inner:
                self._fail("TLS: a record with no content type")
                return
            content_type, content = inner[-1], inner[:-1]
            if content_type == _APPLICATION:
                plain.append(content)
            elif content_type == _HANDSHAKE:
                try:
                    if self._handshake_messages(content):
                        cipher = None  # the next record is under the server's next key
                except ConnectionError as exc:
                    self._fail(str(exc))
                    return
            else:  # an alert: close_notify or fatal, the connection ends either way
                self._deliver(plain)
                if self._tcp is not None:
                    self._tcp.close()
                return
        self._rbuf = buffer[offset:]
        self._deliver(plain)

    def _deliver(self, plain: list[bytes]) -> None:
        if plain:
            self._app.data_received(plain[0] if len(plain) == 1 else b"".join(plain))

    def _handshake_messages(self, content: bytes) -> bool:
        """Post-handshake messages; True if the read key changed (a KeyUpdate)."""
        buffer = self._hbuf + content
        updated = False
        while len(buffer) >= 4:
            size = int.from_bytes(buffer[1:4], "big")
            if len(buffer) < 4 + size:
                break
            kind, body, buffer = buffer[0], buffer[4 : 4 + size], buffer[4 + size :]
            if kind == _KEY_UPDATE and len(body) == 1:
                assert self._read is not None
                self._read.update(self._suite)
                updated = True
                if body[0] == 1:  # update_requested: ours follows, under the old key, then the new one
                    self._send(bytes((_KEY_UPDATE, 0, 0, 1, 0)), _HANDSHAKE)
                    assert self._write is not None
                    self._write.update(self._suite)
            elif kind != _NEW_SESSION_TICKET:
                raise ConnectionError(f"TLS: unexpected handshake message {kind} after the handshake")
        self._hbuf = buffer
        return updated

    def _send(self, data: bytes, content_type: int = _APPLICATION) -> None:
        keys = self._write
        if keys is None or self._tcp is None:
            return
        cipher = keys.cipher()
        out = []
        for start in range(0, max(len(data), 1), _MAX_PLAINTEXT):
            inner = data[start : start + _MAX_PLAINTEXT] + bytes((content_type,))
            header = bytes((_APPLICATION, 3, 3)) + (len(inner) + 16).to_bytes(2, "big")
            out.append(header + cipher.encrypt(keys.nonce(), inner, header))
        self._tcp.write(b"".join(out))

    # --- toward the application -------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._closing and data:
            self._send(bytes(data))

    def close(self) -> None:
        if self._closing:
            return
        self._send(b"\x01\x00", _ALERT)  # close_notify
        self._closing = True
        if self._tcp is not None:
            self._tcp.close()

    def abort(self) -> None:
        self._closing = True
        if self._tcp is not None:
            self._tcp.abort()

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "cipher":
            return (self._suite, "TLSv1.3", None) if self._suite else default
        return self._tcp.get_extra_info(name, default) if self._tcp is not None else default


async def open_lean(
    loop: asyncio.AbstractEventLoop, sock: Any, ca: str, host: str, app: asyncio.Protocol, timeout: float = 60.0
) -> LeanClient:
    """A connected socket to a lean TLS client carrying ``app``, once its handshake is done."""
    client = LeanClient(lean_context(ca), host, app)
    await loop.create_connection(lambda: client, sock=sock)
    try:
        await asyncio.wait_for(asyncio.shield(client.up), timeout)
    except BaseException:
        client.abort()
        raise
    return client
