"""The TLS 1.3 record layer (RFC 8446 5): sealing the application's data, opening the peer's records.

A record's nonce is the IV xor its sequence number (5.3); its plaintext ends with the content type
and optional zero padding (5.2, 5.4), at most 2^14 bytes (5.1), ciphertext at most 2^14 + 256
(record_overflow past it). A record header with another content type than application_data is
refused at the header, before the record it announces has come (5.1: after the handshake every
record is protected). Our own key is updated well before the AES-GCM limit of 5.5
(:data:`KEY_UPDATE_AFTER`). A cipher object exists only while the connection is active: the
listener's sweep (base.Listener.sweep) drops those unused since the previous sweep, so an idle
connection holds keys and IVs, not OpenSSL or ``cryptography`` objects.

Flood limits, as OpenSSL's or stricter: :data:`RECORD_RATE` records opened a second per connection
(a ``KeyUpdate`` weighs :data:`HANDSHAKE_RECORD_COST`; past it the connection is not read for a
while, nothing is dropped), :data:`MAX_EMPTY_RECORDS` empty records in a row.
"""

from __future__ import annotations

import logging
import ssl
from typing import TYPE_CHECKING, Any, cast

from cryptography.exceptions import InvalidTag

from migratory.server.transport.raw import RawTransport
from migratory.server.transport.tls import stats
from migratory.server.transport.tls.alerts import _BAD_RECORD_MAC, _RECORD_OVERFLOW, _UNEXPECTED_MESSAGE
from migratory.server.transport.tls.base import (
    _ALERT,
    _APPLICATION_DATA,
    _CLOSING,
    _HANDSHAKE,
    _HEADER,
    _OPENSSL,
    _RECORDS,
    Base,
)
from migratory.server.transport.tls.keys import Aead, wipe

if TYPE_CHECKING:
    from migratory.server.transport._tlsseal import Sealer

__all__ = ["KEY_UPDATE_AFTER", "MAX_CIPHERTEXT", "MAX_PLAINTEXT", "RECORD_BURST", "RECORD_RATE", "Records"]

log = logging.getLogger("migratory.server.tls")  # one logger for the whole layer, as before the split

KEY_UPDATE_AFTER = 1 << 24
"""Records sent under one key before we update it (RFC 8446 5.5 allows 2^24.5 for AES-GCM)."""

MAX_CIPHERTEXT = (1 << 14) + 256
MAX_PLAINTEXT = 1 << 14
MAX_EMPTY_RECORDS = 32
"""Consecutive empty records allowed, as OpenSSL's ``MAX_EMPTY_RECORDS``: the 33rd gets ``unexpected_message``."""
RECORD_RATE = 1 << 16
"""Records a second one connection's peer may have opened, sustained (a ``KeyUpdate`` counts as
:data:`HANDSHAKE_RECORD_COST`); past it the connection is not read until the allowance has grown
again (nothing is dropped). A peer flooding tiny records (1 byte, or empty) or ``KeyUpdate`` requests
costs at most about a tenth of a core (1.6 us to open a 1-byte record, 13 us a ``KeyUpdate``, on the
machine of bench/tls.md); bulk data (16 KB records) would need 1 GB/s to meet it."""
RECORD_BURST = 1 << 12
"""Records opened at once before :data:`RECORD_RATE` applies: more than one 64 KB read of the smallest ones."""
HANDSHAKE_RECORD_COST = 8
"""What a handshake record (a ``KeyUpdate``: three HKDF expansions, a new cipher) counts in :data:`RECORD_RATE`."""


