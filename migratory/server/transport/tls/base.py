"""What every part of a TLS connection shares: its states, its fields, the record header, its listener.

A connection (:class:`migratory.server.transport.tls.transport.TLSTransport`) is one state machine
over one set of buffers and keys, written as mixins by concern (records.py, alerts.py,
keyupdate.py, takeover.py, openssl.py) over :class:`Base`, which holds every field (one
``__slots__``: an idle connection is one slotted instance) and declares, for the type checker, the
methods one concern calls in another. :class:`Listener` is what the connections of one listener
share: the context, the C sealer, the cipher-object sweep, the last frame's record plaintext.
The record header and content types are RFC 8446 5.1's.
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

from migratory.server.transport import heap
from migratory.server.transport.raw import RawTransport
from migratory.server.transport.tls.keys import Aead, _Suite

if TYPE_CHECKING:
    from migratory.server.transport._tlsseal import Sealer

__all__ = ["SWEEP_SECONDS", "TRIM_AFTER", "Base", "Listener"]

SWEEP_SECONDS = 2.0
"""Cipher objects unused for between one and two sweeps are dropped (idle connections hold none)."""
TRIM_AFTER = 64
"""A sweep gives the C heap's free pages back (:func:`migratory.server.transport.heap.trim`) once this many
OpenSSL or cipher objects were freed since the last time: a handful of reconnections costs no heap walk."""

_HEADER = struct.Struct("!BHH")
"""A record's header (RFC 8446 5.1): content type, legacy version, length."""
_APPLICATION_DATA = 23
_ALERT = 21
_HANDSHAKE = 22
_KEY_UPDATE = 24

# transport states
_HANDSHAKING = 0
_RECORDS = 1  # TLS 1.3 records by this module
_OPENSSL = 2  # records by the SSLObject
_CLOSING = 3
_CLOSED = 4


class Listener:
    """What the connections of one listener share; :class:`migratory.server.transport.tls.server.TLSServer` adds
    the policy (whether the lean record layer may carry them) and makes the connections."""

    __slots__ = (
        "_active",
        "_frame",
        "_freed",
        "_header",
        "_inner",
        "_sweeping",
        "context",
        "factory",
        "handshake_timeout",
        "lean",
        "loop",
        "max_pending",
        "sealer",
    )

    def __init__(
        self,
        context: ssl.SSLContext,
        factory: Callable[[], asyncio.Protocol],
        handshake_timeout: float,
        loop: asyncio.AbstractEventLoop,
        *,
        lean: bool,
        max_pending: int | None = None,
    ) -> None:
        self.context = context
        self.factory = factory
        self.handshake_timeout = handshake_timeout
        self.loop = loop
        # the output limit TLS-level output counts against (TLSTransport._output_limit); None: the
        # application protocol's own (a Connection's MaxPendingOutput)
        self.max_pending = max_pending
        self.lean = lean  # the lean record layer may take this listener's TLS 1.3 connections over
        self.sealer: type[Sealer] | None = None  # AES-GCM records sealed in C (set by the listener's policy)
        self._active: list[Base] = []  # connections holding a cipher object
        self._sweeping: asyncio.TimerHandle | None = None
        self._freed = 0  # OpenSSL objects and cipher objects freed since the heap was last trimmed
        # the last frame written, with its record plaintext and header (see inner)
        self._frame = b""
        self._inner = b""
        self._header = b""

    def hold(self, transport: Base) -> None:
        """``transport`` now holds a cipher object: the sweep will look at it."""
        self._active.append(transport)
        if self._sweeping is None:
            self._sweeping = self.loop.call_later(SWEEP_SECONDS, self.sweep)

    def sweep(self) -> None:
        """Drop the cipher objects of connections that used none since the previous sweep.

        Also wipes the traffic secrets that ``KeyUpdate`` messages replaced since the last sweep
        (:meth:`TLSTransport._retire`), and the secrets of connections that have ended.
        """
        self._sweeping = None
        keep: list[Base] = []
        for transport in self._active:
            transport._wipe_spent()  # traffic secrets a KeyUpdate replaced since the last sweep
            if transport._hot and transport._state == _RECORDS:
                transport._hot = False
                keep.append(transport)
            else:
                transport._release()
                self._freed += 1
        self._active = keep
        if self._freed >= TRIM_AFTER:
            self._freed = 0
            heap.trim()  # after a connection storm: the handshakes' freed memory back to the system
        if keep:
            self._sweeping = self.loop.call_later(SWEEP_SECONDS, self.sweep)

    def inner(self, data: bytes | bytearray | memoryview) -> tuple[bytes, bytes]:
        """The record plaintext (``data`` and its content type) and the record header, for one record.

        A message is written to every subscriber as the same ``bytes`` object, so both are
        made once per message and shared by every connection of this listener: only the
        sealing is per connection.
        """
        if data is self._frame:
            return self._inner, self._header
        if type(data) is not bytes:  # mutable: not kept
            inner = bytes(data) + b"\x17"
            return inner, _HEADER.pack(_APPLICATION_DATA, 0x0303, len(inner) + 16)
        self._inner = inner = data + b"\x17"
        self._header = header = _HEADER.pack(_APPLICATION_DATA, 0x0303, len(inner) + 16)
        self._frame = data
        return inner, header

    @property
    def holding(self) -> int:
        """Connections holding a cipher object now."""
        return len(self._active)


