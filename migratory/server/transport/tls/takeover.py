"""The handshake, OpenSSL's, and the fail-closed take-over of its records (RFC 8446 4, 4.6.1, 5).

The handshake runs in an ``SSLObject`` over two memory BIOs, from the listener's ``SSLContext``:
certificates, versions, ciphers, ALPN, tickets and alerts stay OpenSSL's. When it completes, the
connection is taken over only if what OpenSSL negotiated is what this record layer implements, as
libssl itself reports it (:meth:`TakeOver._refusal`: TLS 1.3, one of :data:`keys.SUITES`, both
traffic secrets from the keylog hook, no max_fragment_length of RFC 6066, no early data, nothing
read but unconsumed); and only if the records OpenSSL wrote as it finished (its
``NewSessionTicket`` messages, 4.6.1) decrypt under the server's key at sequence numbers 0, 1, ...
as handshake data, so our first sequence number is known, not guessed. With ``read_ahead`` off
(CPython's default) OpenSSL has read no record past the client's ``Finished``, so whatever is left in
the incoming BIO is application data at the client's sequence number 0. Otherwise OpenSSL keeps the
records (openssl.py), counted and logged by reason (stats.fallbacks).
"""

from __future__ import annotations

import logging
import ssl

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from migratory.server.transport.tls import libssl, stats
from migratory.server.transport.tls.base import (
    _APPLICATION_DATA,
    _CLOSING,
    _HANDSHAKE,
    _HANDSHAKING,
    _HEADER,
    _OPENSSL,
    _RECORDS,
    Base,
)
from migratory.server.transport.tls.keylog import _Capture
from migratory.server.transport.tls.keys import SUITES

__all__ = ["TakeOver"]

log = logging.getLogger("migratory.server.tls")  # one logger for the whole layer, as before the split

_TLS1_3_VERSION = 0x0304
_SSL_EARLY_DATA_NOT_SENT = 0


