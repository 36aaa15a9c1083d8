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
  records.py), everything else (reading, ChaCha20-Poly1305, and
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
  closed, takeover.py): a max_fragment_length (RFC 6066) limit,
  early data, records OpenSSL holds unread. Each such connection is counted by reason in
  ``stats.fallbacks`` and logged (INFO the 1st, 2nd, 4th... time per reason).

**Reading order**, one concern per module, each opening with the RFC sections it implements:

1. ``keys.py``: traffic keys, IVs and their updates (RFC 8446 7.1-7.3), the suites carried (9.1).
2. ``records.py``: the record layer (5): sealing, opening, the fan-out's write, flood limits.
3. ``alerts.py``: alerts received and sent (6, 5.4).
4. ``keyupdate.py``: ``KeyUpdate`` both ways, one answer per request, bounded (4.6.3, 7.2, 5.5).
5. ``keylog.py``: the traffic secrets from OpenSSL's keylog callback (7.1's secrets).
6. ``takeover.py``: the handshake, and the fail-closed take-over of its records (4, 4.6.1).
7. ``openssl.py``: OpenSSL's record layer for the connections the lean one does not carry.
8. ``transport.py``: the connection as asyncio sees it, backpressure, ``close_notify`` (6.1).
9. ``base.py``: the fields every concern shares, the record header (5.1), the listener's sweep.
10. ``libssl.py`` and ``sealer.py``: libssl through ctypes, and the C sealer's binding.
11. ``selftest.py``: the supported matrix and the start-up self-tests (RFC 8448, RFC 8439).
12. ``server.py``: the listener and its policy; ``stats.py``: what the process counts.

docs/security.md says what an operator sees of it (``TLSLeanTransport``, the fallbacks, the
counters, the KeyUpdate and alert rules).
"""

from __future__ import annotations

from migratory.server.transport.tls.keylog import enable, traffic_secret
from migratory.server.transport.tls.keys import SUITES, expand_label, wipe
from migratory.server.transport.tls.libssl import layout_known, prefer_aes128, ssl_ctx_pointer
from migratory.server.transport.tls.sealer import c_sealer
from migratory.server.transport.tls.selftest import lean_verdict, run_selftests
from migratory.server.transport.tls.server import TLSServer
from migratory.server.transport.tls.stats import ALERT_LABELS, ALERT_NAMES, FALLBACK_REASONS, RECORD_LAYERS
from migratory.server.transport.tls.transport import TLSTransport

__all__ = [
    "ALERT_LABELS",
    "ALERT_NAMES",
    "FALLBACK_REASONS",
    "RECORD_LAYERS",
    "SUITES",
    "TLSServer",
    "TLSTransport",
    "c_sealer",
    "enable",
    "expand_label",
    "layout_known",
    "lean_verdict",
    "prefer_aes128",
    "run_selftests",
    "ssl_ctx_pointer",
    "traffic_secret",
    "wipe",
]
