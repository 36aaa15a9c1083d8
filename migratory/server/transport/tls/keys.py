"""The key schedule's last steps: traffic keys, IVs and their updates (RFC 8446 7.1 to 7.3).

The handshake (and with it the schedule up to the application traffic secrets) is OpenSSL's; from
the two secrets the keylog hook hands over (keylog.py), this module derives each direction's AEAD
key and IV (7.3), and the next secret when a ``KeyUpdate`` replaces it (7.2), with
HKDF-Expand-Label (7.1). The three TLS 1.3 suites of 9.1 that the lean record layer carries are
:data:`SUITES`. :func:`wipe` is how every secret and key ends: zeros over its buffer.
"""

from __future__ import annotations

import hmac

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

__all__ = ["SUITES", "Aead", "expand_label", "wipe"]

Aead = AESGCM | ChaCha20Poly1305


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


def wipe(buffer: bytes | bytearray) -> None:
    """Overwrite a secret's buffer with zeros (a ``bytes`` cannot be, and is left to the garbage collector)."""
    if isinstance(buffer, bytearray) and buffer:
        buffer[:] = bytes(len(buffer))
