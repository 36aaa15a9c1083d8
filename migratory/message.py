"""Message and snapshot model.

A message is a subject, a content (any bytes) and optional fields. The snapshot of a
subject is its latest content plus the union of all fields ever published on it,
each at its latest value (Architecture Guide, "Snapshot Messages"). Conflation uses
the same merge rule over one conflation period, so both share :func:`merge_fields`.
Replicas of snapshots, sequence numbers and cached messages live in
migratory/replica.py.
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
    "merge_fields",
]


class MessageType(enum.IntEnum):
    """What a delivered message is to its subscriber."""

    SNAPSHOT = 1
    UPDATE = 2
    RECOVERED = 3  # missed during a failover, resent from the cluster's cache (Guaranteed mode)


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
    publish_id: str = ""  # names the message across retries (a cluster numbers it once)


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
    guaranteed: bool = False  # its latest message's QoS: an MQTT retained message keeps the QoS it was published with
