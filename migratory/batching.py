"""Batching policy: when a connection's pending output is written.

Without batching, everything pending for a connection is written once per
event-loop turn (coalescing: one syscall for all messages produced in that turn).
With ``BatchingTime`` the first pending message arms a timer and output waits for
it; with ``BatchingSize`` too, reaching that many bytes writes at once, whichever
comes first (Architecture Guide, "Batching").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["BatchPolicy", "FlushAction"]


class FlushAction(enum.Enum):
    """What the I/O layer should do after queueing output."""

    END_OF_TURN = "end_of_turn"
    ARM_TIMER = "arm_timer"
    NOW = "now"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """``time_ms`` 0 = batch per loop turn only; ``size`` 0 = no size trigger."""

    time_ms: int = 0
    size: int = 0

    def after_enqueue(self, pending_bytes: int, was_empty: bool) -> FlushAction:
        """Decide after adding output; ``was_empty`` means nothing was pending before."""
        if self.size and pending_bytes >= self.size:
            return FlushAction.NOW
        if not self.time_ms:
            return FlushAction.END_OF_TURN if was_empty else FlushAction.WAIT
        return FlushAction.ARM_TIMER if was_empty else FlushAction.WAIT
