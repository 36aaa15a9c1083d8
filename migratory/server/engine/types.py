"""What the engine knows of the world around it: who sent a request, what a publication came to,
and the two faces of a connection it deals with (``Client``: something frames are sent to and
subscriptions are kept for; ``Publisher``: something that can be held back).

The sessions (migratory/server/sessions/) implement these protocols; the engine imports
nothing of them, so a second session protocol (MQTT) plugs in without touching it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from migratory.protocol import Status
from migratory.subjects import PRIVATE_PREFIX
from migratory.subscriptions import SubjectSet

__all__ = ["PRIVATE_PREFIX", "Client", "Origin", "PublishResult", "Publisher", "Reply", "Stats", "Stream"]


@dataclass(frozen=True, slots=True)
class Origin:
    """Who sent a request, for entitlement decisions and logs."""

    addr: str
    port: int
    session: str
    protocol: str
    token: str = ""
    listener: str = ""


@dataclass(frozen=True, slots=True)
class PublishResult:
    status: Status
    reason: str = ""
    reason_code: str = ""
    recipients: int = 0
    seq: int = 0
    epoch: int = 0


Reply = Callable[[PublishResult], None]


@dataclass(slots=True)
class Stats:
    """Counters since start; read by /health and the benchmarks."""

    connections: int = 0
    connections_total: int = 0
    disconnections_total: int = 0
    messages_in: int = 0
    messages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    slow_consumers_disconnected: int = 0
    messages_dropped: int = 0
    denied: int = 0
    messages_recovered: int = 0
    recoveries_shared: int = 0
    resyncs: int = 0
    timer_errors: int = 0
    subscriptions: int = 0
    subjects: int = 0
    snapshots: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class Client(Protocol):
    """A connection as the engine sees it: frames go to it, its subscriptions and timer slot live on it."""

    sid: int  # its number in this worker (HTTP streams are found by it)
    listener: str  # the listener it came in on, for the per-listener counts
    version: int  # the native protocol version it spoke: 2 understands NOTIFY_DATA_RESYNC
    subscriptions: SubjectSet
    wheel_at: int  # the timer wheel's slot holding it (0: none)

    def __hash__(self) -> int: ...  # a member of subscriber sets

    @property
    def open(self) -> bool: ...

    def send(self, data: bytes) -> None:
        """Queue bytes; the fan-out's flush writes them at the end of the turn."""

    def flush(self) -> None:
        """Write everything queued in one call."""

    def origin(self) -> Origin: ...

    def log_fields(self) -> dict[str, Any]: ...

    def on_timer(self, now: float) -> None:
        """Its timer-wheel slot came due (handshake deadline, keepalive, token expiry)."""

    def shutdown(self) -> None:
        """Close politely: the server is stopping."""

    def send_away(self, reason: str) -> None:
        """Close politely so that the client reconnects at once, to another member of its list."""

    def abort(self, reason: str) -> None:
        """Close at once."""


class Stream(Client, Protocol):
    """An HTTP stream: a client whose input arrives in POSTs naming its stream id."""

    def stream_input(self, payload: bytes) -> None: ...


class Publisher(Protocol):
    """A client whose reading can be held while too many of its publications are unanswered."""

    def hold_input(self) -> None: ...

    def release_input(self, waiting: list[Any]) -> None: ...
