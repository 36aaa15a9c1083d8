"""The traffic secrets, from OpenSSL's keylog callback (the hook behind ``SSLKEYLOGFILE``).

RFC 8446 7.1 names the two secrets kept: ``server_application_traffic_secret_0`` and
``client_application_traffic_secret_0``, which OpenSSL logs as ``SERVER_TRAFFIC_SECRET_0`` and
``CLIENT_TRAFFIC_SECRET_0`` in the NSS key log format. CPython exposes only a file for the hook, so
:func:`enable` sets the callback on the context's ``SSL_CTX`` through ctypes (libssl.py). The
callback runs inside ``do_handshake`` on the event loop's thread, which names the connection being
handshaken (:attr:`_Capture.target`, set only for a lean listener's connections); only those two
lines are kept, parsed from OpenSSL's own buffer straight into ``bytearray`` objects the connection
wipes (keys.wipe) as soon as it no longer needs them: when it stays on OpenSSL's record layer, when
its handshake fails or times out, at close_notify or a fatal alert, when it is aborted or lost. The
handshake secrets and the exporter secret are never copied out. What cannot be wiped: the short-lived
``bytes`` inside keys.expand_label, and the cipher objects' own copies (freed and cleansed by OpenSSL
and ``cryptography``).
"""

from __future__ import annotations

import ctypes
import logging
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from migratory.server.transport.tls import libssl
from migratory.server.transport.tls.keys import wipe
from migratory.server.transport.tls.libssl import _KEYLOG_CALLBACK

if TYPE_CHECKING:
    from migratory.server.transport.tls.base import Base

__all__ = ["enable", "traffic_secret"]

log = logging.getLogger("migratory.server.tls")  # one logger for the whole layer, as before the split


class _Capture:
    """Where the keylog callback puts the secrets: the connection now in ``do_handshake``."""

    target: Base | None = None


_SERVER_SECRET_LABEL = b"SERVER_TRAFFIC_SECRET_0 "
_CLIENT_SECRET_LABEL = b"CLIENT_TRAFFIC_SECRET_0 "
_HEX_VALUES = bytes(
    int(chr(c), 16) if chr(c) in "0123456789abcdefABCDEF" else 0xFF for c in range(256)
)  # an ASCII hex digit's value, 0xFF for anything else


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
    lib = libssl._libssl()
    pointer = libssl.ssl_ctx_pointer(context, lib) if lib is not None else None
    if lib is None or pointer is None or _strlen is None:
        return "cannot reach OpenSSL's keylog hook"
    if libssl.negotiated_state_lib() is None:
        return "cannot read what OpenSSL negotiated (libssl)"
    lib.SSL_CTX_set_keylog_callback(pointer, _callback)
    _enabled[id(context)] = context
    return None
