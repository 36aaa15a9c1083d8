"""Alerts (RFC 8446 6): those the peer sends, and the fatal ones the lean record layer sends.

``close_notify`` ends the peer's direction (6.1); ``user_canceled``, TLS 1.3's only warning, is
ignored up to :data:`MAX_WARNING_ALERTS` in a row, as OpenSSL does; every other alert is fatal
(6.2). An alert record must hold exactly one two-byte alert (5.4, 6): an empty one gets
``unexpected_message``, another length ``decode_error``. A fatal error of ours delivers what was
good before it, sends its alert under the current key, wipes the keys and closes.
"""

from __future__ import annotations

import logging

from migratory.server.transport.tls import stats
from migratory.server.transport.tls.base import _ALERT, _CLOSING, _RECORDS, Base
from migratory.server.transport.tls.keys import wipe

__all__ = ["MAX_WARNING_ALERTS", "Alerts"]

log = logging.getLogger("migratory.server.tls")  # one logger for the whole layer, as before the split

# alert descriptions (RFC 8446 6)
_CLOSE_NOTIFY = 0
_UNEXPECTED_MESSAGE = 10
_BAD_RECORD_MAC = 20
_RECORD_OVERFLOW = 22
_DECODE_ERROR = 50
_ILLEGAL_PARAMETER = 47
_USER_CANCELED = 90
_WARNED_ALERTS = frozenset({_BAD_RECORD_MAC, _DECODE_ERROR, _RECORD_OVERFLOW})
"""The alerts of ours that are logged at WARNING (at most once a minute per cause: stats._warn_limited)."""

MAX_WARNING_ALERTS = 5
"""Consecutive ``user_canceled`` alerts (TLS 1.3's only warning) that end the connection, as OpenSSL's
``MAX_WARN_ALERT_COUNT``: the fifth, with no non-empty record between them, gets a fatal ``unexpected_message``."""


class Alerts(Base):
    """The alerts of one connection on the lean record layer."""

    __slots__ = ()

    def _alert_received(self, content: bytes, plain: list[bytes]) -> bool:
        """An alert from the peer; True if the records after it are to be read (``user_canceled``).

        ``user_canceled`` is TLS 1.3's only warning: it is ignored, up to :data:`MAX_WARNING_ALERTS` in a
        row. An empty alert record gets ``unexpected_message`` (RFC 8446 5.4), one of another length than 2
        bytes a fatal ``decode_error``; ``close_notify`` ends the reading; any other alert is fatal (6.2).
        """
        if not content:  # an alert record is never empty (RFC 8446 5.4): unexpected_message, as OpenSSL says
            self._alert(_UNEXPECTED_MESSAGE, plain)
            return False
        if len(content) != 2:
            self._alert(_DECODE_ERROR, plain)
            return False
        description = content[1]
        name = stats._alert_name(description)
        stats.alerts_received[name] = stats.alerts_received.get(name, 0) + 1
        if description == _USER_CANCELED:
            self._warnings += 1
            if self._warnings >= MAX_WARNING_ALERTS:
                log.debug("TLS: too many user_canceled alerts from %s", self.get_extra_info("peername"))
                self._alert(_UNEXPECTED_MESSAGE, plain)
                return False
            return True
        self._deliver(plain)
        if description == _CLOSE_NOTIFY:
            self._dec = None
            for buffer in (self._rsecret, self._rkey):
                wipe(buffer)
            self._rsecret = self._rkey = self._rbuf = self._hbuf = b""  # nothing more is read on this connection
            keep_open = self._protocol.eof_received() if self._made and self._state == _RECORDS else None
            if not keep_open:
                self.close()
            return False
        log.debug("TLS alert %d from %s", description, self.get_extra_info("peername"))
        self.abort()
        return False

    def _alert(self, description: int, plain: list[bytes]) -> None:
        """A fatal error in the peer's records: deliver what was good, send the alert, close."""
        self._deliver(plain)
        if self._state != _RECORDS or self._tcp is None:
            return
        name = stats._alert_name(description)
        stats.alerts_sent[name] = stats.alerts_sent.get(name, 0) + 1
        if description in _WARNED_ALERTS:
            stats._warn_limited(name, self.get_extra_info("peername"))
        else:
            log.debug("TLS: sending alert %s to %s", name, self.get_extra_info("peername"))
        self._state = _CLOSING
        self._tcp.write(self._seal(bytes((2, description, _ALERT))))
        self._forget_secrets()
        self._tcp.close()
