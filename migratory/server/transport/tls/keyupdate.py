"""KeyUpdate (RFC 8446 4.6.3, 7.2): the peer's, answered one for one, and our own.

A ``KeyUpdate`` is the only handshake message after the handshake this server accepts (no
post-handshake authentication is asked, and a client sends no ``NewSessionTicket``); it may be split
over records (5.1), must end its record, and its request value is 0 or 1. Each
``update_requested`` gets its own answer, whatever the segmentation of the peer's bytes: at once
while TCP takes what we write, else held back (not sealed) until it takes more or before our next
record. At most :data:`MAX_OWED_KEY_UPDATES` answers wait; past it the requests share the last one,
as 4.6.3 allows an implementation that is silent, so a peer that floods and does not read costs a
bounded amount. A replaced read or write key is wiped at once, the secret it came from at the next
sweep (at most one waits). Our own updates come after :data:`migratory.server.transport.tls.records.KEY_UPDATE_AFTER`
records (5.5).
"""

from __future__ import annotations

from migratory.server.transport.tls.alerts import _DECODE_ERROR, _ILLEGAL_PARAMETER, _UNEXPECTED_MESSAGE
from migratory.server.transport.tls.base import _HANDSHAKE, _KEY_UPDATE, _RECORDS, Base
from migratory.server.transport.tls.keys import wipe

__all__ = ["MAX_OWED_KEY_UPDATES", "KeyUpdates"]

MAX_OWED_KEY_UPDATES = 64
"""``KeyUpdate`` requests answered one by one while their answers wait (TCP not taking more); past it they share one."""
_KEY_UPDATE_SIZE = 5 + 6 + 16
"""A KeyUpdate record on the wire: header, message and content type, AEAD tag."""


class KeyUpdates(Base):
    """The key updates of one connection on the lean record layer."""

    __slots__ = ()

    def _post_handshake(self, content: bytes, plain: list[bytes]) -> bool:
        """A handshake record after the handshake; False once the connection is done with.

        Only ``KeyUpdate`` may come (this server asks for no post-handshake authentication, and a
        client sends no ``NewSessionTicket``): any other message type gets ``unexpected_message``
        as soon as its first byte is read. A message may be split over several records (RFC 8446
        5.1), so up to the 5 bytes of a ``KeyUpdate`` wait in ``_hbuf`` for the next record; since
        a key change must end its record, bytes after a ``KeyUpdate`` in the same record get
        ``unexpected_message`` too. A ``KeyUpdate`` whose length is not 1 gets ``decode_error``,
        one with a request value other than 0 or 1 ``illegal_parameter``.
        """
        if not content:  # handshake records are never empty (RFC 8446 5.1)
            self._alert(_UNEXPECTED_MESSAGE, plain)
            return False
        self._warnings = 0
        message = self._hbuf + content if self._hbuf else content
        self._hbuf = b""
        if message[0] != _KEY_UPDATE:
            self._alert(_UNEXPECTED_MESSAGE, plain)
            return False
        if message[1:4] != b"\x00\x00\x01"[: len(message) - 1]:  # its length, as far as it has come
            self._alert(_DECODE_ERROR, plain)
            return False
        if len(message) < 5:
            self._hbuf = message  # the rest comes in the next record
            return True
        if len(message) > 5:
            self._alert(_UNEXPECTED_MESSAGE, plain)
            return False
        requested = message[4]
        if requested > 1:
            self._alert(_ILLEGAL_PARAMETER, plain)
            return False
        self._dec = None
        self._rsecret, self._rkey, self._riv = self._next_keys(self._rsecret, self._rkey)
        self._rseq = 0
        if requested:
            # one answer per request, however the requests fell into reads and records: at once while TCP
            # takes what we write, else once it takes more (resume_writing) or before our next record; past
            # MAX_OWED_KEY_UPDATES waiting (a peer that floods and does not read) the rest share the last
            # answer, as RFC 8446 4.6.3 allows ("an implementation which receives multiple KeyUpdates while
            # it is silent" may send one), so what is owed stays bounded
            self._owed = min(self._owed + 1, MAX_OWED_KEY_UPDATES)
            if self._paused:
                return self._within_limit()
            self._pay_key_update()
        return self._state == _RECORDS

    def _update_write_key(self, *, requested: bool) -> bytes:
        """A KeyUpdate under the current key, then the next key from sequence number 0."""
        record = self._seal(bytes((_KEY_UPDATE, 0, 0, 1, 1 if requested else 0, _HANDSHAKE)))
        self._enc = self._sealer = None
        self._wsecret, self._wkey, self._wiv = self._next_keys(self._wsecret, self._wkey)
        self._wseq = 0
        return record

    def _next_keys(self, secret: bytes | bytearray, key: bytes | bytearray) -> tuple[bytearray, bytearray, int]:
        """One direction's next traffic secret, key and IV (RFC 8446 7.2, 7.3): the replaced key is wiped at
        once, the replaced secret at the next sweep (:meth:`_retire`)."""
        assert self._suite is not None
        following = bytearray(self._suite.next_secret(secret))
        self._retire(secret)
        wipe(key)
        new_key, iv = self._suite.keys(following)
        return following, bytearray(new_key), iv

    def _pay_key_update(self) -> None:
        """One KeyUpdate of ours for every ``update_requested`` received since the last answers (RFC 8446 4.6.3),
        each under the key the one before it installed, in one TCP write."""
        owed, self._owed = self._owed, 0
        if self._state == _RECORDS and self._tcp is not None and owed:
            self._tcp.write(b"".join(self._update_write_key(requested=False) for _ in range(owed)))
