"""One TLS connection as asyncio sees it: the TCP transport's protocol, the application's transport.

:class:`TLSTransport` composes the concerns (takeover.py, records.py, keyupdate.py, alerts.py,
openssl.py) over the fields of base.Base, and adds the asyncio surface: what the application sees
(``get_extra_info``, reading and writing flow control, ``close`` with ``close_notify`` as RFC 8446
6.1 asks, ``abort``), TCP's callbacks, and backpressure: a connection is not read while TCP cannot
take more of its output (as ``openssl s_server`` does), and what TLS itself holds back (an owed
``KeyUpdate`` answer, OpenSSL's records) counts against the connection's output limit together with
the application's own queue (``MaxPendingOutput``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Any

from migratory.server.transport.raw import RawTransport
from migratory.server.transport.tls import stats
from migratory.server.transport.tls.alerts import _CLOSE_NOTIFY, Alerts
from migratory.server.transport.tls.base import _ALERT, _CLOSED, _CLOSING, _HANDSHAKING, _OPENSSL, _RECORDS
from migratory.server.transport.tls.keys import SUITES
from migratory.server.transport.tls.keyupdate import _KEY_UPDATE_SIZE, KeyUpdates
from migratory.server.transport.tls.openssl import OpenSSLRecords
from migratory.server.transport.tls.records import Records
from migratory.server.transport.tls.takeover import TakeOver

__all__ = ["DEFAULT_MAX_PENDING", "TLSTransport"]

log = logging.getLogger("migratory.server.tls")  # one logger for the whole layer, as before the split

DEFAULT_MAX_PENDING = 4 << 20
"""The output limit when neither the listener nor the application protocol has one (``MaxPendingOutput``'s default)."""


class TLSTransport(TakeOver, Records, KeyUpdates, Alerts, OpenSSLRecords):
    """One TLS connection: the TCP transport's protocol, and the application protocol's transport.

    RFC 8446's record layer is one state machine over the same buffers and keys (records in and
    out, alerts, KeyUpdate, backpressure, the fail-closed take-over from OpenSSL): every concern is
    a mixin over base.Base's fields, and this class is what asyncio calls.
    """

    __slots__ = ()

    # --- what the application sees ------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self._ssl
        if name == "sslcontext":
            return self._server.context
        if name == "cipher":
            return self._ssl.cipher() if self._ssl is not None else (self._cipher_name(), "TLSv1.3", None)
        if name == "peercert":
            return None
        if self._tcp is None:
            return default
        return self._tcp.get_extra_info(name, default)

    def _cipher_name(self) -> str | None:
        for name, suite in SUITES.items():
            if suite is self._suite:
                return name
        return None

    @property
    def lean(self) -> bool:
        """True once this module carries the records (no OpenSSL state left)."""
        return self._state == _RECORDS or (self._state >= _CLOSING and self._suite is not None)

    def is_closing(self) -> bool:
        return self._state >= _CLOSING or self._tcp is None or self._tcp.is_closing()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        assert isinstance(protocol, asyncio.Protocol)
        self._protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def is_reading(self) -> bool:
        return self._tcp is not None and self._tcp.is_reading()

    def pause_reading(self) -> None:
        self._reading = False
        self._update_reading()

    def resume_reading(self) -> None:
        self._reading = True
        self._update_reading()
        if self._timer is None:
            self._catch_up()

    def _catch_up(self) -> None:
        """Open what was read but left waiting (past RECORD_RATE, or while the application did not read)."""
        if self._state == _RECORDS:
            if self._rbuf:
                self._records_in(b"")
        elif self._state == _OPENSSL and self._ssl is not None and self._incoming is not None:
            waiting = self._incoming.pending or self._ssl.pending()
            if waiting:
                self._openssl_in()

    def _update_reading(self) -> None:
        """TCP reads only while the application wants to, TCP can write and the peer is within RECORD_RATE.

        Reading waits while writing does (as ``openssl s_server`` does): what the peer sends next
        may ask for output (a ``KeyUpdate`` request, a request of the application), and a peer that
        does not read must not make the server keep it.
        """
        tcp = self._tcp
        if tcp is None or self._state >= _CLOSING:
            return
        if self._reading and not self._paused and (self._timer is None or self._state == _HANDSHAKING):
            tcp.resume_reading()
        else:
            tcp.pause_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        # RawTransport's limits are fixed (asyncio's defaults): nobody in this server sets others
        if self._tcp is not None and not isinstance(self._tcp, RawTransport):
            self._tcp.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._tcp.get_write_buffer_size() if self._tcp is not None else 0

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._tcp.get_write_buffer_limits() if self._tcp is not None else (0, 0)

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError("TLS has no half-close: use close()")

    def close(self) -> None:
        """Send close_notify, then close TCP once what is queued has gone."""
        state = self._state
        if state >= _CLOSING or self._tcp is None:
            return
        self._state = _CLOSING
        if state == _RECORDS:
            self._tcp.write(self._seal(bytes((1, _CLOSE_NOTIFY, _ALERT))))
            stats.alerts_sent["close_notify"] = stats.alerts_sent.get("close_notify", 0) + 1
        elif state == _OPENSSL and self._ssl is not None:
            with contextlib.suppress(ssl.SSLError):
                self._ssl.unwrap()
            self._flush_openssl()
        self._forget_secrets()  # nothing is sealed or opened after close_notify
        self._tcp.close()

    def abort(self) -> None:
        if self._state < _CLOSING:
            self._state = _CLOSING
        self._forget_secrets()
        if self._tcp is not None:
            self._tcp.abort()

    # --- TCP protocol callbacks ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._tcp = transport  # type: ignore[assignment]  # uvloop's transports are not subclasses
        server = self._server
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = server.context.wrap_bio(self._incoming, self._outgoing, server_side=True)
        self._timer = server.loop.call_later(server.handshake_timeout, self._handshake_timed_out)

    def data_received(self, data: bytes) -> None:
        state = self._state
        if state == _RECORDS:
            self._records_in(data)
        elif state == _OPENSSL:
            assert self._incoming is not None
            self._incoming.write(data)
            self._openssl_in()
        elif state == _HANDSHAKING:
            assert self._incoming is not None
            self._incoming.write(data)
            self._handshake()

    def eof_received(self) -> bool | None:
        if self._state < _CLOSING and self._made:
            keep_open = self._protocol.eof_received()
            if keep_open:
                return True
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._state = _CLOSED
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._ssl = self._incoming = self._outgoing = None
        self._forget_secrets()
        self._rbuf = self._hbuf = b""
        self._sslp = None
        self._owed = 0
        if self._made:
            self._made = False
            self._protocol.connection_lost(exc)

    def pause_writing(self) -> None:
        """TCP's buffer is over its high-water mark: the application stops writing, and we stop reading."""
        if self._paused:
            return
        self._paused = True
        self._update_reading()
        if self._made:
            self._protocol.pause_writing()

    def resume_writing(self) -> None:
        """TCP's buffer has drained: the application writes again, then what TLS held back goes, then we read."""
        if not self._paused:
            return
        self._paused = False
        if self._made:
            self._protocol.resume_writing()  # what it writes first sends an owed KeyUpdate answer (write)
        if not self._paused:
            self._flush_held()
            self._update_reading()

    # --- TLS-level output: what the peer's records ask of us -----------------------------------

    def _flush_held(self) -> None:
        """What TLS itself had to send while TCP could not take more (a KeyUpdate answer, OpenSSL's records)."""
        if self._state == _RECORDS:
            if self._owed:
                self._pay_key_update()
        elif self._state == _OPENSSL:
            self._flush_openssl()

    def _output_limit(self) -> int:
        """The connection's output limit: the listener's, else the application's (MaxPendingOutput)."""
        limit = self._server.max_pending
        if limit is None:
            limit = getattr(getattr(self._protocol, "engine", None), "max_pending", None)
        return limit if isinstance(limit, int) else DEFAULT_MAX_PENDING

    def _within_limit(self) -> bool:
        """TLS-level output held while TCP is paused counts against the output limit, with the application's.

        The application (:class:`migratory.server.sessions.connection.Connection`) keeps what it could not
        write in its own queue, bounded by ``MaxPendingOutput`` (``pending_bytes``); what TLS
        holds back (an owed ``KeyUpdate`` answer, what OpenSSL wrote in its outgoing BIO) is added
        to that, and past the limit the connection is dropped as a slow consumer would be.
        """
        held = _KEY_UPDATE_SIZE * self._owed
        if self._outgoing is not None:
            held += self._outgoing.pending
        if not held:
            return True
        pending = getattr(self._protocol, "pending_bytes", 0)
        total = held + (pending if isinstance(pending, int) else 0)
        if total <= self._output_limit():
            return True
        log.info(
            "TLS: connection from %s dropped: %d bytes of TLS output waiting, over its output limit of %d",
            self.get_extra_info("peername"),
            total,
            self._output_limit(),
        )
        self.abort()
        return False
