"""MQTT sessions kept where the cluster keeps everything else: in the replica, one record per client.

A client's session (its subscriptions, for each subject the last QoS 1 or 2 message it acknowledged,
and the messages in flight with their packet ids) is the snapshot of a private subject,
``/migratory/mqtt/<client id, base64url>``, published as a Guaranteed message whenever it changes
(coalesced: at most one write per session every :data:`WRITE_DELAY`). Every worker of every member
holds every snapshot, so a client that comes back anywhere, after its connection or its whole member
died, finds its session, resubscribes, and gets from the subjects' caches what it had not
acknowledged (docs/mqtt.md, "Sessions"). The record also names its owner, the connection holding it:
every worker hears each record (:attr:`Engine.watch`), and a live connection whose client id was
claimed by a newer connection elsewhere is closed (session takeover, MQTT 3.1.4-3). A clean session
has no record: its connection announces its client id on a claim subject
(``/migratory/mqtt/t<shard>``), and an older connection with that id on another worker or member
closes when it hears it.

No new replication, no new store: what the issue asked ("no second snapshot store").

Where the replica caches nothing (a single node, a Standard cluster), every worker still caches
the subjects the QoS 1 subscriptions of stored sessions want (:class:`Wanted`), so a session
away recovers the messages it missed, as a Mosquitto session's queue would hold them.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from migratory.message import QoS
from migratory.server.engine.core import Engine
from migratory.server.engine.types import PRIVATE_PREFIX
from migratory.topics import Pattern, TopicError, parse_filter, subject_matches, subject_to_topic, topic_levels

__all__ = ["PREFIX", "Record", "SessionStore", "Wanted", "record_subject"]

PREFIX = PRIVATE_PREFIX
WRITE_DELAY = 0.02
"""Seconds a session's changes wait to be written together (acknowledgements come in bursts)."""


def record_subject(client_id: str) -> str:
    encoded = base64.urlsafe_b64encode(client_id.encode()).decode().rstrip("=")
    return f"{PREFIX}c{encoded}"  # the "c": a subject segment is never empty, even for odd ids


CLAIM_SHARDS = 16
"""Claim subjects: one coordinator need not number every clean connection of the cluster."""


def claim_subject(client_id: str) -> str:
    return f"{PREFIX}t{zlib.crc32(client_id.encode()) % CLAIM_SHARDS}"


def _client_id(subject: str) -> str | None:
    encoded = subject[len(PREFIX) + 1 :]
    try:
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass(slots=True)
class Record:
    """One session as stored. ``subs``: (filter, granted QoS, subscription id, retain as published); ``sent``:
    the messages in flight, (packet id, subject, epoch, seq, 1 or 2: its QoS, 3: PUBREC received), so that a
    session resumed anywhere sends each again under the same packet id, or only its PUBREL (exactly once)."""

    owner: str
    since: float  # when its owner connected (wall clock): a newer owner takes over
    open: bool  # its owner is connected (or died without saying)
    expiry: int  # seconds the session outlives its connection (0: it ends with it)
    at: float  # when it was written
    subs: list[tuple[str, int, int, bool]] = field(default_factory=list)
    pos: dict[str, tuple[int, int]] = field(default_factory=dict)
    sent: list[tuple[int, str, int, int, int]] = field(default_factory=list)

    def encode(self) -> bytes:
        raw: dict[str, Any] = {
            "owner": self.owner,
            "since": self.since,
            "open": self.open,
            "expiry": self.expiry,
            "at": self.at,
            "subs": self.subs,
            "pos": self.pos,
        }
        if self.sent:
            raw["sent"] = self.sent
        return json.dumps(raw, separators=(",", ":")).encode()

    @staticmethod
    def decode(content: bytes) -> Record | None:
        """A record, or None for an empty (ended) or unreadable one."""
        if not content:
            return None
        try:
            raw: dict[str, Any] = json.loads(content)
            return Record(
                str(raw["owner"]),
                float(raw["since"]),
                bool(raw["open"]),
                int(raw["expiry"]),
                float(raw["at"]),
                [(str(f), int(q), int(i), bool(r)) for f, q, i, r in raw.get("subs", [])],
                {str(s): (int(e), int(q)) for s, (e, q) in raw.get("pos", {}).items()},
                [(int(i), str(s), int(e), int(q), int(k)) for i, s, e, q, k in raw.get("sent", [])],
            )
        except (ValueError, TypeError, KeyError):
            return None

    def expired(self, now: float) -> bool:
        return not self.open and now - self.at > self.expiry

    @staticmethod
    def ended(owner: str, since: float) -> Record:
        """What an ended session leaves: a record that wants nothing, timed, so that an older one heard later
        (another worker's write coming back through its coordinator) cannot bring the session back."""
        return Record(owner, since, False, 0, time.time())


