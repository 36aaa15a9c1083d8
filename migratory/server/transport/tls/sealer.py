"""The binding of the C record sealer (``_tlsseal.c``) to the libcrypto of Python's ``ssl``.

The extension seals an AES-GCM record of RFC 8446 5.2 (header, nonce of 5.3, ciphertext and tag) in
one call, and can write it to the socket in the same call (the fan-out's path, records.py). It
links against no OpenSSL of its own: :func:`c_sealer` hands it the addresses of libcrypto's EVP
functions as the ``_ssl`` extension resolves them, so both use one library. Without the extension
(no C compiler at install), records are sealed with ``cryptography``: the same bytes, slower.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

from migratory.server.transport.tls.libssl import _libssl

if TYPE_CHECKING:
    from migratory.server.transport._tlsseal import Sealer

__all__ = ["c_sealer"]

log = logging.getLogger("migratory.server.tls")  # one logger for the whole layer, as before the split

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