class Records(Base):
    """One connection's records on the lean record layer, and the application's writes."""

    __slots__ = ()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Encrypt ``data`` (one record up to 16 KB) and hand it to TCP in one write."""
        tcp = self._tcp
        if self._state == _RECORDS and 0 < len(data) <= MAX_PLAINTEXT:
            # the fan-out's path, inlined: one record, one TCP write
            assert tcp is not None
            if self._owed:  # a KeyUpdate answer goes before our next application data (RFC 8446 4.6.3)
                self._pay_key_update()
                if self._state != _RECORDS:
                    return
            if not self._hot:
                self._hold()
            server = self._server
            if data is server._frame:
                inner, header = server._inner, server._header
            else:
                inner, header = server.inner(data)
            seq = self._wseq
            self._wseq = seq + 1
            if self._c:
                sealer = self._sealer
                if sealer is None:
                    sealer = self._new_sealer()
                if type(tcp) is RawTransport and tcp._buffer is None and not tcp._closing:
                    # sealed and written in one C call; RawTransport keeps what the socket did not take
                    try:
                        rest = sealer.send(tcp.fd, seq, inner, header)
                    except OSError as exc:
                        tcp._fail(exc)
                        return
                    if rest is not None:
                        tcp._keep(rest)
                else:
                    tcp.write(sealer.seal(seq, inner, header))
            else:
                enc = self._enc
                if enc is None:
                    enc = self._new_enc()
                tcp.write(header + enc.encrypt((self._wiv ^ seq).to_bytes(12, "big"), inner, header))
            if seq + 1 >= KEY_UPDATE_AFTER:
                tcp.write(self._update_write_key(requested=False))
            return
        if self._state == _RECORDS:
            assert tcp is not None
            if self._owed and data:
                self._pay_key_update()
            view = memoryview(data)
            tcp.write(
                b"".join(
                    self._sealed(bytes(view[i : i + MAX_PLAINTEXT]) + b"\x17")
                    for i in range(0, len(view), MAX_PLAINTEXT)
                )
            )
        elif self._state == _OPENSSL and data:
            assert self._ssl is not None and self._outgoing is not None and tcp is not None
            try:
                self._ssl.write(data)
            except ssl.SSLError as exc:
                self._fail(exc)
                return
            tcp.write(self._outgoing.read())

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def _hold(self) -> None:
        self._hot = True
        if not self._held:
            self._held = True
            self._server.hold(self)

    def _release(self) -> None:
        """Idle: drop the cipher objects (1 to 2.3 KB of heap each); the secrets, keys and IVs stay."""
        self._enc = self._dec = self._sealer = None
        self._held = self._hot = False
        if self._state >= _CLOSING:
            self._forget_secrets()

    def _forget_secrets(self) -> None:
        """The connection is done with its keys: zeros over the secrets' and keys' buffers, then none kept."""
        self._enc = self._dec = self._sealer = None
        for buffer in (self._wsecret, self._rsecret, self._wkey, self._rkey):
            wipe(buffer)
        self._wipe_spent()
        self._wsecret = self._rsecret = self._wkey = self._rkey = b""

    def _retire(self, secret: bytes | bytearray) -> None:
        """A traffic secret a KeyUpdate replaced: wiped at the next sweep (or sooner: one is kept at most)."""
        self._wipe_spent()
        if isinstance(secret, bytearray):
            self._spent = secret

    def _wipe_spent(self) -> None:
        spent = self._spent
        if spent is not None:
            self._spent = None
            wipe(spent)

    def _new_enc(self) -> Aead:
        """The write cipher object again, from the kept key (after a sweep or a key update)."""
        assert self._suite is not None
        enc = self._enc = self._suite.aead(self._wkey)
        return enc

    @property
    def write_cipher(self) -> Aead | Sealer | None:
        """The write cipher object held now (the C sealer or the Python AEAD); None while idle."""
        return self._sealer if self._c else self._enc

    def _new_sealer(self) -> Sealer:
        """The C write sealer again, from the kept key and IV (after a sweep or a key update)."""
        assert self._server.sealer is not None
        key = cast(bytes, self._wkey)  # a bytearray (wiped at the end): the C type takes any buffer
        sealer = self._sealer = self._server.sealer(key, self._wiv.to_bytes(12, "big"))
        return sealer

    def _seal(self, inner: bytes) -> bytes:
        """One record: ``inner`` is the plaintext followed by its content type."""
        if not self._hot:
            self._hold()
        seq = self._wseq
        self._wseq = seq + 1
        header = _HEADER.pack(_APPLICATION_DATA, 0x0303, len(inner) + 16)
        if self._c:
            return (self._sealer or self._new_sealer()).seal(seq, inner, header)
        enc = self._enc
        if enc is None:
            enc = self._new_enc()
        return header + enc.encrypt((self._wiv ^ seq).to_bytes(12, "big"), inner, header)

    def _sealed(self, inner: bytes) -> bytes:
        """:meth:`_seal`, then a key update of our own when this key has sealed enough records."""
        record = self._seal(inner)
        if self._wseq >= KEY_UPDATE_AFTER:
            record += self._update_write_key(requested=False)
        return record

    def _records_in(self, data: bytes) -> None:
        """Open the peer's records: at most what :data:`RECORD_RATE` allows now, the rest waits (not read)."""
        if not self._rsecret:  # the peer's close_notify came: whatever follows is ignored (RFC 8446 6.1)
            return
        buf = self._rbuf + data if self._rbuf else data
        self._rbuf = b""  # what is left is kept only if all went well (not after a fatal alert)
        pos = 0
        end = len(buf)
        plain: list[bytes] = []
        suite = self._suite
        assert suite is not None
        now = self._server.loop.time()
        start = self._tat if self._tat > now else now
        room = RECORD_BURST - (start - now) * RECORD_RATE  # records that may be opened now
        used = 0
        while end - pos >= 5:
            kind = buf[pos]
            length = (buf[pos + 3] << 8) | buf[pos + 4]
            if kind != _APPLICATION_DATA:  # refused at its header, not once the record it announces has come
                self._alert(_UNEXPECTED_MESSAGE, plain)
                return
            if length > MAX_CIPHERTEXT:
                self._alert(_RECORD_OVERFLOW, plain)
                return
            if end - pos - 5 < length:
                break
            if used >= room:  # the rest waits for the allowance to grow (_throttle)
                break
            used += 1
            header = buf[pos : pos + 5]
            body = buf[pos + 5 : pos + 5 + length]
            pos += 5 + length
            dec = self._dec
            if dec is None:
                dec = self._dec = suite.aead(self._rkey)
            if not self._hot:
                self._hold()
            seq = self._rseq
            try:
                inner = dec.decrypt((self._riv ^ seq).to_bytes(12, "big"), body, header)
            except InvalidTag:
                stats.counters["bad_record_mac"] += 1
                self._alert(_BAD_RECORD_MAC, plain)
                return
            self._rseq = seq + 1
            if len(inner) > MAX_PLAINTEXT + 1:
                self._alert(_RECORD_OVERFLOW, plain)
                return
            content_type = inner[-1] if inner else 0
            if content_type == 0:
                inner = inner.rstrip(b"\x00")
                content_type = inner[-1] if inner else 0
            if self._hbuf and content_type != _HANDSHAKE:
                # a handshake message split over records has nothing between its parts (RFC 8446 5.1)
                self._alert(_UNEXPECTED_MESSAGE, plain)
                return
            if content_type == _APPLICATION_DATA:
                if len(inner) > 1:
                    plain.append(inner[:-1])
                    self._warnings = self._empty = 0
                else:  # an empty record: allowed, but not without end (OpenSSL's MAX_EMPTY_RECORDS)
                    self._empty += 1
                    if self._empty > MAX_EMPTY_RECORDS:
                        log.debug("TLS: too many empty records from %s", self.get_extra_info("peername"))
                        self._alert(_UNEXPECTED_MESSAGE, plain)
                        return
            elif content_type == _ALERT:
                self._empty = 0
                if not self._alert_received(inner[:-1], plain):
                    return
            elif content_type == _HANDSHAKE:
                self._empty = 0
                used += HANDSHAKE_RECORD_COST - 1
                if not self._post_handshake(inner[:-1], plain):
                    return
            else:
                self._alert(_UNEXPECTED_MESSAGE, plain)
                return
        self._tat = start + used / RECORD_RATE
        self._rbuf = buf[pos:] if pos < end else b""
        self._deliver(plain)
        if self._state != _RECORDS:
            return
        if self._owed and not self._paused:
            self._pay_key_update()  # one answer for every update_requested of this read
        if used >= room and end - pos >= 5:
            self._throttle(now)

    def _throttle(self, now: float) -> None:
        """Past RECORD_RATE: stop reading until half of RECORD_BURST is allowed again (what is read waits)."""
        if self._timer is not None:
            return
        delay = self._tat - now - (RECORD_BURST // 2) / RECORD_RATE
        self._timer = self._server.loop.call_later(max(delay, 0.001), self._unthrottle)
        self._update_reading()

    def _unthrottle(self) -> None:
        self._timer = None
        if self._reading:  # else resume_reading catches up
            self._catch_up()
        self._update_reading()

    def _deliver(self, plain: list[bytes]) -> None:
        if plain and self._state == _RECORDS:
            self._protocol.data_received(plain[0] if len(plain) == 1 else b"".join(plain))
        plain.clear()