class Wanted:
    """The subjects this worker's replica keeps for stored sessions: their QoS 1 filters, by session.

    Filled from every record this worker hears (its own, other workers', other members'). A
    record of a session that has ended, or that expired while away, wants nothing.
    """

    SWEEP = 60.0
    """Seconds between looks for sessions that expired away (their records stay as they were)."""

    def __init__(self, engine: Engine) -> None:
        self.replica = engine.replica
        self.by_session: dict[str, tuple[float, frozenset[str]]] = {}  # client id -> (expires at, filters)
        self.holders: dict[str, int] = {}  # filter -> sessions that want it
        self.patterns: dict[str, Pattern] = {}  # wildcard filter -> its pattern
        # client id -> when the record applied last was written: an older one heard later is stale (this
        # worker applies its own writes at once; their predecessors may come back from the coordinator after)
        self.latest: dict[str, float] = {}
        self._swept = 0.0
        self.replica.wants = self._matches

    def heard(self, client_id: str, record: Record | None, now: float) -> None:
        """A session's record as it now stands (None: ended)."""
        wanted: frozenset[str] = frozenset()
        expires = float("inf")
        if record is not None:
            if record.at < self.latest.get(client_id, 0.0):
                return
            self.latest[client_id] = record.at
            if record.expiry and not record.expired(now):
                wanted = frozenset(text for text, qos, _, _ in record.subs if qos)
                if not record.open:
                    expires = record.at + record.expiry
        before = self.by_session.pop(client_id, (0.0, frozenset()))[1]
        if wanted:
            self.by_session[client_id] = (expires, wanted)
        for text in wanted - before:
            self._add(text)
        for text in before - wanted:
            self._remove(text)

    def tick(self) -> None:
        """Every second (the engine's tick): once a minute, forget the sessions that expired away."""
        now = time.time()
        if now - self._swept < self.SWEEP:
            return
        self._swept = now
        for gone in [c for c, (at, _) in self.by_session.items() if at < now]:
            for text in self.by_session.pop(gone)[1]:
                self._remove(text)
        horizon = now - self.SWEEP  # a stale write comes back within milliseconds, not a minute
        for client_id in [c for c, at in self.latest.items() if at < horizon and c not in self.by_session]:
            del self.latest[client_id]

    def _add(self, text: str) -> None:
        """One more session wants filter ``text``: its subjects are kept from now on (the private ones never)."""
        count = self.holders.get(text, 0)
        self.holders[text] = count + 1
        if count:
            return
        try:
            filt = parse_filter(text)
        except TopicError:
            return
        if filt.subject is not None:
            self.replica.keep(filt.subject, True)
        else:
            assert filt.pattern is not None
            self.patterns[text] = filt.pattern
            for subject in self.replica.subjects():
                if subject_matches(filt.pattern, subject) and not subject.startswith(PREFIX):
                    self.replica.keep(subject, True)

    def _remove(self, text: str) -> None:
        count = self.holders.get(text, 0) - 1
        if count > 0:
            self.holders[text] = count
            return
        self.holders.pop(text, None)
        pattern = self.patterns.pop(text, None)
        if pattern is None:
            try:
                filt = parse_filter(text)
            except TopicError:
                return
            subjects = [filt.subject] if filt.subject is not None else []
        else:
            subjects = [s for s in self.replica.kept() if subject_matches(pattern, s)]
        for subject in subjects:
            if not self._matches(subject):
                self.replica.keep(subject, False)

    def _matches(self, subject: str) -> bool:
        """Whether a filter some stored session holds matches ``subject``."""
        if subject_to_topic(subject) in self.holders:
            return True
        if not self.patterns or subject.startswith(PREFIX):
            return False
        levels = topic_levels(subject)
        return any(subject_matches(pattern, subject, levels) for pattern in self.patterns.values())


class Holder(Protocol):
    """What the store needs of a connection (migratory/server/sessions/mqtt.py implements it)."""

    client_id: str

    @property
    def owner(self) -> str: ...

    @property
    def since(self) -> float: ...

    def record(self, *, closed: bool = False) -> Record | None:
        """The session as it stands now (None: it ends with its connection)."""

    def taken_over(self) -> None: ...

    def written(self) -> Callable[[Any], None] | None:
        """What to call once the record :meth:`record` returns now is stored, if anything waits for it."""


