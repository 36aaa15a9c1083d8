"""Conflation: aggregate the messages of a subject over a period, send one per period.

Rules (Architecture Guide, "Conflation"): the conflated message of subject X has the
content of the most recent message published during the period, the union of the
field names of those messages, and each field at its most recent value. Periods are
multiples of 100 ms, and a requested time is cut down to one (78 -> 0 = none,
547 -> 500, 887 -> 800), as the guide's examples show.

Periods are aligned to the clock (a 5 s period ends at :00, :05, ...), so every
subscriber of a subject with the same period gets the same conflated message and it
is encoded once per subject and period.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from migratory.message import merge_fields

__all__ = ["Conflated", "ConflationBuffer", "next_boundary", "round_conflation"]

CONFLATION_STEP_MS = 100
MAX_CONFLATION_MS = 3_600_000


def round_conflation(ms: int) -> int:
    """Cut a requested conflation time down to a multiple of 100 ms (0 = none)."""
    if ms <= 0:
        return 0
    return min(ms - ms % CONFLATION_STEP_MS, MAX_CONFLATION_MS)


def next_boundary(now_ms: int, period_ms: int) -> int:
    """The first clock-aligned period end strictly after ``now_ms``."""
    return (now_ms // period_ms + 1) * period_ms


@dataclass(slots=True)
class Conflated:
    """The aggregate of one subject over the current period."""

    subject: str
    content: bytes
    fields: Mapping[str, str]
    seq: int
    epoch: int
    retained: bool


class ConflationBuffer:
    """Aggregates per subject for one conflation period."""

    __slots__ = ("_pending", "period_ms")

    def __init__(self, period_ms: int) -> None:
        self.period_ms = period_ms
        self._pending: dict[str, Conflated] = {}

    def add(
        self,
        subject: str,
        content: bytes,
        fields: Mapping[str, str],
        seq: int,
        epoch: int,
        retained: bool,
    ) -> bool:
        """Fold one message in; return True if the buffer was empty before (arm a timer)."""
        was_empty = not self._pending
        current = self._pending.get(subject)
        if current is None:
            self._pending[subject] = Conflated(subject, content, dict(fields), seq, epoch, retained)
        else:
            current.content = content
            current.fields = merge_fields(current.fields, fields) if fields else current.fields
            current.seq = seq
            current.epoch = epoch
            current.retained = current.retained or retained
        return was_empty

    def drain(self) -> list[Conflated]:
        """Take every aggregate of the period that just ended."""
        out = list(self._pending.values())
        self._pending.clear()
        return out

    def discard(self, subject: str) -> None:
        """Forget a subject's aggregate (its last conflated subscriber left)."""
        self._pending.pop(subject, None)

    def __len__(self) -> int:
        return len(self._pending)
