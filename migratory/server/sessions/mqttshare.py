"""MQTT shared subscriptions, ``$share/{group}/{filter}``: each message to one subscriber of the group.

The members of a group may be on every worker of every cluster member. Each worker holding some keeps
one :class:`ShareGroup`: a subscriber of the filter to the engine like any other (so it sees every
message, as every worker does), and the holder of a marker subject,
``<SHARE_PREFIX><hash of group and filter>/<member>`` (migratory/subjects.py). A marker is never
published; its subscriber counts travel as any subject's do, between the workers of a node and, passed
on by the member agents, to every worker of the cluster. So every worker knows which members, and
which workers of its own member, hold the group, and for each message every holder computes the same
choice: the member, then the worker, at the message's (subject, seq) hashed; the chosen worker gives it
to its members in turn. What one worker delivers, the others skip, without a word between them.

What this promises: one delivery a message while the holders' views agree; while a holder joins or
leaves (the interest takes a loop turn, and a cluster link's round trip, to be known everywhere) a
message may reach two members of the group or none. A QoS 1 or 2 message a member was sent and had
not acknowledged when its connection ended goes to another member of the group on the same worker
(MQTT 5 4.8.2); one whose worker holds no other member is not sent again (the session's own
subscriptions recover what it missed; a shared subscription is not part of a stored session here).
"""

from __future__ import annotations

import zlib
from collections import deque
from typing import Any, Protocol

from migratory import protocol as p
from migratory.server.engine.core import INTERNAL, Engine, Origin
from migratory.server.engine.types import Client
from migratory.subjects import SHARE_PREFIX
from migratory.subscriptions import SubjectSet
from migratory.topics import Filter
from migratory.websocket import frame_payload

__all__ = ["Member", "ShareGroup", "ShareGroups"]


class Options(Protocol):
    """A member's options for its shared subscription (the session's own class)."""

    @property
    def qos(self) -> int: ...


class Member(Protocol):
    """What a group asks of a member (migratory/server/sessions/mqtt.py's connection)."""

    def __hash__(self) -> int: ...

    @property
    def open(self) -> bool: ...

    def deliver_shared(self, frame: bytes, options: Any) -> None: ...


RECENT = 256
"""QoS 1 and 2 frames a member was given and may not have acknowledged, kept per member to be given to another
if it leaves (older ones are not: a member so far behind is a slow consumer anyway)."""


