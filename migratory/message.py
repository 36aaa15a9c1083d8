"""Message and snapshot model.

A message is a subject, a content (any bytes) and optional fields. The snapshot of a
subject is its latest content plus the union of all fields ever published on it,
each at its latest value (Architecture Guide, "Snapshot Messages"). Conflation uses
the same merge rule over one conflation period, so both share :func:`merge_fields`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "Message",
    "MessageType",
    "QoS",
    "Snapshot",
    "SnapshotStore",
    "merge_fields",
]


class MessageType(enum.IntEnum):
    """What a delivered message is to its subscriber."""

    SNAPSHOT = 1
    UPDATE = 2


class QoS(enum.IntEnum):
    """Quality of service requested by the publisher."""

    STANDARD = 0
    GUARANTEED = 1


@dataclass(frozen=True, slots=True)
class Message:
    """One published message; immutable so it can be shared by every delivery."""

    subject: str
    content: bytes
    fields: Mapping[str, str] = field(default_factory=dict)
    retained: bool = True
    qos: QoS = QoS.STANDARD
    closure: str = ""


def merge_fields(base: Mapping[str, str], update: Mapping[str, str]) -> dict[str, str]:
    """Union of field names, each field at its latest value (``update`` wins)."""
    merged = dict(base)
    merged.update(update)
    return merged


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The snapshot message of one subject, with its sequence number and epoch."""

    subject: str
    content: bytes
    fields: Mapping[str, str]
    seq: int
    epoch: int


class SnapshotStore:
    """Snapshots of every subject, plus the per-subject sequence numbers.

    Sequence numbers count every publication of a subject (retained or not) within
    one epoch; the epoch changes when the node that numbers the subject restarts,
    so that a (epoch, seq) pair never names two different messages.
    """

    __slots__ = ("_seqs", "_snapshots", "epoch")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self._snapshots: dict[str, Snapshot] = {}
        self._seqs: dict[str, int] = {}

    def next_seq(self, subject: str) -> int:
        """Allocate the next sequence number of ``subject``."""
        seq = self._seqs.get(subject, 0) + 1
        self._seqs[subject] = seq
        return seq

    def apply(self, message: Message, seq: int) -> Snapshot | None:
        """Fold a published message into the subject's snapshot.

        Only retained messages change the snapshot (a non-retained message is
        delivered live but is not the "last value"). Returns the new snapshot, or
        ``None`` when it did not change.
        """
        if not message.retained:
            return None
        previous = self._snapshots.get(message.subject)
        fields = message.fields if previous is None else merge_fields(previous.fields, message.fields)
        snapshot = Snapshot(message.subject, message.content, dict(fields), seq, self.epoch)
        self._snapshots[message.subject] = snapshot
        return snapshot

    def observe(self, subject: str, seq: int) -> None:
        """Record a sequence number assigned elsewhere (a replica following its coordinator)."""
        if seq > self._seqs.get(subject, 0):
            self._seqs[subject] = seq

    def last_seq(self, subject: str) -> int:
        return self._seqs.get(subject, 0)

    def sequenced_subjects(self) -> list[str]:
        """Every subject that has a sequence number (published at least once)."""
        return list(self._seqs)

    def restore(self, subject: str, seq: int, snapshot: Snapshot | None) -> None:
        """Adopt state from a peer's replica when it is newer than ours."""
        self.observe(subject, seq)
        current = self._snapshots.get(subject)
        if snapshot is not None and (current is None or snapshot.seq > current.seq):
            self._snapshots[subject] = snapshot

    def get(self, subject: str) -> Snapshot | None:
        """Return the snapshot of ``subject``, or ``None`` if it has none."""
        return self._snapshots.get(subject)

    def __len__(self) -> int:
        return len(self._snapshots)

    def subjects(self) -> list[str]:
        """All subjects that have a snapshot."""
        return list(self._snapshots)
