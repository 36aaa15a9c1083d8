"""libssl through ctypes: the very library the ``ssl`` module is linked with, and only what it must.

Three things the ``ssl`` module does not expose: the ``SSL_CTX *`` behind an ``SSLContext``
(:func:`ssl_ctx_pointer`, trusted only after libssl confirms it, and only on the CPython versions of
:data:`LAYOUT_VERSIONS`), what a handshake negotiated (:func:`negotiated_state_lib`, asked by the
take-over, takeover.py), and the order of the TLS 1.3 suites (RFC 8446 9.1; :func:`prefer_aes128`).
The keylog hook (keylog.py) and the C sealer's binding (sealer.py) resolve their symbols here too.
"""

from __future__ import annotations

import ctypes
import logging
import ssl
import sys
from typing import Any

__all__ = ["LAYOUT_VERSIONS", "layout_known", "negotiated_state_lib", "prefer_aes128", "ssl_ctx_pointer"]

log = logging.getLogger("migratory.server.tls")  # one logger for the whole layer, as before the split

_KEYLOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)
"""The keylog callback's C type: ``void (*)(const SSL *, const char *line)``."""

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