class SessionStore:
    """The sessions of one worker: the live connections by client id, and their coalesced writes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tag = secrets.token_hex(6)  # names this worker's connections across the cluster
        self.live: dict[str, Holder] = {}
        self._dirty: dict[str, Holder] = {}
        self._armed = False
        self._claims: dict[str, list[list[Any]]] = {}  # claim subject -> [client id, owner, since] not yet sent
        # what the replica keeps for stored sessions, where it caches nothing else
        self.wanted = Wanted(engine) if not engine.replica.cache_size and engine.replica.keep_size else None
        engine.watch = (PREFIX, self._on_record)
        if self.wanted is not None:  # the records already here (a worker that started after them)
            engine.on_tick.append(self.wanted.tick)
            for subject in engine.replica.subjects():
                if subject.startswith(PREFIX):
                    snapshot = engine.replica.get(subject)
                    self._on_record(subject, snapshot.content if snapshot is not None else b"")

    _stores: dict[int, SessionStore] = {}

    @classmethod
    def of(cls, engine: Engine) -> SessionStore:
        store = cls._stores.get(id(engine))
        if store is None or store.engine is not engine:
            store = cls._stores[id(engine)] = SessionStore(engine)
        return store

    def load(self, client_id: str) -> Record | None:
        snapshot = self.engine.replica.get(record_subject(client_id))
        return Record.decode(snapshot.content) if snapshot is not None else None

    def claim(self, holder: Holder) -> None:
        """``holder`` owns its client id from now on: a local predecessor closes, remote ones hear the record."""
        previous = self.live.get(holder.client_id)
        if previous is not None and previous is not holder:
            previous.taken_over()
        self.live[holder.client_id] = holder
        self.write(holder)

    def register(self, holder: Holder, *, announce: bool = True) -> None:
        """A clean session: no record; its client id announced, for the other workers' and members' takeover."""
        previous = self.live.get(holder.client_id)
        if previous is not None and previous is not holder:
            previous.taken_over()
        self.live[holder.client_id] = holder
        if announce:
            # gathered per shard and loop turn: a storm of clean connections is one publication a shard a turn
            shard = claim_subject(holder.client_id)
            pending = self._claims.get(shard)
            if pending is None:
                pending = self._claims[shard] = []
                if len(self._claims) == 1:
                    self.engine.loop.call_soon(self._announce)
            pending.append([holder.client_id, holder.owner, holder.since])

    def _announce(self) -> None:
        claims, self._claims = self._claims, {}
        for subject, items in claims.items():
            content = json.dumps(items, separators=(",", ":")).encode()
            self.engine.publish_internal(subject, content, {}, QoS.STANDARD)

    def release(self, holder: Holder, record: Record | None, *, write: bool) -> None:
        """The connection ended: its last word (the session kept, or emptied), unless it was taken over."""
        if self.live.get(holder.client_id) is holder:
            del self.live[holder.client_id]
            self._dirty.pop(holder.client_id, None)
            if write:
                record = record or Record.ended(holder.owner, holder.since)
                self._heard_here(holder.client_id, record)
                self._publish(holder.client_id, record.encode())

    def forget(self, holder: Holder) -> None:
        """A clean start: whatever session the client id had ends."""
        snapshot = self.engine.replica.get(record_subject(holder.client_id))
        stored = Record.decode(snapshot.content) if snapshot is not None else None
        if stored is not None and (stored.open or stored.expiry or stored.subs):
            ended = Record.ended(holder.owner, holder.since)
            self._heard_here(holder.client_id, ended)
            self._publish(holder.client_id, ended.encode())

    def mark(self, holder: Holder) -> None:
        """The session changed (an acknowledgement): written within :data:`WRITE_DELAY`, with others."""
        self._dirty[holder.client_id] = holder
        if not self._armed:
            self._armed = True
            self.engine.loop.call_later(WRITE_DELAY, self._flush)

    def write(self, holder: Holder) -> None:
        self._dirty.pop(holder.client_id, None)
        record = holder.record()
        if record is not None:
            self._heard_here(holder.client_id, record)
            self._publish(holder.client_id, record.encode(), holder.written())

    def _heard_here(self, client_id: str, record: Record | None) -> None:
        """This worker keeps what a session wants at once, not when its record comes back from the coordinator."""
        if self.wanted is not None:
            self.wanted.heard(client_id, record, time.time())

    def _flush(self) -> None:
        self._armed = False
        dirty, self._dirty = self._dirty, {}
        for client_id, holder in dirty.items():
            if self.live.get(client_id) is holder:
                self.write(holder)

    def _publish(self, client_id: str, content: bytes, reply: Callable[[Any], None] | None = None) -> None:
        self.engine.publish_internal(record_subject(client_id), content, {}, QoS.GUARANTEED, reply)

    def _on_record(self, subject: str, content: bytes) -> None:
        """Any worker's record reached this one: what it wants kept; a newer owner elsewhere takes the session."""
        kind = subject[len(PREFIX) : len(PREFIX) + 1]
        if kind == "t":
            self._on_claim(content)
            return
        if kind != "c":
            return  # nothing else is written there
        wanted = self.wanted
        if wanted is None and not self.live:
            return
        client_id = _client_id(subject)
        if client_id is None:
            return
        record = Record.decode(content)
        if wanted is not None:
            wanted.heard(client_id, record, time.time())
        holder = self.live.get(client_id)
        if holder is None:
            return
        if record is None or record.owner == holder.owner:
            return
        if (record.since, record.owner) > (holder.since, holder.owner) and record.open:
            self._take_over(holder)

    def _on_claim(self, content: bytes) -> None:
        """Clean connections elsewhere took client ids: an older connection here with one of them ends."""
        if not self.live:
            return
        try:
            claims = json.loads(content)
            for client_id, owner, since in claims:
                holder = self.live.get(str(client_id))
                if holder is None or holder.owner == owner:
                    continue
                if (float(since), str(owner)) > (holder.since, holder.owner):
                    self._take_over(holder)
        except (ValueError, TypeError):
            return

    def _take_over(self, holder: Holder) -> None:
        del self.live[holder.client_id]
        self._dirty.pop(holder.client_id, None)
        holder.taken_over()
