"""What every client connection shares, whatever protocol it speaks: its peer's address and its
admission (``MaxConnectionsPerSecondPerAddress``), and its output: queue the bytes (one object
shared by every subscriber of a message), get written once per event-loop turn or per
``BatchingTime`` (the fan-out's dirty lists), past ``MaxPendingOutput`` apply the slow-consumer
policy, pause with the kernel. The native connection (:mod:`.connection`, through
:class:`~.native.Session`) and the MQTT one (:mod:`.mqtt`) both inherit it.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from migratory.server.engine.core import Engine
    from migratory.server.engine.types import Client, Origin, Publisher

__all__ = ["ConnectionBase"]


class ConnectionBase:
    """Identity, admission and output; the attributes are set by the connection's ``__init__``."""

    __slots__ = (
        "addr",
        "bytes_out",
        "engine",
        "msgs_out",
        "paused",
        "pending",
        "pending_bytes",
        "port",
        "sid",
        "transport",
    )

    addr: str
    port: int
    sid: int
    engine: Engine
    transport: asyncio.Transport | None
    pending: bytes | list[bytes] | None  # bytes while one item: no list per delivery
    pending_bytes: int
    paused: bool
    msgs_out: int
    bytes_out: int

    @property
    def open(self) -> bool:
        raise NotImplementedError

    def origin(self) -> Origin:
        raise NotImplementedError

    def admitted(self, transport: asyncio.BaseTransport) -> bool:
        """A new connection: its transport, its peer, its session number; False (and aborted) past the rate limit."""
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.addr = sys.intern(str(peer[0]))  # one string per client address, not per connection
            self.port = int(peer[1])
        engine = self.engine
        self.sid = engine.new_session()
        if engine.admit(self.addr, engine.loop.time()):
            return True
        engine.deny(
            self.origin(),
            "connect",
            "rate_limited",
            f"more than MaxConnectionsPerSecondPerAddress ({engine.config.max_connection_rate_per_address}) "
            f"new connections per second from {self.addr}",
        )
        self.transport.abort()
        return False

    def flush(self) -> None:
        raise NotImplementedError

    def _slow_consumer(self) -> None:
        raise NotImplementedError

    def pause_writing(self) -> None:
        """The peer does not read what we write: stop reading it too (what it sends may ask for more output).

        The worker's own transports do this themselves; asyncio's (``LeanTransport = false``) does not.
        """
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        engine = self.engine
        if self.transport is not None and not (engine.held and cast("Publisher", self) in engine.held):
            self.transport.resume_reading()
        if self.pending is not None:
            self.flush()

    def hold_input(self) -> None:
        """Backpressure (Engine.publish_started): read nothing more; what was already parsed waits in the engine."""
        if self.transport is not None:
            self.transport.pause_reading()

    def queue_output(self, data: bytes) -> None:
        """Queue bytes for the next flush; the engine decides when that happens."""
        pending = self.pending
        engine = self.engine
        if pending is None:
            if not self.open:
                return
            self.pending = data
            self.pending_bytes = len(data)
            fanout = engine.fanout
            client = cast("Client", self)
            if engine.batching_time:
                fanout.mark_batch(client)
            else:
                fanout.dirty.append(client)
                if not fanout.armed:
                    fanout.armed = True
                    engine.loop.call_soon(fanout.flush_dirty)
        else:
            if isinstance(pending, bytes):
                self.pending = [pending, data]
            else:
                pending.append(data)
            self.pending_bytes += len(data)
            if self.pending_bytes > engine.max_pending:
                self._slow_consumer()
                return
        if engine.batching_size and self.pending_bytes >= engine.batching_size:
            self.flush()

    def take_output(self) -> bytes | None:
        """Everything pending as one write, counted as sent; None when nothing may be written now."""
        pending = self.pending
        if pending is None or self.paused or self.transport is None:
            return None
        self.pending = None
        self.bytes_out += self.pending_bytes
        self.pending_bytes = 0
        if isinstance(pending, bytes):
            self.msgs_out += 1
            return pending
        self.msgs_out += len(pending)
        return b"".join(pending)