class Base(asyncio.Transport, asyncio.Protocol):
    """The fields of one TLS connection, and the methods its concerns call in one another."""

    __slots__ = (
        "_c",
        "_dec",
        "_empty",
        "_enc",
        "_hbuf",
        "_held",
        "_hot",
        "_incoming",
        "_made",
        "_outgoing",
        "_owed",
        "_paused",
        "_protocol",
        "_rbuf",
        "_reading",
        "_riv",
        "_rkey",
        "_rsecret",
        "_rseq",
        "_sealer",
        "_server",
        "_spent",
        "_ssl",
        "_sslp",
        "_state",
        "_suite",
        "_tat",
        "_tcp",
        "_timer",
        "_warnings",
        "_wiv",
        "_wkey",
        "_wsecret",
        "_wseq",
    )

    def __init__(self, server: Listener, protocol: asyncio.Protocol) -> None:
        self._server = server
        self._protocol = protocol
        self._tcp: asyncio.Transport | RawTransport | None = None
        self._state = _HANDSHAKING
        self._made = False
        self._ssl: ssl.SSLObject | None = None
        self._incoming: ssl.MemoryBIO | None = None
        self._outgoing: ssl.MemoryBIO | None = None
        # the handshake's timeout; after it, the wait of a peer that sent more records than RECORD_RATE allows
        self._timer: asyncio.TimerHandle | None = None
        self._suite: _Suite | None = None
        # the traffic secrets (bytearrays from the keylog hook, wiped when done with: _forget_secrets)
        self._wsecret: bytes | bytearray = b""
        self._rsecret: bytes | bytearray = b""
        self._spent: bytearray | None = None  # the secret a KeyUpdate replaced, wiped at the next sweep
        self._wseq = 0
        self._rseq = 0
        self._enc: Aead | None = None  # the write cipher when sealing in Python (see _c)
        self._dec: Aead | None = None
        self._c = False  # AES-GCM and the C sealer built: writes go through _sealer, not _enc
        self._sealer: Sealer | None = None
        self._wiv = 0
        self._riv = 0
        self._wkey: bytes | bytearray = b""  # the AEAD keys, kept while idle (the cipher objects are not)
        self._rkey: bytes | bytearray = b""
        self._rbuf = b""
        self._hbuf = b""  # the start of a handshake message whose end is in a later record (RFC 8446 5.1)
        self._warnings = 0  # user_canceled alerts since the last non-empty record of another type
        self._empty = 0  # empty records since the last non-empty one (MAX_EMPTY_RECORDS)
        self._sslp: int | None = None  # OpenSSL's SSL * while handshaking (from the keylog callback), else None
        self._hot = False
        self._held = False
        self._owed = 0  # KeyUpdate answers to send before our next record (RFC 8446 4.6.3), one per request
        self._paused = False  # TCP asked us to stop writing (its buffer is over its high-water mark)
        self._reading = True  # what the application asked (pause_reading, resume_reading)
        self._tat = 0.0  # when the records read so far are paid for at RECORD_RATE (loop time)

    if TYPE_CHECKING:  # implemented by the mixins (records.py, alerts.py, keyupdate.py, openssl.py, transport.py)

        def _records_in(self, data: bytes) -> None: ...
        def _seal(self, inner: bytes) -> bytes: ...
        def _hold(self) -> None: ...
        def _release(self) -> None: ...
        def _forget_secrets(self) -> None: ...
        def _retire(self, secret: bytes | bytearray) -> None: ...
        def _wipe_spent(self) -> None: ...
        def _deliver(self, plain: list[bytes]) -> None: ...
        def _throttle(self, now: float) -> None: ...
        def _new_sealer(self) -> Sealer: ...
        def _new_enc(self) -> Aead: ...
        def _alert(self, description: int, plain: list[bytes]) -> None: ...
        def _alert_received(self, content: bytes, plain: list[bytes]) -> bool: ...
        def _post_handshake(self, content: bytes, plain: list[bytes]) -> bool: ...
        def _pay_key_update(self) -> None: ...
        def _update_write_key(self, *, requested: bool) -> bytes: ...
        def _openssl_in(self) -> None: ...
        def _flush_openssl(self) -> None: ...
        def _fail(self, exc: Exception) -> None: ...
        def _within_limit(self) -> bool: ...
        def _update_reading(self) -> None: ...
        def _catch_up(self) -> None: ...
