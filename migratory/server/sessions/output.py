"""What every client connection does with its output, whatever protocol it speaks: queue the bytes
(one object shared by every subscriber of a message), get written once per event-loop turn or per
``BatchingTime`` (the fan-out's dirty lists), and past ``MaxPendingOutput`` apply the slow-consumer
policy. The native connection (:mod:`.connection`) and the MQTT one (:mod:`.mqtt`) both inherit it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from migratory.server.engine.core import Engine
    from migratory.server.engine.types import Client, Publisher

__all__ = ["QueuedOutput"]


class QueuedOutput:
    """Output queueing; the attributes are the connection's (set by its ``__init__``)."""

    __slots__ = ("bytes_out", "engine", "msgs_out", "paused", "pending", "pending_bytes", "transport")

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
