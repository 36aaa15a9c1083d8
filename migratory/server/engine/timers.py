"""The coarse timer wheel: one-second slots of clients whose ``on_timer`` is due (handshake
deadlines, keepalive pings, dead-peer detection, token expiry).

Why a wheel and not a timer per connection: a million idle connections would be a million
``TimerHandle`` objects in the loop's heap; here each is one set membership, moved when
rescheduled and dropped when it closes, so a closed connection is never kept alive by it.
"""

from __future__ import annotations

from collections.abc import Iterator

from migratory.server.engine.types import Client

__all__ = ["TimerWheel"]


class TimerWheel:
    """Clients by the second their timer comes due (``Client.wheel_at`` names their slot)."""

    __slots__ = ("_slots",)

    def __init__(self) -> None:
        self._slots: dict[int, set[Client]] = {}

    def schedule(self, client: Client, when: float) -> None:
        """Have ``client.on_timer`` called at (about) loop time ``when``, at 1 s granularity."""
        key = int(when) + 1
        old = client.wheel_at
        if old == key:
            return
        if old:
            self.unschedule(client)
        self._slots.setdefault(key, set()).add(client)
        client.wheel_at = key

    def unschedule(self, client: Client) -> None:
        bucket = self._slots.get(client.wheel_at)
        if bucket is not None:
            bucket.discard(client)
            if not bucket:
                del self._slots[client.wheel_at]
        client.wheel_at = 0

    def due(self, now: float) -> Iterator[Client]:
        """The clients whose slot has come, taken off the wheel (each may schedule itself again)."""
        for second in [s for s in self._slots if s <= now]:
            for client in self._slots.pop(second):
                client.wheel_at = 0
                yield client