class ShareGroup:
    """The members of one group on this worker, and the one subscriber the engine sees for them."""

    __slots__ = (
        "engine",
        "filter",
        "key",
        "listener",
        "marker",
        "members",
        "recent",
        "sid",
        "subscriptions",
        "turn",
        "version",
        "wheel_at",
    )

    def __init__(self, engine: Engine, key: str, filt: Filter) -> None:
        self.engine = engine
        self.key = key  # "$share/{group}/{filter}"
        self.filter = filt
        self.marker = f"{SHARE_PREFIX}{zlib.crc32(key.encode()):08x}/"
        self.members: dict[Member, Options] = {}
        self.recent: dict[Member, deque[tuple[bytes, p.Delivery]]] = {}
        self.turn = 0
        # what the engine asks of a subscriber
        self.sid = 0
        self.listener = "mqtt-share"
        self.version = 2
        self.wheel_at = 0
        self.subscriptions: SubjectSet = ()

    # --- the engine's view: a client ------------------------------------------------------

    @property
    def open(self) -> bool:
        return True

    def origin(self) -> Origin:
        return INTERNAL

    def log_fields(self) -> dict[str, Any]:
        return {"session": f"share {self.key}"}

    def flush(self) -> None:
        return None

    def on_timer(self, now: float) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def send_away(self, reason: str) -> None:
        return None

    def abort(self, reason: str) -> None:
        return None

    def send(self, data: bytes) -> None:
        """A message of the filter: to one member here, if this worker is the one that takes it."""
        if not self.members:
            return
        payload = frame_payload(data)
        if not payload or payload[0] != p.Op.MESSAGE:
            return
        delivery = p.decode_server(payload)
        if not isinstance(delivery, p.Delivery) or not self._ours(delivery.subject, delivery.seq):
            return
        self._give(data, delivery, None)

    # --- the choice -------------------------------------------------------------------------

    def _me(self) -> int:
        return self.engine.config.member_index if self.engine.cluster else 0

    def _ours(self, subject: str, seq: int) -> bool:
        """Whether this worker delivers the message: the same answer on every holder of the group."""
        engine = self.engine
        me = self._me()
        interest = engine.peer_interest
        spread = zlib.crc32(subject.encode()) + seq
        if engine.cluster:
            members = [
                m
                for m in range(len(engine.config.cluster_members))
                if m == me or any(interest.get(f"{self.marker}{m}", {}).values())
            ]
            chosen = members[spread % len(members)]
            if chosen != me:
                return False
            spread //= len(members)
        local = interest.get(f"{self.marker}{me}", {})
        workers = sorted([engine.worker, *(w for w, count in local.items() if count and w != engine.agent)])
        return workers[spread % len(workers)] == engine.worker

    def _give(self, frame: bytes, delivery: p.Delivery, skip: Member | None) -> None:
        """To the members here in turn (the one leaving, ``skip``, excepted)."""
        members = [m for m in self.members if m is not skip and m.open]
        if not members:
            return
        self.turn += 1
        member = members[self.turn % len(members)]
        options = self.members[member]
        member.deliver_shared(frame, options)
        if options.qos and delivery.guaranteed:
            recent = self.recent.get(member)
            if recent is None:
                recent = self.recent[member] = deque(maxlen=RECENT)
            recent.append((frame, delivery))

    # --- membership -------------------------------------------------------------------------

    def join(self, member: Member, options: Options) -> None:
        first = not self.members
        self.members[member] = options
        if first:
            self.engine.hold_marker(self, f"{self.marker}{self._me()}", True)

    def leave(self, member: Member, unacknowledged: set[tuple[str, int]]) -> bool:
        """``member`` leaves; what it had not acknowledged goes to another. True when the group is empty here."""
        self.members.pop(member, None)
        recent = self.recent.pop(member, None)
        if recent and unacknowledged:
            for frame, delivery in recent:
                if (delivery.subject, delivery.seq) in unacknowledged:
                    self._give(frame, delivery, member)
        if self.members:
            return False
        self.engine.hold_marker(self, f"{self.marker}{self._me()}", False)
        return True


class ShareGroups:
    """This worker's groups, by ``$share/{group}/{filter}``."""

    _of: dict[int, ShareGroups] = {}

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.groups: dict[str, ShareGroup] = {}

    @classmethod
    def of(cls, engine: Engine) -> ShareGroups:
        found = cls._of.get(id(engine))
        if found is None or found.engine is not engine:
            found = cls._of[id(engine)] = ShareGroups(engine)
        return found

    def join(self, member: Member, key: str, filt: Filter, options: Options) -> p.Status:
        """``member`` joins the group ``key`` (already entitled to its filter); the group subscribes on first use."""
        group = self.groups.get(key)
        if group is None:
            group = ShareGroup(self.engine, key, filt)
            engine = self.engine
            client: Client = group
            if filt.subject is not None:
                status, _ = engine.subscribe(client, filt.subject, 0, None)
            else:
                assert filt.pattern is not None
                status, _ = engine.subscribe_pattern(client, "\x00" + key, filt.pattern)
            if status != p.Status.OK:
                return status
            self.groups[key] = group
        group.join(member, options)
        return p.Status.OK

    def leave(self, member: Member, key: str, unacknowledged: set[tuple[str, int]]) -> None:
        group = self.groups.get(key)
        if group is None or member not in group.members:
            return
        if group.leave(member, unacknowledged):
            del self.groups[key]
            engine = self.engine
            subject = group.filter.subject
            engine.unsubscribe(group, subject if subject is not None else "\x00" + key)
