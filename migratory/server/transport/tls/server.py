"""A TLS listener: ``loop.create_server(TLSServer(...), sock=...)`` makes a TLS transport per TCP connection.

The listener's policy: its connections may leave OpenSSL after a TLS 1.3 handshake only if the
operator allows it (``TLSLeanTransport``), this process is inside the supported matrix and its
start-up self-tests passed (selftest.py), and the keylog hook could be set on the context
(keylog.py). What carries the records is then this process's record layer in stats.RECORD_LAYERS.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from migratory.server.transport.tls import keylog, sealer, selftest, stats
from migratory.server.transport.tls.base import Listener
from migratory.server.transport.tls.transport import TLSTransport

__all__ = ["TLSServer"]


class TLSServer(Listener):
    """``loop.create_server(TLSServer(...), sock=...)``: a TLS transport per TCP connection."""

    __slots__ = ()

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
        # lean=False (TLSLeanTransport = false): the SSLObject carries every connection's records,
        # and the keylog hook is not even set on the context; so it is outside the supported matrix
        # or when the start-up self-tests fail (lean_verdict: one WARNING per process)
        allowed = lean and selftest.lean_verdict() is None and keylog.enable(context)
        super().__init__(context, factory, handshake_timeout, loop, lean=allowed, max_pending=max_pending)
        # this process's record layer, as /stats and /metrics show it (the self-tests' own listeners, made inside
        # lean_verdict, come first: the listener's word is the last)
        verdict = selftest._verdict
        if allowed:
            stats.record_layer[0] = 1
        elif not lean:
            stats.record_layer[0] = 2
        else:  # asked for and refused: outside the matrix, or a self-test failed (a counter and the alert metric)
            stats.record_layer[0] = 4 if (verdict and verdict[0] and "self-test" in verdict[0]) else 3
        self.sealer = sealer.c_sealer() if allowed else None  # AES-GCM records sealed in C

    def __call__(self) -> TLSTransport:
        return TLSTransport(self, self.factory())
