"""A lean TLS server transport: OpenSSL for the handshake, then a small TLS 1.3 record layer.

Why not ``loop.create_server(ssl=...)``: measured as the PSS slope between 8,000
and 16,000 idle TLS 1.3 connections (bench/tls.md, ``migratory.bench.tlsprobe``),
uvloop's ``SSLProtocol`` costs 25.7 KB per idle connection against 1.2 KB without
TLS. About 7 KB of that is the event loop's TLS transport (its per-connection read
buffer and protocol objects) beside OpenSSL's ``SSL`` object. The ``SSL`` object
itself is the floor of anything that keeps OpenSSL on an established connection:
with ``SSL_MODE_RELEASE_BUFFERS`` (CPython already sets it on every context: no
record buffers stay while idle), an OpenSSL 3.0 ``SSL`` with its two memory BIOs
still takes 17.0 KB of heap after a TLS 1.3 handshake (9.4 KB before any byte:
the structure, its record-layer arrays, copies of the context's certificate and
cipher lists; 18.4 KB per connection as the PSS slope of a server that keeps it).
Neither fits in the 6 KB per idle connection that issue 19 asks for.

So this transport keeps OpenSSL only while it is needed:

* **Handshake**: a plain TCP protocol feeds an ``SSLObject`` made by
  :meth:`ssl.SSLContext.wrap_bio` over two :class:`ssl.MemoryBIO`. Every TLS
  feature stays OpenSSL's, from the same ``SSLContext``: certificate chain (and
  its reload on SIGHUP into that context), ``TLSMinVersion``, ``TLSCiphers``,
  ALPN, session tickets, alerts. ``HandshakeTimeout`` runs from the TCP
  connection until the handshake ends. The application protocol
  (:class:`migratory.server.sessions.connection.Connection`) sees ``connection_made``
  only after it.
* **Established TLS 1.3** (``TLS_AES_128_GCM_SHA256``, ``TLS_AES_256_GCM_SHA384``,
  ``TLS_CHACHA20_POLY1305_SHA256``): the ``SSL`` object and its BIOs are freed;
  the connection keeps the two traffic secrets (for ``KeyUpdate``), the two
  keys and IVs derived from them, and two sequence numbers, and
  this module runs the record protocol of RFC 8446 section 5 (nonce = IV xor
  sequence number, inner content type, padding, 2^14-byte records, alerts,
  ``KeyUpdate`` both ways, a key update of our own well before the AES-GCM
  limit of section 5.5). The AEAD is OpenSSL's EVP code: AES-GCM records are sealed
  by the C extension ``_tlsseal.c`` (header, nonce, ciphertext and tag in one call,
  and on the workers' epoll set the socket write too: the fan-out's path, see
  :meth:`TLSTransport.write`), everything else (reading, ChaCha20-Poly1305, and
  AES-GCM when the extension was not built) by ``cryptography``. A cipher object
  (1 to 2.3 KB of heap) exists only while the connection is
  active: a sweep every :data:`SWEEP_SECONDS` drops those unused since the
  previous sweep, as ``SSL_MODE_RELEASE_BUFFERS`` drops idle record buffers. An
  idle connection is then this object (one slotted instance), two secrets of
  32 or 48 bytes, two keys of 16 or 32 bytes and the TCP transport; waking up
  costs one ``AESGCM(key)`` (about 1 us), not the HKDF expansions again.
* **Anything else** (TLS 1.2, another TLS 1.3 suite, secrets that could not be
  obtained): the ``SSLObject`` stays and carries the records, as the event loop's
  transport would, without its 256 KB buffer. So does a TLS 1.3 connection whose
  negotiated state is not one this record layer implements, or cannot be read (fail
  closed, :meth:`TLSTransport._refusal`): a max_fragment_length (RFC 6066) limit,
  early data, records OpenSSL holds unread. Each such connection is counted by reason in
  :data:`fallbacks` and logged (INFO the 1st, 2nd, 4th... time per reason).

**How the secrets are obtained.** OpenSSL hands each traffic secret of a
handshake to the context's *keylog callback* (``SSL_CTX_set_keylog_callback``,
the hook behind ``SSLKEYLOGFILE``). CPython exposes only a file for it, so
:func:`enable` sets the callback on the context's ``SSL_CTX`` through ctypes,
resolving libssl's symbols through the ``_ssl`` extension itself (so the very
library it is linked with). The ``SSL_CTX`` pointer is read from the
``_ssl._SSLContext`` object (right after its object header, CPython's layout
since 3.7; only tried on the CPython versions in :data:`LAYOUT_VERSIONS`, since
checking a pointer means libssl dereferencing it) and is trusted only after
checking it: ``SSL_CTX_get_options`` and ``SSL_CTX_get_verify_mode`` through
libssl must equal ``context.options`` and ``context.verify_mode``, and an option
flipped through Python (and flipped back) must show through libssl. On any other
interpreter, version or library, or if a check fails, :func:`enable` returns
False and every connection takes the third path above: correct, just heavier. The operator can choose that path too:
``TLSLeanTransport = false``. The secrets are only ever held by the
connection they belong to, as OpenSSL would hold them; nothing is written
anywhere. The callback runs inside ``do_handshake`` on the event loop's thread,
which names the connection being handshaken (``_Capture.target``, set only for a
lean listener's connections). Its first argument,
that handshake's ``SSL *``, is kept until the handshake ends: through it libssl tells
what was negotiated (:meth:`TLSTransport._refusal`), so nothing is taken over on a guess.
Of the lines OpenSSL logs, only ``SERVER_TRAFFIC_SECRET_0`` and ``CLIENT_TRAFFIC_SECRET_0``
(TLS 1.3's; TLS 1.2 logs neither) are kept, parsed from OpenSSL's own buffer straight into
``bytearray`` objects (no ``bytes`` or ``str`` copy), as are the keys derived from them; all are
overwritten with zeros (:func:`wipe`) as soon as the connection no longer needs them: when it stays
on OpenSSL's record layer, when its handshake fails or times out, when it sends or receives
close_notify or a fatal alert, when it is aborted or lost. A key a ``KeyUpdate`` replaces is wiped
at once; the traffic secret it replaces at the next sweep (at most one waits). What cannot be
wiped: the short-lived ``bytes`` that ``hmac`` returns inside :func:`expand_label`, and the
cipher objects' own copies (freed by OpenSSL and ``cryptography``, which cleanse them).

**Backpressure** (review of issue 31, D5). Whatever a peer sends may ask for output: a
request of the application, a ``KeyUpdate`` with ``update_requested``, records OpenSSL answers.
So a connection is not read while TCP cannot take more of its output (``pause_writing``: the
transport's buffer is over its high-water mark), as ``openssl s_server`` does; each ``KeyUpdate``
request gets its own answer (RFC 8446 4.6.3), at once while TCP takes what we write, else held back
(not sealed) while TCP is paused, at most :data:`MAX_OWED_KEY_UPDATES` of them; what TLS holds back
(that answer, OpenSSL's records in its outgoing BIO) counts against the connection's output
limit together with the application's own queue (``MaxPendingOutput``, see
:meth:`TLSTransport._within_limit`). A peer flooding tiny records meets :data:`RECORD_RATE`
(records opened per second, a ``KeyUpdate`` weighing :data:`HANDSHAKE_RECORD_COST`; past it the
connection is not read for a while) and :data:`MAX_EMPTY_RECORDS` (OpenSSL's limit).

**Start-up self-tests and the supported matrix.** Before the first take-over, once per process,
:func:`lean_verdict` checks the interpreter and library (:func:`outside_matrix`: CPython in
:data:`LAYOUT_VERSIONS`, OpenSSL 3, not in FIPS mode) and runs :func:`run_selftests` (known
answers of both sealers, a loopback handshake); if either fails, every listener keeps OpenSSL's
record layer, said in one WARNING line.

**Counters** (review of issue 31, item 6). Each process counts, in module-level dictionaries (no
memory per connection): connections taken over (``counters["lean_connections"]``), connections
left on OpenSSL's record layer by reason (:data:`fallbacks`), alerts the lean record layer sent and
received by RFC 8446 name (:data:`alerts_sent`, :data:`alerts_received`), records whose AEAD tag
did not verify (``counters["bad_record_mac"]``) and failed handshakes
(``counters["handshake_failures"]``). The monitor copies them into the worker's shared slot once a
second, and ``/metrics`` sums them over the node's workers (``migratory_tls_*``, docs/security.md).
A record-layer failure (``bad_record_mac``, ``decode_error``, ``record_overflow`` sent) is logged
at WARNING with the peer, at most once a minute per cause (:data:`WARN_EVERY`), else at DEBUG.

The sequence number of the server's first application record is not guessed:
the records OpenSSL writes in the call that completes the handshake (its
``NewSessionTicket`` messages) are decrypted with the server secret, and only if
each is a handshake message at the expected sequence number does the transport
take over; otherwise it falls back to the ``SSLObject``. With ``read_ahead``
off (CPython's default) OpenSSL has read no record past the client's
``Finished``, so whatever is left in the incoming BIO is application data at
client sequence number 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import datetime
import hmac
import logging
import os
import platform
import socket
import ssl
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from migratory.server.transport import heap
from migratory.server.transport.raw import RawTransport

if TYPE_CHECKING:
    from migratory.server.transport._tlsseal import Sealer

__all__ = [
    "ALERT_LABELS",
    "ALERT_NAMES",
    "SWEEP_SECONDS",
    "TLSServer",
    "TLSTransport",
    "alerts_received",
    "alerts_sent",
    "counters",
    "enable",
    "fallbacks",
    "lean_verdict",
    "prefer_aes128",
    "run_selftests",
    "traffic_secret",
    "wipe",
]

log = logging.getLogger("migratory.server.tls")

SWEEP_SECONDS = 2.0
"""Cipher objects unused for between one and two sweeps are dropped (idle connections hold none)."""
TRIM_AFTER = 64
"""A sweep gives the C heap's free pages back (:func:`migratory.server.transport.heap.trim`) once this many
OpenSSL or cipher objects were freed since the last time: a handful of reconnections costs no heap walk."""

KEY_UPDATE_AFTER = 1 << 24
"""Records sent under one key before we update it (RFC 8446 5.5 allows 2^24.5 for AES-GCM)."""

MAX_CIPHERTEXT = (1 << 14) + 256
MAX_PLAINTEXT = 1 << 14
MAX_WARNING_ALERTS = 5
# KeyUpdate requests answered one by one while their answers wait (TCP not taking more); past it they share one
MAX_OWED_KEY_UPDATES = 64
"""Consecutive ``user_canceled`` alerts (TLS 1.3's only warning) that end the connection, as OpenSSL's
``MAX_WARN_ALERT_COUNT``: the fifth, with no non-empty record between them, gets a fatal ``unexpected_message``."""
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
DEFAULT_MAX_PENDING = 4 << 20
"""The output limit when neither the listener nor the application protocol has one (``MaxPendingOutput``'s default)."""
_HEADER = struct.Struct("!BHH")
_APPLICATION_DATA = 23
_ALERT = 21
_HANDSHAKE = 22
_KEY_UPDATE = 24

# alert descriptions (RFC 8446 6)
_CLOSE_NOTIFY = 0
_UNEXPECTED_MESSAGE = 10
_BAD_RECORD_MAC = 20
_RECORD_OVERFLOW = 22
_DECODE_ERROR = 50
_ILLEGAL_PARAMETER = 47
_USER_CANCELED = 90

_TLS1_3_VERSION = 0x0304
_SSL_EARLY_DATA_NOT_SENT = 0
_KEY_UPDATE_SIZE = 5 + 6 + 16
"""A KeyUpdate record on the wire: header, message and content type, AEAD tag."""

# transport states
_HANDSHAKING = 0
_RECORDS = 1  # TLS 1.3 records by this module
_OPENSSL = 2  # records by the SSLObject
_CLOSING = 3
_CLOSED = 4

Aead = AESGCM | ChaCha20Poly1305

fallbacks: dict[str, int] = {}
"""TLS connections of lean listeners left on OpenSSL's record layer, by reason (see :data:`FALLBACK_REASONS`).

Counted for this process since it started; a listener with ``TLSLeanTransport = false`` (or whose
context could not be hooked) counts nothing here: all its connections stay with OpenSSL by design.
"""

FALLBACK_REASONS = {
    "not_tls13": "not TLS 1.3",
    "suite": "a TLS 1.3 suite this record layer does not carry",
    "no_secrets": "its traffic secrets did not reach the keylog hook",
    "unverified": "what it negotiated could not be read from libssl",
    "max_fragment_length": "the client negotiated max_fragment_length (RFC 6066)",
    "early_data": "the client sent early data",
    "buffered": "OpenSSL holds records of it not yet read",
    "tickets": "OpenSSL's last flight was not the expected session tickets",
}
"""Why a connection stays on OpenSSL's record layer: the keys of :data:`fallbacks`, and what each means."""

ALERT_NAMES = {
    0: "close_notify",
    10: "unexpected_message",
    20: "bad_record_mac",
    22: "record_overflow",
    40: "handshake_failure",
    42: "bad_certificate",
    43: "unsupported_certificate",
    44: "certificate_revoked",
    45: "certificate_expired",
    46: "certificate_unknown",
    47: "illegal_parameter",
    48: "unknown_ca",
    49: "access_denied",
    50: "decode_error",
    51: "decrypt_error",
    70: "protocol_version",
    71: "insufficient_security",
    80: "internal_error",
    86: "inappropriate_fallback",
    90: "user_canceled",
    109: "missing_extension",
    110: "unsupported_extension",
    112: "unrecognized_name",
    113: "bad_certificate_status_response",
    115: "unknown_psk_identity",
    116: "certificate_required",
    120: "no_application_protocol",
}
"""The alert descriptions of RFC 8446 6, by code: the ``alert`` label of the alert counters."""
ALERT_LABELS = (*ALERT_NAMES.values(), "other")
"""Every value of the ``alert`` label: an RFC 8446 name, or ``other`` (a code RFC 8446 does not list)."""

counters: dict[str, int] = {"lean_connections": 0, "bad_record_mac": 0, "handshake_failures": 0, "selftest_failures": 0}
RECORD_LAYERS = ("none", "lean", "openssl", "openssl: outside the supported matrix", "openssl: a self-test failed")
"""What carries this process's TLS records after the handshake, as :data:`record_layer` numbers it: no TLS
listener yet; the lean layer; OpenSSL because ``TLSLeanTransport = false``; OpenSSL because the lean
layer turned itself off (:func:`lean_verdict`) - the last two a fallback an operator must hear of."""
record_layer = [0]  # an index into RECORD_LAYERS, set when this process's first TLS listener starts
"""This process's TLS counters since it started (the monitor copies them into the worker's slot):
``lean_connections``, connections the lean record layer took over; ``bad_record_mac``, records of
the peer whose AEAD tag did not verify; ``handshake_failures``, handshakes that failed (an error from
OpenSSL, or ``HandshakeTimeout`` passed)."""
alerts_sent: dict[str, int] = {}
"""Alerts the lean record layer sent, by name (:data:`ALERT_LABELS`): on OpenSSL's record layer, OpenSSL sends them."""
alerts_received: dict[str, int] = {}
"""Alerts the lean record layer received, by name (:data:`ALERT_LABELS`)."""

WARN_EVERY = 60.0
"""Seconds between two WARNING lines for one cause of record-layer failure (per process)."""
_warned: dict[str, list[float]] = {}  # cause -> [monotonic time of the last WARNING, failures not logged since]
_WARNED_ALERTS = frozenset({_BAD_RECORD_MAC, _DECODE_ERROR, _RECORD_OVERFLOW})


def _alert_name(description: int) -> str:
    return ALERT_NAMES.get(description, "other")


def _warn_limited(cause: str, peer: object) -> None:
    """A record-layer failure: WARNING, at most once per :data:`WARN_EVERY` seconds per cause; DEBUG otherwise."""
    now = time.monotonic()
    state = _warned.get(cause)
    if state is None or now - state[0] >= WARN_EVERY:
        skipped = int(state[1]) if state is not None else 0
        _warned[cause] = [now, 0]
        more = f" ({skipped} more since the last warning)" if skipped else ""
        log.warning("TLS: record-layer failure from %s: sending %s alert%s", peer, cause, more)
    else:
        state[1] += 1
        log.debug("TLS: record-layer failure from %s: sending %s alert", peer, cause)


class _Suite:
    """A TLS 1.3 cipher suite this module can carry: its AEAD, key length and hash."""

    __slots__ = ("aead", "hash", "hash_len", "key_len")

    def __init__(self, aead: type[AESGCM] | type[ChaCha20Poly1305], key_len: int, hash_name: str) -> None:
        self.aead = aead
        self.key_len = key_len
        self.hash = hash_name
        self.hash_len = 48 if hash_name == "sha384" else 32

    def keys(self, secret: bytes | bytearray) -> tuple[bytes, int]:
        """The key and the IV (as an integer) of a traffic secret.

        A connection keeps both: an idle connection's cipher object is rebuilt from the key
        (about 1 us) rather than from the secret (two HKDF expansions, 6 to 8 us more).
        """
        key = expand_label(secret, b"key", self.key_len, self.hash)
        iv = expand_label(secret, b"iv", 12, self.hash)
        return key, int.from_bytes(iv, "big")

    def cipher(self, secret: bytes | bytearray) -> tuple[Aead, int]:
        """The AEAD and the IV (as an integer) of a traffic secret."""
        key, iv = self.keys(secret)
        return self.aead(key), iv

    def next_secret(self, secret: bytes | bytearray) -> bytes:
        """The traffic secret after a KeyUpdate (RFC 8446 7.2)."""
        return expand_label(secret, b"traffic upd", self.hash_len, self.hash)


SUITES = {
    "TLS_AES_128_GCM_SHA256": _Suite(AESGCM, 16, "sha256"),
    "TLS_AES_256_GCM_SHA384": _Suite(AESGCM, 32, "sha384"),
    "TLS_CHACHA20_POLY1305_SHA256": _Suite(ChaCha20Poly1305, 32, "sha256"),
}


def expand_label(secret: bytes | bytearray, label: bytes, length: int, hash_name: str) -> bytes:
    """HKDF-Expand-Label(secret, label, "", length) of RFC 8446 7.1."""
    full = b"tls13 " + label
    info = length.to_bytes(2, "big") + bytes((len(full),)) + full + b"\x00"
    out = b""
    block = b""
    counter = 1
    while len(out) < length:
        block = hmac.digest(secret, block + info + bytes((counter,)), hash_name)
        out += block
        counter += 1
    return out[:length]


# --- the secrets, from OpenSSL's keylog callback ---------------------------------------


class _Capture:
    """Where the keylog callback puts the secrets: the connection now in ``do_handshake``."""

    target: TLSTransport | None = None


_KEYLOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
_SERVER_SECRET_LABEL = b"SERVER_TRAFFIC_SECRET_0 "
_CLIENT_SECRET_LABEL = b"CLIENT_TRAFFIC_SECRET_0 "
_HEX_VALUES = bytes(
    int(chr(c), 16) if chr(c) in "0123456789abcdefABCDEF" else 0xFF for c in range(256)
)  # an ASCII hex digit's value, 0xFF for anything else


def wipe(buffer: bytes | bytearray) -> None:
    """Overwrite a secret's buffer with zeros (a ``bytes`` cannot be, and is left to the garbage collector)."""
    if isinstance(buffer, bytearray) and buffer:
        buffer[:] = bytes(len(buffer))


def _unhex(digits: bytes | memoryview) -> bytearray | None:
    """The bytes that hex ``digits`` spell, in a new ``bytearray`` (no ``str`` or ``bytes`` copy on the way)."""
    count = len(digits) // 2
    if not count or len(digits) != 2 * count:
        return None
    out = bytearray(count)
    for i in range(count):
        high, low = _HEX_VALUES[digits[2 * i]], _HEX_VALUES[digits[2 * i + 1]]
        if high > 15 or low > 15:
            wipe(out)
            return None
        out[i] = high << 4 | low
    return out


def traffic_secret(line: bytes | memoryview) -> tuple[bool, bytearray] | None:
    """``(the server's?, secret)`` from a key log line of a TLS 1.3 application traffic secret, else None.

    The secret is the line's last field ("<label> <client random> <secret>"), parsed into a new
    ``bytearray`` for the caller to wipe; the server's own hook and the load generators' lean client
    (migratory/bench/leantls.py) both read OpenSSL's lines with it."""
    size = len(_SERVER_SECRET_LABEL)
    label = line[:size]
    server = label == _SERVER_SECRET_LABEL
    if not server and label != _CLIENT_SECRET_LABEL:
        return None
    start = len(line)
    while start > size and line[start - 1] != 0x20:
        start -= 1
    secret = _unhex(line[start:])
    return None if secret is None else (server, secret)


def _on_keylog(ssl_pointer: int | None, line: bytes | memoryview | None) -> None:
    """One line of OpenSSL's key log: the two application traffic secrets are kept, nothing else.

    Only while a lean listener's connection is in ``do_handshake`` (:attr:`_Capture.target`); only
    ``SERVER_TRAFFIC_SECRET_0`` and ``CLIENT_TRAFFIC_SECRET_0`` (TLS 1.3's; a TLS 1.2 handshake logs
    neither), each parsed into a ``bytearray`` the connection wipes once it no longer needs it
    (:meth:`TLSTransport._forget_secrets`). The handshake secrets and the exporter secret are never
    copied out of OpenSSL's line.
    """
    target = _Capture.target
    if target is None or not line:
        return
    # the SSL * this handshake runs on, as OpenSSL names it: its negotiated state is read through it
    # (TLSTransport._refusal); a second, different pointer in one handshake leaves none to trust
    if target._sslp is None:
        target._sslp = ssl_pointer or 0
    elif target._sslp != ssl_pointer:
        target._sslp = 0
    found = traffic_secret(line)
    if found is None:
        return
    server, secret = found
    if server:
        wipe(target._wsecret)
        target._wsecret = secret
    else:
        wipe(target._rsecret)
        target._rsecret = secret


def _from_openssl(ssl_pointer: int | None, line_pointer: int | None) -> None:
    """The keylog callback itself: OpenSSL's line is read where it is (OpenSSL cleanses it afterwards)."""
    if _Capture.target is None or not line_pointer or _strlen is None:
        return
    length = _strlen(line_pointer)
    _on_keylog(ssl_pointer, memoryview((ctypes.c_char * length).from_address(line_pointer)).cast("B"))


def _find_strlen() -> Callable[[int], int] | None:
    try:
        import _ssl

        strlen = ctypes.CDLL(_ssl.__file__).strlen  # the C library's, as the extension links it
    except (ImportError, OSError, AttributeError):
        return None
    strlen.restype = ctypes.c_size_t
    strlen.argtypes = [ctypes.c_void_p]
    return cast(Callable[[int], int], strlen)


_strlen = _find_strlen()
_callback = _KEYLOG_CALLBACK(_from_openssl)  # kept alive for as long as the process
_enabled: dict[int, ssl.SSLContext] = {}

_STATE_FUNCTIONS: tuple[tuple[str, Any], ...] = (
    ("SSL_version", ctypes.c_int),
    ("SSL_is_server", ctypes.c_int),
    ("SSL_get_current_cipher", ctypes.c_void_p),
    ("SSL_CIPHER_get_name", ctypes.c_char_p),
    ("SSL_get_session", ctypes.c_void_p),
    ("SSL_SESSION_get_max_fragment_length", ctypes.c_uint8),
    ("SSL_get_early_data_status", ctypes.c_int),
    ("SSL_has_pending", ctypes.c_int),
)
"""What :meth:`TLSTransport._refusal` asks libssl about a handshake (all in OpenSSL 1.1.1 and 3.x)."""
_state_lib: list[ctypes.CDLL | None] = []  # resolved once per process


def negotiated_state_lib() -> ctypes.CDLL | None:
    """libssl with :data:`_STATE_FUNCTIONS` declared; None if one is missing (then nothing is taken over)."""
    if not _state_lib:
        lib = _libssl()
        if lib is not None:
            try:
                for name, restype in _STATE_FUNCTIONS:
                    function = getattr(lib, name)
                    function.restype = restype
                    function.argtypes = [ctypes.c_void_p]
            except AttributeError:
                lib = None
        _state_lib.append(lib)
    return _state_lib[0]


def _libssl() -> ctypes.CDLL | None:
    """libssl as the ``_ssl`` extension sees it (its own dependency, not some other copy)."""
    try:
        import _ssl

        lib = ctypes.CDLL(_ssl.__file__)
        lib.SSL_CTX_get_options.restype = ctypes.c_uint64
        lib.SSL_CTX_get_options.argtypes = [ctypes.c_void_p]
        lib.SSL_CTX_get_verify_mode.restype = ctypes.c_int
        lib.SSL_CTX_get_verify_mode.argtypes = [ctypes.c_void_p]
        lib.SSL_CTX_set_keylog_callback.restype = None
        lib.SSL_CTX_set_keylog_callback.argtypes = [ctypes.c_void_p, _KEYLOG_CALLBACK]
        lib.SSL_CTX_set_ciphersuites.restype = ctypes.c_int
        lib.SSL_CTX_set_ciphersuites.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    except (ImportError, OSError, AttributeError):
        return None
    return lib


_EVP_FUNCTIONS = (
    "EVP_CIPHER_CTX_new",
    "EVP_CIPHER_CTX_free",
    "EVP_EncryptInit_ex",
    "EVP_EncryptUpdate",
    "EVP_EncryptFinal_ex",
    "EVP_CIPHER_CTX_ctrl",
    "EVP_aes_128_gcm",
    "EVP_aes_256_gcm",
)
_sealer: list[type[Sealer] | None] = []  # resolved once per process


def c_sealer() -> type[Sealer] | None:
    """The C record sealer (``_tlsseal.c``) on the libcrypto of Python's ``ssl``; None if it was not built.

    Without it AES-GCM records are sealed with ``cryptography``'s ``AESGCM``: the same bytes,
    about 0.5 us more a record (bench/tls.md, section (g)).
    """
    if not _sealer:
        _sealer.append(_load_sealer())
    return _sealer[0]


def _load_sealer() -> type[Sealer] | None:
    try:
        from migratory.server.transport import _tlsseal
    except ImportError:
        log.info("TLS: the C record sealer was not built (no C compiler at install?); sealing in Python")
        return None
    lib = _libssl()
    try:
        addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in _EVP_FUNCTIONS]
    except AttributeError:  # not OpenSSL's libcrypto behind _ssl
        addresses = []
    if lib is None or len(addresses) != len(_EVP_FUNCTIONS) or not all(addresses):
        log.info("TLS: libcrypto's EVP functions not found beside the ssl module; sealing in Python")
        return None
    _tlsseal.configure(*(int(address or 0) for address in addresses))
    return _tlsseal.Sealer


LAYOUT_VERSIONS = ((3, 8), (3, 14))
"""CPython versions whose ``_ssl._SSLContext`` starts with ``SSL_CTX *ctx`` right after the object header.

The pointer is dereferenced (by libssl) to be checked, so a layout that merely *might* match is
not tried: a value that is not an ``SSL_CTX *`` could crash the process instead of failing the
check. Outside this range, and on any other interpreter, :func:`enable` returns False.
"""


def layout_known(implementation: str | None = None, version: tuple[int, ...] | None = None) -> bool:
    """Whether this interpreter's (or the given one's) ``_SSLContext`` layout is one :func:`ssl_ctx_pointer` knows."""
    implementation = sys.implementation.name if implementation is None else implementation
    major_minor = tuple(sys.version_info[:2] if version is None else version[:2])
    return implementation == "cpython" and LAYOUT_VERSIONS[0] <= major_minor <= LAYOUT_VERSIONS[1]


def ssl_ctx_pointer(context: ssl.SSLContext, lib: ctypes.CDLL) -> int | None:
    """The context's ``SSL_CTX *``, once libssl confirms it is that context's; else None."""
    import _ssl

    if not layout_known() or not isinstance(context, _ssl._SSLContext):
        return None
    if type(context).__basicsize__ < object.__basicsize__ + ctypes.sizeof(ctypes.c_void_p):
        return None
    pointer = ctypes.c_void_p.from_address(id(context) + object.__basicsize__).value
    if not pointer or pointer % ctypes.alignment(ctypes.c_void_p):
        return None
    options = int(context.options)
    if options == 0 or lib.SSL_CTX_get_options(pointer) != options:
        return None
    # CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED as CPython sets them: 0, PEER, PEER | FAIL_IF_NO_PEER_CERT
    if lib.SSL_CTX_get_verify_mode(pointer) != (0, 1, 3)[int(context.verify_mode)]:
        return None
    # and libssl sees a change made through this very object (then the change is undone)
    probe = ssl.OP_NO_RENEGOTIATION if not options & ssl.OP_NO_RENEGOTIATION else ssl.OP_NO_COMPRESSION
    try:
        context.options ^= probe
        followed = lib.SSL_CTX_get_options(pointer) == int(context.options)
    finally:
        context.options ^= probe
    if not followed or lib.SSL_CTX_get_options(pointer) != options:
        return None
    return int(pointer)


def enable(context: ssl.SSLContext) -> bool:
    """Let connections of ``context`` leave OpenSSL after a TLS 1.3 handshake; False if they cannot."""
    problem = _hook(context)
    if problem:
        log.warning("TLS: %s; connections keep OpenSSL's record layer", problem)
    return problem is None


def _hook(context: ssl.SSLContext) -> str | None:
    """Set the keylog hook on ``context``; why it could not be, or None."""
    if id(context) in _enabled:
        return None
    lib = _libssl()
    pointer = ssl_ctx_pointer(context, lib) if lib is not None else None
    if lib is None or pointer is None or _strlen is None:
        return "cannot reach OpenSSL's keylog hook"
    if negotiated_state_lib() is None:
        return "cannot read what OpenSSL negotiated (libssl)"
    lib.SSL_CTX_set_keylog_callback(pointer, _callback)
    _enabled[id(context)] = context
    return None


OPENSSL_TLS13_SUITES = ("TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256", "TLS_AES_128_GCM_SHA256")
"""OpenSSL's TLS 1.3 suites in its order (``TLS_DEFAULT_CIPHERSUITES``): a context's unless someone chose."""

PREFERRED_TLS13_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384", "TLS_CHACHA20_POLY1305_SHA256")
"""The same three suites in the order :func:`prefer_aes128` serves them."""

OP_PRIORITIZE_CHACHA = 1 << 21
"""``SSL_OP_PRIORITIZE_CHACHA`` (OpenSSL 1.1.1 and 3.x; the ``ssl`` module has no name for it)."""


def tls13_suites(context: ssl.SSLContext) -> tuple[str, ...]:
    """The TLS 1.3 suites of ``context``, in its order."""
    return tuple(c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.3")


def prefer_aes128(context: ssl.SSLContext) -> bool:
    """Serve ``TLS_AES_128_GCM_SHA256`` first, unless the TLS 1.3 suites were chosen by someone; True if it is so.

    Why: OpenSSL's default order, which clients follow (CPython's among them), puts
    ``TLS_AES_256_GCM_SHA384`` first, and with the lean record layer every record of a
    fan-out is sealed per connection: AES-128 has 10 rounds where AES-256 has 14, and its
    keys come from SHA-256 rather than SHA-384 (bench/tls.md (d): 14.7 against 16.3 us for
    a 16 KB record; for an 80-byte one the fixed cost of each call dominates and the two
    were not told apart on a loaded machine). So when the context still has
    OpenSSL's three suites in OpenSSL's order (nobody chose them: the ``ssl`` module
    cannot, only an ``openssl.cnf`` ``Ciphersuites`` line could), they are reordered
    through libssl's ``SSL_CTX_set_ciphersuites`` (all three stay offered, nothing is
    removed). The server's order is what counts (``OP_CIPHER_SERVER_PREFERENCE``, which
    CPython already sets on every context, so ``TLSCiphers``' order for TLS 1.2 is as
    before), and ``SSL_OP_PRIORITIZE_CHACHA`` keeps ChaCha20 for the clients that list it
    first: those without AES instructions. Any other list is left as it is; so is
    everything when libssl cannot be reached.
    """
    suites = tls13_suites(context)
    if suites == PREFERRED_TLS13_SUITES:
        return bool(context.options & ssl.OP_CIPHER_SERVER_PREFERENCE)
    if suites != OPENSSL_TLS13_SUITES:
        log.info("TLS: TLS 1.3 suites %s as configured for OpenSSL", ":".join(suites))
        return False
    lib = _libssl()
    pointer = ssl_ctx_pointer(context, lib) if lib is not None else None
    if lib is None or pointer is None:
        return False
    if lib.SSL_CTX_set_ciphersuites(pointer, ":".join(PREFERRED_TLS13_SUITES).encode("ascii")) != 1:
        return False
    context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE | OP_PRIORITIZE_CHACHA
    return tls13_suites(context) == PREFERRED_TLS13_SUITES


# --- the server side: a factory per listener, a transport per connection ----------------


class TLSServer:
    """``loop.create_server(TLSServer(...), sock=...)``: a TLS transport per TCP connection."""

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
        lean: bool = True,
        max_pending: int | None = None,
    ) -> None:
        self.context = context
        self.factory = factory
        self.handshake_timeout = handshake_timeout
        self.loop = loop
        # the output limit TLS-level output counts against (TLSTransport._output_limit); None: the
        # application protocol's own (a Connection's MaxPendingOutput)
        self.max_pending = max_pending
        # lean=False (TLSLeanTransport = false): the SSLObject carries every connection's records,
        # and the keylog hook is not even set on the context; so it is outside the supported matrix
        # or when the start-up self-tests fail (lean_verdict: one WARNING per process)
        self.lean = lean and lean_verdict() is None and enable(context)
        # this process's record layer, as /stats and /metrics show it (the self-tests' own servers, made inside
        # lean_verdict, come first: the listener's word is the last)
        if self.lean:
            record_layer[0] = 1
        elif not lean:
            record_layer[0] = 2
        else:  # asked for and refused: outside the matrix, or a self-test failed (a counter and the alert metric)
            record_layer[0] = 4 if (_verdict and _verdict[0] and "self-test" in _verdict[0]) else 3
        self.sealer = c_sealer() if self.lean else None  # AES-GCM records sealed in C
        self._active: list[TLSTransport] = []  # connections holding a cipher object
        self._sweeping: asyncio.TimerHandle | None = None
        self._freed = 0  # OpenSSL objects and cipher objects freed since the heap was last trimmed
        # the last frame written, with its record plaintext and header (see inner)
        self._frame = b""
        self._inner = b""
        self._header = b""

    def __call__(self) -> TLSTransport:
        return TLSTransport(self, self.factory())

    def hold(self, transport: TLSTransport) -> None:
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
        keep: list[TLSTransport] = []
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


class TLSTransport(asyncio.Transport, asyncio.Protocol):
    """One TLS connection: the TCP transport's protocol, and the application protocol's transport.

    Why it is long: RFC 8446's record layer is one state machine over the same buffers and keys
    (records in and out, alerts, KeyUpdate, backpressure, the fail-closed take-over from OpenSSL),
    and every path must see every other's state; the pieces without state are module functions.
    """

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

    def __init__(self, server: TLSServer, protocol: asyncio.Protocol) -> None:
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

    def close(self) -> None:
        """Send close_notify, then close TCP once what is queued has gone."""
        state = self._state
        if state >= _CLOSING or self._tcp is None:
            return
        self._state = _CLOSING
        if state == _RECORDS:
            self._tcp.write(self._seal(bytes((1, _CLOSE_NOTIFY, _ALERT))))
            alerts_sent["close_notify"] = alerts_sent.get("close_notify", 0) + 1
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

    def _pay_key_update(self) -> None:
        """One KeyUpdate of ours for every ``update_requested`` received since the last answers (RFC 8446 4.6.3),
        each under the key the one before it installed, in one TCP write."""
        owed, self._owed = self._owed, 0
        if self._state == _RECORDS and self._tcp is not None and owed:
            self._tcp.write(b"".join(self._update_write_key(requested=False) for _ in range(owed)))

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

    # --- handshake ------------------------------------------------------------------------

    def _handshake_timed_out(self) -> None:
        self._timer = None
        if self._state == _HANDSHAKING:
            log.debug("TLS handshake not completed within HandshakeTimeout: %s", self.get_extra_info("peername"))
            counters["handshake_failures"] += 1
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
            counters["handshake_failures"] += 1
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
            counters["lean_connections"] += 1
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
        lib = negotiated_state_lib()
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
        count = fallbacks[reason] = fallbacks.get(reason, 0) + 1
        level = logging.INFO if count & (count - 1) == 0 else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(
                level,
                "TLS: connection from %s keeps OpenSSL's record layer: %s (%d so far)",
                self.get_extra_info("peername"),
                FALLBACK_REASONS.get(reason, reason),
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

    # --- this module's record layer (TLS 1.3) ----------------------------------------------

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

    def _update_write_key(self, *, requested: bool) -> bytes:
        """A KeyUpdate under the current key, then the next key from sequence number 0."""
        assert self._suite is not None
        record = self._seal(bytes((_KEY_UPDATE, 0, 0, 1, 1 if requested else 0, _HANDSHAKE)))
        self._enc = self._sealer = None
        secret = self._wsecret
        self._wsecret = bytearray(self._suite.next_secret(secret))
        self._retire(secret)
        wipe(self._wkey)
        key, self._wiv = self._suite.keys(self._wsecret)
        self._wkey = bytearray(key)
        self._wseq = 0
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
                counters["bad_record_mac"] += 1
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
        assert self._suite is not None
        self._dec = None
        secret = self._rsecret
        self._rsecret = bytearray(self._suite.next_secret(secret))
        self._retire(secret)
        wipe(self._rkey)
        key, self._riv = self._suite.keys(self._rsecret)
        self._rkey = bytearray(key)
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
        name = _alert_name(description)
        alerts_received[name] = alerts_received.get(name, 0) + 1
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
        name = _alert_name(description)
        alerts_sent[name] = alerts_sent.get(name, 0) + 1
        if description in _WARNED_ALERTS:
            _warn_limited(name, self.get_extra_info("peername"))
        else:
            log.debug("TLS: sending alert %s to %s", name, self.get_extra_info("peername"))
        self._state = _CLOSING
        self._tcp.write(self._seal(bytes((2, description, _ALERT))))
        self._forget_secrets()
        self._tcp.close()

    # --- OpenSSL's record layer (TLS 1.2 and the rest) --------------------------------------

    def _flush_openssl(self) -> None:
        if self._outgoing is not None and self._outgoing.pending and self._tcp is not None:
            self._tcp.write(self._outgoing.read())

    def _openssl_in(self) -> None:
        """What OpenSSL opens of the records received: at most RECORD_RATE records with data, the rest waits."""
        sslobj = self._ssl
        assert sslobj is not None
        chunks: list[bytes] = []
        eof = False
        now = self._server.loop.time()
        start = self._tat if self._tat > now else now
        room = RECORD_BURST - (start - now) * RECORD_RATE
        used = 0
        try:
            while used < room:
                chunk = sslobj.read(65536)  # a record's data, as OpenSSL returns it
                used += 1
                if not chunk:
                    eof = True
                    break
                chunks.append(chunk)
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:
            eof = True
        except ssl.SSLError as exc:
            self._deliver_openssl(chunks)
            self._fail(exc)
            return
        self._tat = start + used / RECORD_RATE
        # what OpenSSL answered (a KeyUpdate for each one requested, ...) goes now, or waits in its
        # outgoing BIO while TCP cannot take more, counted against the output limit
        if not self._paused:
            self._flush_openssl()
        elif not self._within_limit():
            return
        self._deliver_openssl(chunks)
        if eof and self._state == _OPENSSL:
            keep_open = self._protocol.eof_received()
            if not keep_open:
                self.close()
        elif used >= room and self._state == _OPENSSL:
            self._throttle(now)

    def _deliver_openssl(self, chunks: list[bytes]) -> None:
        if chunks and self._state == _OPENSSL:
            self._protocol.data_received(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def _fail(self, exc: Exception) -> None:
        log.debug("TLS error: %s", exc)
        self._flush_openssl()
        self.abort()


# --- the supported matrix and the start-up self-tests ---------------------------------------

SUPPORTED_OPENSSL_MAJOR = 3
"""The OpenSSL major version the lean record layer runs on (its keylog hook, ``SSL_*`` state calls, EVP)."""

VERIFIED_ON = "CPython 3.11.7 with OpenSSL 3.0.19"
"""Where the whole TLS test suite last ran (docs/security.md, "Supported matrix")."""

_verdict: list[str | None] = []  # lean_verdict's answer, once per process
selftest_seconds: list[float] = []
"""How long :func:`lean_verdict` took (matrix check and self-tests), once it has run in this process."""

# RFC 8448 section 3 (TLS_AES_128_GCM_SHA256): the server's application traffic secret, its key and IV,
# and its first application data record (50 bytes 00 01 ... 31, sequence number 1); the secret after
# one KeyUpdate is Botan's (src/tests/test_tls_cipher_state.cpp). Also in tests/test_tls_rfc8448.py.
_RFC8448_SECRET = bytes.fromhex("a11af9f05531f856ad47116b45a950328204b4f44bfb6b3a4b4f1f3fcb631643")
_RFC8448_KEY = bytes.fromhex("9f02283b6c9c07efc26bb9f2ac92e356")
_RFC8448_IV = bytes.fromhex("cf782b88dd83549aadf1e984")
_RFC8448_SECRET_1 = bytes.fromhex("51921b8aa3001976eb401d0a4319a8516416a6c56001a357e5d162031e84f916")
# RFC 8439 section 2.8.2: ChaCha20-Poly1305 of "Ladies and Gentlemen of the class of '99: ..." (its tag last)
_RFC8439_KEY = bytes(range(0x80, 0xA0))
_RFC8439_NONCE = bytes.fromhex("070000004041424344454647")
_RFC8439_AAD = bytes.fromhex("50515253c0c1c2c3c4c5c6c7")
_RFC8439_PLAINTEXT = b" ".join(
    (
        b"Ladies and Gentlemen of the class of '99:",
        b"If I could offer you only one tip for the future,",
        b"sunscreen would be it.",
    )
)
_RFC8439_SEALED = bytes.fromhex(
    "d31a8d34648e60db7b86afbc53ef7ec2a4aded51296e08fea9e2b5a736ee62d63dbea45e8ca9671282fafb69da92728b1a71de0a9e060b29"
    "05d6a5b67ecd3b3692ddbd7f2d778b8c9803aee328091b58fab324e4fad675945585808b4831d7bc3ff4def08e4b7a9de576d26586cec64b"
    "61161ae10b594f09e26a7e902ecbd0600691"
)
_RFC8448_RECORD = bytes.fromhex(
    "1703030043"
    "2e937e11ef4ac740e538ad36005fc4a46932fc3225d05f82aa1b36e30efaf97d90e6dffc602dcb501a59a8fcc49c4bf2e5f0a21c0047c2ab"
    "f332540dd032e167c2955d"
)


def lean_verdict() -> str | None:
    """Why the lean record layer is off in this process, or None: checked once, before the first take-over.

    Off outside the supported matrix (:func:`outside_matrix`) and when a start-up self-test
    fails (:func:`run_selftests`); either is logged as one WARNING line, once per process, and
    every listener then keeps OpenSSL's record layer for all its connections (the keylog hook is
    not even set). The answer is cached: the self-tests cost a few milliseconds, once.
    """
    if not _verdict:
        started = time.perf_counter()
        reason = outside_matrix()
        if reason is None:
            failed = run_selftests()
            if failed is not None:
                reason = f"its start-up self-test {failed} failed"
                counters["selftest_failures"] += 1
        selftest_seconds[:] = [time.perf_counter() - started]
        _verdict.append(reason)
        if reason is None:
            log.debug("TLS: lean record layer self-tests passed in %.1f ms", selftest_seconds[0] * 1000)
        else:
            log.warning("TLS: lean record layer off: %s; every connection keeps OpenSSL's record layer", reason)
    return _verdict[0]


def outside_matrix() -> str | None:
    """Why this interpreter and library are outside the supported matrix, or None.

    The lean record layer runs on CPython versions whose ``_SSLContext`` layout is known
    (:data:`LAYOUT_VERSIONS`) with OpenSSL 3 (not LibreSSL, BoringSSL or another major), and
    not in FIPS mode: there the records must stay with OpenSSL's FIPS provider, while the lean
    layer's AEAD and HKDF are ``cryptography``'s and ``hmac``'s.
    """
    if not layout_known():
        low, high = LAYOUT_VERSIONS
        return (
            f"{platform.python_implementation()} {platform.python_version()} is outside the supported matrix "
            f"(CPython {low[0]}.{low[1]} to {high[0]}.{high[1]})"
        )
    if not ssl.OPENSSL_VERSION.startswith("OpenSSL ") or ssl.OPENSSL_VERSION_INFO[0] != SUPPORTED_OPENSSL_MAJOR:
        return f"{ssl.OPENSSL_VERSION} is outside the supported matrix (OpenSSL {SUPPORTED_OPENSSL_MAJOR})"
    if fips_mode():
        return f"{ssl.OPENSSL_VERSION} is in FIPS mode"
    return None


def fips_mode() -> bool:
    """Whether libcrypto (the ``ssl`` module's) fetches FIPS algorithms by default (OpenSSL 3)."""
    lib = _libssl()
    function = getattr(lib, "EVP_default_properties_is_fips_enabled", None) if lib is not None else None
    if function is None:
        return False
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p]
    return bool(function(None))


def run_selftests() -> str | None:
    """The start-up self-tests of the lean record layer; the name of the first that fails, or None.

    Known answers of the sealers (the C extension's, if built, and the Python one): RFC 8448's
    key, IV, KeyUpdate secret and record byte for byte; then, for every suite and sealer, the
    transport's own write paths at sequence numbers 2^64-2 and 2^64-1, the key update that
    follows (new key and IV from sequence number 0) and a write of two records, against records
    sealed here with ``cryptography``; the C sealer's socket write. Then a loopback: a lean
    :class:`TLSTransport` and an OpenSSL client (``ssl.SSLObject`` over memory BIOs) through a
    handshake whose ``Finished`` carries application data with it, data both ways, a KeyUpdate
    both ways (ours asks for the client's), close_notify both ways, and the secrets wiped after.
    """
    sealer = c_sealer()
    server = TLSServer(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), _Recorder, 10.0, _CLOCK, lean=False)
    server.sealer = sealer
    aes128, chacha = SUITES["TLS_AES_128_GCM_SHA256"], SUITES["TLS_CHACHA20_POLY1305_SHA256"]
    checks: list[tuple[str, Callable[[], bool]]] = [
        ("hkdf-rfc8448", _kat_hkdf),
        ("seal-rfc8448-python", lambda: _kat_rfc8448(_python_seal(aes128.aead(_RFC8448_KEY), _RFC8448_IV))),
        (
            "chacha20-poly1305-rfc8439",
            lambda: (
                chacha.aead(_RFC8439_KEY).encrypt(_RFC8439_NONCE, _RFC8439_PLAINTEXT, _RFC8439_AAD) == _RFC8439_SEALED
            ),
        ),
    ]
    if sealer is not None:
        checks.append(("seal-rfc8448-c", lambda: _kat_rfc8448(sealer(_RFC8448_KEY, _RFC8448_IV).seal)))
        checks.append(("send-c", lambda: _kat_send(sealer)))
    for name, suite in SUITES.items():
        for use_c in (False, True) if suite.aead is AESGCM and sealer is not None else (False,):
            label = f"seal-{name}-{'c' if use_c else 'python'}"
            checks.append((label, lambda name=name, use_c=use_c: _kat_records(server, name, use_c)))  # type: ignore[misc]
    checks.append(("loopback", lambda: _loopback(sealer)))
    tallies = (dict(counters), dict(alerts_sent), dict(alerts_received))
    try:
        for name, check in checks:
            try:
                passed = check()
            except Exception as exc:  # any failure is one: the lean layer stays off
                return f"{name} ({type(exc).__name__}: {exc})"
            if not passed:
                return name
    finally:
        for tally, before in zip((counters, alerts_sent, alerts_received), tallies, strict=True):
            tally.clear()  # what the self-tests' own transports did is not counted
            tally.update(before)
    return None


class _Clock:
    """The self-tests' event loop: a clock, and timers that never fire (the tests run synchronously)."""

    def time(self) -> float:
        return time.monotonic()

    def call_later(self, delay: float, callback: Callable[..., object], *args: object) -> _Never:
        return _Never()


class _Never:
    def cancel(self) -> None:
        pass


_CLOCK = cast(asyncio.AbstractEventLoop, _Clock())


class _Wire:
    """The self-tests' TCP transport: what is written is kept for the other side."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += data

    def take(self) -> bytes:
        data = bytes(self.out)
        self.out.clear()
        return data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return len(self.out)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return not self.closed


class _Recorder(asyncio.Protocol):
    """The self-tests' application: keeps what it receives."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.eof = False

    def data_received(self, data: bytes) -> None:
        self.received += data

    def eof_received(self) -> bool | None:
        self.eof = True
        return None


def _kat_hkdf() -> bool:
    suite = SUITES["TLS_AES_128_GCM_SHA256"]
    key, iv = suite.keys(_RFC8448_SECRET)
    return (
        key == _RFC8448_KEY
        and iv == int.from_bytes(_RFC8448_IV, "big")
        and suite.next_secret(_RFC8448_SECRET) == _RFC8448_SECRET_1
    )


def _kat_rfc8448(seal: Callable[[int, bytes, bytes], bytes]) -> bool:
    """RFC 8448's server application record (sequence number 1), from ``seal(seq, inner, header)``."""
    return seal(1, bytes(range(50)) + b"\x17", _RFC8448_RECORD[:5]) == _RFC8448_RECORD


def _python_seal(aead: Aead, iv: bytes) -> Callable[[int, bytes, bytes], bytes]:
    """A record sealed as the transport does it in Python (nonce = IV xor sequence number)."""

    def seal(seq: int, inner: bytes, header: bytes) -> bytes:
        return header + aead.encrypt((int.from_bytes(iv, "big") ^ seq).to_bytes(12, "big"), inner, header)

    return seal


def _kat_send(sealer: type[Sealer]) -> bool:
    """``Sealer.send``: the record it writes to a socket is the one ``seal`` returns."""
    inner = b"sent in one call\x17"
    header = _HEADER.pack(_APPLICATION_DATA, 0x0303, len(inner) + 16)
    one = sealer(_RFC8448_KEY, _RFC8448_IV)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        if one.send(ours.fileno(), (1 << 64) - 1, inner, header) is not None:
            return False
        expected = one.seal((1 << 64) - 1, inner, header)
        return theirs.recv(len(expected) + 1) == expected


def _kat_records(server: TLSServer, name: str, use_c: bool) -> bool:
    """The transport's writes at the top of the sequence space, its key update and a two-record write."""
    suite = SUITES[name]
    secret = bytes(range(1, suite.hash_len + 1))
    transport = TLSTransport(server, _Recorder())
    wire = _Wire()
    transport._tcp = cast(asyncio.Transport, wire)
    transport._suite = suite
    transport._state = _RECORDS
    transport._made = True
    transport._wsecret = bytearray(secret)
    key, iv = suite.keys(secret)
    transport._wkey, transport._wiv = bytearray(key), iv
    transport._c = use_c
    transport._wseq = (1 << 64) - 2
    last = b"the last record under the first key"
    first = b"the first record under the next key"
    big = bytes(range(256)) * 65  # 16,640 bytes: two records
    try:
        transport.write(last)  # sequence number 2^64-2, then our KeyUpdate at 2^64-1
        transport.write(first)
        transport.write(big)
        got = wire.take()
    finally:
        transport.connection_lost(None)
        server._active.clear()

    reference = ChaCha20Poly1305 if "CHACHA20" in name else AESGCM  # cryptography's, whatever suite.aead is

    def record(key: bytes, iv: int, seq: int, inner: bytes) -> bytes:
        header = _HEADER.pack(_APPLICATION_DATA, 0x0303, len(inner) + 16)
        return header + reference(key).encrypt((iv ^ seq).to_bytes(12, "big"), inner, header)

    next_key, next_iv = suite.keys(suite.next_secret(secret))
    expected = b"".join(
        (
            record(key, iv, (1 << 64) - 2, last + b"\x17"),
            record(key, iv, (1 << 64) - 1, bytes((_KEY_UPDATE, 0, 0, 1, 0, _HANDSHAKE))),
            record(next_key, next_iv, 0, first + b"\x17"),
            record(next_key, next_iv, 1, big[:MAX_PLAINTEXT] + b"\x17"),
            record(next_key, next_iv, 2, big[MAX_PLAINTEXT:] + b"\x17"),
        )
    )
    return got == expected


def _selftest_context() -> ssl.SSLContext:
    """A TLS 1.3 server context with a throwaway self-signed certificate (P-256), for the loopback only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "migratory TLS self-test")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.TemporaryDirectory(prefix="migratory-tls-selftest-") as folder:  # mode 0700, removed at once
        path = os.path.join(folder, "selftest.pem")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            out.write(pem_key + certificate.public_bytes(serialization.Encoding.PEM))
        context.load_cert_chain(path)
    return context


def _loopback(sealer: type[Sealer] | None) -> bool:
    """A lean TLSTransport and an OpenSSL client, in memory: take-over, data, KeyUpdates, close_notify."""
    context = _selftest_context()
    problem = _hook(context)
    if problem:
        raise RuntimeError(problem)
    counted = dict(fallbacks)
    tallies = (dict(counters), dict(alerts_sent), dict(alerts_received))
    server = TLSServer(context, _Recorder, 10.0, _CLOCK, lean=False)
    server.lean = True
    server.sealer = sealer
    app = _Recorder()
    transport = TLSTransport(server, app)
    wire = _Wire()
    client_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_context.check_hostname = False
    client_context.verify_mode = ssl.CERT_NONE
    client_context.minimum_version = ssl.TLSVersion.TLSv1_3
    into_client, from_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(into_client, from_client)

    def client_reads() -> bytes:
        into_client.write(wire.take())
        out = b""
        with contextlib.suppress(ssl.SSLWantReadError):
            while chunk := client.read(65536):
                out += chunk
        return out

    try:
        transport.connection_made(cast(asyncio.Transport, wire))
        early = b"with the client's Finished"
        sent = False
        for _ in range(10):
            with contextlib.suppress(ssl.SSLWantReadError):
                client.do_handshake()
                if not sent:
                    client.write(early)  # in the same flight as the Finished
                    sent = True
            flight = from_client.read()
            if flight:
                transport.data_received(flight)
            answer = wire.take()
            if answer:
                into_client.write(answer)
            if not flight and not answer:
                break
        if not (transport.lean and transport._state == _RECORDS and bytes(app.received) == early):
            raise RuntimeError("not taken over after the handshake")
        transport.write(b"from the server")
        if client_reads() != b"from the server":
            raise RuntimeError("data to the client")
        read_secret = transport._rsecret
        wire.write(transport._update_write_key(requested=True))  # ours, asking for the client's
        transport.write(b"under our next key")
        if client_reads() != b"under our next key":
            raise RuntimeError("KeyUpdate to the client")
        client.write(b"under the client's next key")
        transport.data_received(from_client.read())
        if not app.received.endswith(b"under the client's next key") or transport._rsecret is read_secret:
            raise RuntimeError("KeyUpdate from the client")
        secrets = [transport._wsecret, transport._rsecret, transport._wkey, transport._rkey]
        with contextlib.suppress(ssl.SSLWantReadError):
            client.unwrap()  # the client's close_notify: ours answers it
        transport.data_received(from_client.read())
        into_client.write(wire.take())
        client.unwrap()
        if not (app.eof and wire.closed):
            raise RuntimeError("close_notify")
        transport.connection_lost(None)
        if any(any(buffer) for buffer in secrets) or transport._wsecret or transport._rsecret:
            raise RuntimeError("secrets not wiped")
    finally:
        _Capture.target = None
        _enabled.pop(id(context), None)
        fallbacks.clear()
        fallbacks.update(counted)
        for tally, before in zip((counters, alerts_sent, alerts_received), tallies, strict=True):
            tally.clear()  # the self-test's own connection is not counted
            tally.update(before)
        server._active.clear()
    return True
