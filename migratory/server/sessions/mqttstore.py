"""MQTT sessions kept where the cluster keeps everything else: in the replica, one record per client.

A client's session (its subscriptions, and for each subject the last QoS 1 message it
acknowledged) is the snapshot of a private subject, ``/migratory/mqtt/<client id, base64url>``,
published as a Guaranteed message whenever it changes (coalesced: at most one write per
session every :data:`WRITE_DELAY`). Every worker of every member holds every snapshot, so a
client that comes back anywhere, after its connection or its whole member died, finds its
session, resubscribes, and gets from the subjects' caches what it had not acknowledged
(docs/mqtt.md, "Sessions"). The record also names its owner, the connection holding it: every
worker hears each record (:attr:`Engine.watch`), and a live connection whose client id was
claimed by a newer connection elsewhere is closed (session takeover, MQTT 3.1.4-3).

No new replication, no new store: what the issue asked ("no second snapshot store").
"""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from migratory.message import QoS
from migratory.replica import Entry
from migratory.server.engine.core import PRIVATE_PREFIX, Engine

__all__ = ["PREFIX", "Record", "SessionStore", "record_subject"]

PREFIX = PRIVATE_PREFIX
WRITE_DELAY = 0.02
"""Seconds a session's changes wait to be written together (acknowledgements come in bursts)."""


def record_subject(client_id: str) -> str:
    encoded = base64.urlsafe_b64encode(client_id.encode()).decode().rstrip("=")
    return f"{PREFIX}c{encoded}"  # the "c": a subject segment is never empty, even for odd ids


def _client_id(subject: str) -> str | None:
    encoded = subject[len(PREFIX) + 1 :]
    try:
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass(slots=True)
class Record:
    """One session as stored. ``subs``: (filter, granted QoS, subscription id, retain as published)."""

    owner: str
    since: float  # when its owner connected (wall clock): a newer owner takes over
    open: bool  # its owner is connected (or died without saying)
    expiry: int  # seconds the session outlives its connection (0: it ends with it)
    at: float  # when it was written
    subs: list[tuple[str, int, int, bool]] = field(default_factory=list)
    pos: dict[str, tuple[int, int]] = field(default_factory=dict)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "owner": self.owner,
                "since": self.since,
                "open": self.open,
                "expiry": self.expiry,
                "at": self.at,
                "subs": self.subs,
                "pos": self.pos,
            },
            separators=(",", ":"),
        ).encode()

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
            )
        except (ValueError, TypeError, KeyError):
            return None

    def expired(self, now: float) -> bool:
        return not self.open and now - self.at > self.expiry


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


class SessionStore:
    """The sessions of one worker: the live connections by client id, and their coalesced writes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tag = secrets.token_hex(6)  # names this worker's connections across the cluster
        self.live: dict[str, Holder] = {}
        self._dirty: dict[str, Holder] = {}
        self._armed = False
        engine.watch = (PREFIX, self._on_record)

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

    def register(self, holder: Holder) -> None:
        """A clean session: known here for a local takeover, nothing written."""
        previous = self.live.get(holder.client_id)
        if previous is not None and previous is not holder:
            previous.taken_over()
        self.live[holder.client_id] = holder

    def release(self, holder: Holder, record: Record | None, *, write: bool) -> None:
        """The connection ended: its last word (the session kept, or emptied), unless it was taken over."""
        if self.live.get(holder.client_id) is holder:
            del self.live[holder.client_id]
            self._dirty.pop(holder.client_id, None)
            if write:
                self._publish(holder.client_id, record.encode() if record is not None else b"")

    def forget(self, client_id: str) -> None:
        """A clean start: whatever session the client id had is emptied."""
        snapshot = self.engine.replica.get(record_subject(client_id))
        if snapshot is not None and snapshot.content:
            self._publish(client_id, b"")

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
            self._publish(holder.client_id, record.encode())

    def _flush(self) -> None:
        self._armed = False
        dirty, self._dirty = self._dirty, {}
        for client_id, holder in dirty.items():
            if self.live.get(client_id) is holder:
                self.write(holder)

    def _publish(self, client_id: str, content: bytes, reply: Callable[[Any], None] | None = None) -> None:
        self.engine.publish_internal(record_subject(client_id), content, {}, QoS.GUARANTEED, reply)

    def _on_record(self, subject: str, entry: Entry) -> None:
        """Any worker's record reached this one: a newer owner elsewhere takes the session from ours."""
        if not self.live:
            return
        client_id = _client_id(subject)
        holder = self.live.get(client_id) if client_id is not None else None
        if holder is None:
            return
        record = Record.decode(entry.content)
        if record is None or record.owner == holder.owner:
            return
        if (record.since, record.owner) > (holder.since, holder.owner) and record.open:
            del self.live[holder.client_id]
            self._dirty.pop(holder.client_id, None)
            holder.taken_over()
