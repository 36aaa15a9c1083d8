"""OpenSSL's record layer, for the connections the lean one does not carry (TLS 1.2, refusals).

The ``SSLObject`` of the handshake stays and seals and opens the records, as the event loop's TLS
transport would, without its 256 KB buffer; what OpenSSL answers by itself (a ``KeyUpdate`` for each
one requested, alerts) goes out at once, or waits in its outgoing BIO while TCP takes no more,
counted against the connection's output limit. The same :data:`records.RECORD_RATE` applies.
"""

from __future__ import annotations

import logging
import ssl

from migratory.server.transport.tls.base import _OPENSSL, Base
from migratory.server.transport.tls.records import RECORD_BURST, RECORD_RATE

__all__ = ["OpenSSLRecords"]

log = logging.getLogger("migratory.server.tls")  # one logger for the whole layer, as before the split


class OpenSSLRecords(Base):
    """One connection's records when OpenSSL carries them."""

    __slots__ = ()

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