class TakeOver(Base):
    """One connection's handshake, and the take-over of its records when the lean layer can carry them."""

    __slots__ = ()

    def _handshake_timed_out(self) -> None:
        self._timer = None
        if self._state == _HANDSHAKING:
            log.debug("TLS handshake not completed within HandshakeTimeout: %s", self.get_extra_info("peername"))
            stats.counters["handshake_failures"] += 1
            self.abort()

    def _handshake(self) -> None:
        sslobj = self._ssl
        assert sslobj is not None and self._outgoing is not None
        # the keylog hook keeps secrets only for a connection the lean record layer may take over
        _Capture.target = self if self._server.lean else None
        try:
            sslobj.do_handshake()
        except ssl.SSLWantReadError:
            self._flush_openssl()
            return
        except ssl.SSLError as exc:
            self._flush_openssl()  # the alert that says why
            log.debug("TLS handshake failed: %s", exc)
            stats.counters["handshake_failures"] += 1
            self._sslp = None
            self._state = _CLOSING
            self._forget_secrets()
            if self._tcp is not None:
                self._tcp.close()
            return
        finally:
            _Capture.target = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        final = self._outgoing.read()
        reason = self._refusal(sslobj) if self._server.lean else ""
        self._sslp = None  # not needed (nor valid) once the SSL object is gone
        if reason is None and not self._take_over(sslobj, final):
            reason = "tickets"
        if reason is None:
            leftover = self._incoming.read() if self._incoming is not None else b""
            self._ssl = self._incoming = self._outgoing = None  # OpenSSL's state goes now
            self._server._freed += 1
            self._state = _RECORDS
            stats.counters["lean_connections"] += 1
            if final:
                self._tcp.write(final)  # type: ignore[union-attr]
            self._made = True
            self._protocol.connection_made(self)
            if leftover and self._state == _RECORDS:
                self._records_in(leftover)
            return
        if reason:
            self._fell_back(reason)
        self._forget_secrets()  # OpenSSL carries the records: the lean layer needs nothing of them
        self._suite = None
        self._state = _OPENSSL
        if final:
            self._tcp.write(final)  # type: ignore[union-attr]
        self._made = True
        self._protocol.connection_made(self)
        if self._state == _OPENSSL:
            self._openssl_in()

    def _refusal(self, sslobj: ssl.SSLObject) -> str | None:
        """Why this module cannot carry the records of this connection (a key of :data:`fallbacks`); None if it can.

        Fail closed: the connection is taken over only when what OpenSSL negotiated is what this
        record layer implements, as libssl itself reports it through the ``SSL *`` of the
        handshake (the one OpenSSL handed to the keylog callback, checked to be a TLS 1.3
        server's with this very suite): no max_fragment_length (RFC 6066, which would cap every
        record at 512 to 4096 bytes; OpenSSL implements no record_size_limit of RFC 8449, so
        that one is never agreed to), no early data, nothing read but not yet consumed. Any of
        these, or a state that cannot be read, leaves the connection on OpenSSL's record layer.
        """
        if sslobj.version() != "TLSv1.3":
            return "not_tls13"
        cipher = sslobj.cipher()
        if not cipher or cipher[0] not in SUITES:
            return "suite"
        if not self._wsecret or not self._rsecret:
            return "no_secrets"
        lib = libssl.negotiated_state_lib()
        pointer = self._sslp
        if lib is None or not pointer:
            return "unverified"
        if lib.SSL_version(pointer) != _TLS1_3_VERSION or lib.SSL_is_server(pointer) != 1:
            return "unverified"
        current = lib.SSL_get_current_cipher(pointer)
        session = lib.SSL_get_session(pointer)
        if not current or not session or lib.SSL_CIPHER_get_name(current) != cipher[0].encode("ascii"):
            return "unverified"
        if lib.SSL_SESSION_get_max_fragment_length(session) != 0:
            return "max_fragment_length"
        if lib.SSL_get_early_data_status(pointer) != _SSL_EARLY_DATA_NOT_SENT:
            return "early_data"
        if sslobj.pending() or lib.SSL_has_pending(pointer):
            return "buffered"
        return None

    def _fell_back(self, reason: str) -> None:
        """Count (and log) a connection of a lean listener left on OpenSSL's record layer.

        Logged at INFO the 1st, 2nd, 4th, 8th... time for each reason (a client cannot fill the
        log by repeating one), at DEBUG otherwise.
        """
        count = stats.fallbacks[reason] = stats.fallbacks.get(reason, 0) + 1
        level = logging.INFO if count & (count - 1) == 0 else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(
                level,
                "TLS: connection from %s keeps OpenSSL's record layer: %s (%d so far)",
                self.get_extra_info("peername"),
                stats.FALLBACK_REASONS.get(reason, reason),
                count,
            )

    def _take_over(self, sslobj: ssl.SSLObject, final: bytes) -> bool:
        """Whether this module can carry the records from here (and is set up to)."""
        if not self._server.lean or sslobj.version() != "TLSv1.3" or not self._wsecret or not self._rsecret:
            return False
        cipher = sslobj.cipher()
        suite = SUITES.get(cipher[0]) if cipher else None
        if suite is None or sslobj.pending():
            return False
        self._suite = suite
        # What OpenSSL wrote as it completed the handshake (its session tickets) is under the
        # server's application key: it must decrypt at sequence numbers 0, 1, ... as handshake data.
        wkey, iv = suite.keys(self._wsecret)
        enc = suite.aead(wkey)
        pos = 0
        seq = 0
        while pos < len(final):
            if len(final) - pos < 5:
                return False
            kind, _, length = _HEADER.unpack_from(final, pos)
            header = final[pos : pos + 5]
            body = final[pos + 5 : pos + 5 + length]
            pos += 5 + length
            if kind != _APPLICATION_DATA or len(body) != length:
                return False
            try:
                inner = enc.decrypt((iv ^ seq).to_bytes(12, "big"), body, header).rstrip(b"\x00")
            except InvalidTag:
                return False
            if not inner or inner[-1] != _HANDSHAKE:
                return False
            seq += 1
        self._wseq = seq
        self._wkey, self._wiv = bytearray(wkey), iv
        self._c = self._server.sealer is not None and suite.aead is AESGCM
        if not self._c:
            self._enc = enc
        rkey, self._riv = suite.keys(self._rsecret)
        self._rkey = bytearray(rkey)
        self._hold()
        return True
