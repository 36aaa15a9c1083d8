"""Replicated subject state: snapshots, sequence numbers, the message cache, and merging.

Every process that holds subjects keeps one :class:`Replica`: each worker (it serves
snapshots and recovers reconnecting clients from it) and, in a cluster, each member's
agent (it numbers the messages of the subject groups its member coordinates). All
replicas apply the same frames in the same order, so they hold the same state; the
rules below are the whole of what "the same" means.

- **Position.** A subject's history is a run of numbered messages. Each has a
  ``seq`` that continues by one from the previous message, and the ``epoch`` of the
  coordinator that numbered it; the epoch changes when coordinatorship moves (a
  restart, a failover), the seq does not. ``(epoch, seq)`` of the last message is the
  subject's *position*, and names one message in the cluster.
- **Snapshot.** The latest retained content and the union of all fields, each at its
  latest value (Architecture Guide, "Snapshot Messages").
- **Cache** (Guaranteed mode; elsewhere only the subjects a stored MQTT session wants, see
  :meth:`Replica.keep`): the last ``cache_size`` messages, each for at most
  ``cache_ttl`` seconds, always a contiguous run ending at the position, so a client
  that reconnects with the position of the last message it saw can be sent exactly
  what follows it.
- **Publish ids** (the member agents' replicas): the ids of the messages numbered
  recently, each with its position, at most :data:`IDS_PER_SUBJECT` a subject and
  :data:`MAX_RECENT_IDS` in all, each for at most ``id_window`` seconds, so that a
  publication retried with the same id through any member is numbered once. They
  travel with the subject's state, so a new coordinator knows them too.
- **Merge.** Two replicas that diverged (a member that was cut off, a worker that
  restarted, a coordinator that failed over) exchange :class:`SubjectSync` states.
  The history with the higher ``(seq, epoch)`` wins. When the winner's cache contains
  the loser's position, the loser just receives the missing messages, in order, as
  if live; otherwise it adopts the winner's state and its subscribers are *resynced*
  (they get the new snapshot, flagged so).

No I/O here: callers pass the clock.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from migratory.message import Snapshot, merge_fields

__all__ = [
    "Applied",
    "Entry",
    "Merged",
    "Recovery",
    "RecoveryKind",
    "Replica",
    "SubjectSync",
]


@dataclass(slots=True, unsafe_hash=True)
class Entry:
    """One numbered message, as replicas apply, cache and exchange it (never changed once built; not frozen,
    as a frozen dataclass's __init__ costs 0.3 us a field, and one is built per publication and replica)."""

    epoch: int
    seq: int
    content: bytes
    fields: Mapping[str, str] = field(default_factory=dict)
    retained: bool = True
    publish_id: str = ""
    guaranteed: bool = False  # published Guaranteed (an MQTT subscriber gets it at QoS 1 or 2, not 0)


@dataclass(frozen=True, slots=True)
class SubjectSync:
    """A subject's whole state: position, snapshot and cached messages (oldest first)."""

    subject: str
    epoch: int
    seq: int
    snapshot: Snapshot | None
    entries: tuple[Entry, ...] = ()
    ids: tuple[tuple[str, int, int], ...] = ()  # recent publish ids and their (epoch, seq), oldest first


class Applied(enum.Enum):
    """What :meth:`Replica.apply` did with a live message."""

    NEW = "new"  # the next message: applied
    DUPLICATE = "duplicate"  # already had it (or an older one): ignored
    GAP = "gap"  # messages are missing before it: applied anyway, the cache restarts from it


@dataclass(frozen=True, slots=True)
class Merged:
    """What :meth:`Replica.merge` changed: messages to deliver, or a resync."""

    new: tuple[Entry, ...] = ()
    resync: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.new) or self.resync


NOTHING = Merged()


class RecoveryKind(enum.Enum):
    SYNC = "sync"  # the client missed nothing (or is ahead of this replica and will be caught up live)
    RECOVER = "recover"  # send ``entries`` (the missed messages), then say it is in sync
    RESYNC = "resync"  # no cache (Standard mode) or the gap is not cached: the snapshot, flagged as a resync


@dataclass(frozen=True, slots=True)
class Recovery:
    kind: RecoveryKind
    entries: tuple[Entry, ...] = ()
    snapshot: Snapshot | None = None


IDS_PER_SUBJECT = 1000
MAX_RECENT_IDS = 100_000


_Row = tuple[float, int, int, bytes, tuple[str, ...], bool, str, bool]
"""A cached message: (cached at, epoch, seq, content, fields as name, value, name, ..., retained, publish
id, guaranteed). Plain tuples
of atoms, not the :class:`Entry` it came from: the collector stops tracking such a tuple at its first
collections, while an Entry, a dict (even an empty one) and a tuple holding either stay tracked for as
long as they are cached. A
Guaranteed worker caching 1,000 messages of 1,000 subjects held 2,000,000 tracked objects, and every full
collection walked them all (640 ms here; issue 50's 0.25-1.0 s pauses), for nothing: a cache holds no
cycle. An Entry is made again only for what a recovery or a sync sends."""


def _row(now: float, entry: Entry) -> _Row:
    fields = tuple(itertools.chain.from_iterable(entry.fields.items())) if entry.fields else ()
    return (now, entry.epoch, entry.seq, entry.content, fields, entry.retained, entry.publish_id, entry.guaranteed)


def _entry(row: _Row) -> Entry:
    fields = row[4]
    return Entry(row[1], row[2], row[3], dict(zip(fields[::2], fields[1::2], strict=True)), row[5], row[6], row[7])


class _State:
    __slots__ = ("cache", "epoch", "ids", "seq", "snapshot")

    def __init__(self) -> None:
        self.epoch = 0
        self.seq = 0
        self.snapshot: Snapshot | None = None
        self.cache: deque[_Row] | None = None
        self.ids: deque[tuple[float, str, int, int]] | None = None


class Replica:
    """Every subject's position, snapshot and (optionally) cache, in one process."""

    __slots__ = (
        "_cache_due",
        "_cached",
        "_ids",
        "_ids_due",
        "_kept",
        "_messages",
        "_recent",
        "_snapshots",
        "_states",
        "_with_ids",
        "cache_size",
        "cache_ttl",
        "gaps",
        "id_window",
        "keep_size",
        "wants",
    )

    def __init__(self, cache_size: int = 0, cache_ttl: float = 0.0, id_window: float = 0.0, keep_size: int = 0) -> None:
        self.cache_size = cache_size
        # without a cache for every subject, the subjects a stored MQTT session wants are cached anyway (at
        # keep_size): a session away recovers what it missed from them, as it would in a Guaranteed cluster
        self.keep_size = keep_size
        self._kept: set[str] = set()
        # asked once per new subject whether to keep it (a wildcard filter of a stored session matches it)
        self.wants: Callable[[str], bool] | None = None
        self.cache_ttl = cache_ttl
        self.id_window = id_window  # seconds a numbered publish id is remembered (0: only while cached)
        # publish id -> position, oldest first; an OrderedDict: dropping a plain dict's first key again and
        # again walks the holes earlier drops left (104 us each at 100,000 ids), and a rejoining agent
        # merging 200,000 cached messages' ids stalled for a second a turn and lost its links
        self._recent: OrderedDict[str, tuple[str, int, int]] = OrderedDict()
        # Expiry walks only what is due: each subject with a cache (or ids) is filed in a heap under the
        # time of its oldest entry, and the dict says which heap entry is the current one (a cache
        # dropped and made again leaves its old entry behind, skipped when it comes up; bounded, as it
        # comes up within cache_ttl). A walk over every subject on each tick cost a member's agent
        # about 7 ms a tick at 10,000 subjects, most of its CPU while the cluster was otherwise idle.
        # The clock must not go back (callers pass their loop's time), or an entry could outlive its
        # time until the subject's next filing.
        self._with_ids: dict[str, float] = {}
        self._ids_due: list[tuple[float, str]] = []
        self._states: dict[str, _State] = {}
        self._cached: dict[str, float] = {}
        self._cache_due: list[tuple[float, str]] = []
        self._messages = 0  # cached messages in all, kept as caches change (the agent reports it every second)
        self._ids: dict[str, tuple[str, int, int]] = {}
        self._snapshots = 0  # subjects with a snapshot, kept as they change: counted every second
        self.gaps = 0

    # --- reading ------------------------------------------------------------------------

    def get(self, subject: str) -> Snapshot | None:
        """The snapshot of ``subject``, or None."""
        state = self._states.get(subject)
        return state.snapshot if state is not None else None

    def position(self, subject: str) -> tuple[int, int]:
        """``(epoch, seq)`` of the subject's last message; ``(0, 0)`` before the first."""
        state = self._states.get(subject)
        return (state.epoch, state.seq) if state is not None else (0, 0)

    def epoch_of(self, subject: str, seq: int) -> int | None:
        """The epoch of message ``seq`` of ``subject`` if this replica still knows it (position or cache)."""
        state = self._states.get(subject)
        if state is None:
            return None
        if seq == state.seq:
            return state.epoch
        cache = state.cache
        if cache:
            at = seq - cache[0][2]  # the cache is a contiguous run
            if 0 <= at < len(cache) and cache[at][2] == seq:
                return cache[at][1]
        return None

    def subjects(self) -> list[str]:
        """Every subject with a position (published at least once)."""
        return list(self._states)

    def subject_count(self) -> int:
        """``len(subjects())`` without the list."""
        return len(self._states)

    def __len__(self) -> int:
        """Subjects that have a snapshot."""
        return self._snapshots

    def caches(self, subject: str) -> bool:
        """Whether this replica caches ``subject``'s messages (all subjects, or one that is kept)."""
        return bool(self.cache_size) or (bool(self.keep_size) and subject in self._kept)

    def holds(self, subject: str, epoch: int, seq: int) -> bool:
        """Whether message ``(epoch, seq)`` of ``subject`` is in the cache (a recovery can send it again)."""
        state = self._states.get(subject)
        cache = state.cache if state is not None else None
        if not cache:
            return False
        at = seq - cache[0][2]
        return 0 <= at < len(cache) and cache[at][2] == seq and cache[at][1] == epoch

    def _size(self, subject: str) -> int:
        return self.cache_size or (self.keep_size if subject in self._kept else 0)

    def keep(self, subject: str, on: bool) -> None:
        """Cache ``subject`` although this replica caches nothing else (``on``), or stop and drop its cache."""
        if not self.keep_size or self.cache_size:
            return
        if on:
            self._kept.add(subject)
        elif subject in self._kept:
            self._kept.discard(subject)
            state = self._states.get(subject)
            if state is not None:
                self._drop_cache(subject, state)

    def kept(self) -> set[str]:
        """The subjects cached because a stored session wants them."""
        return set(self._kept)

    def cached_messages(self) -> int:
        return self._messages

    def find_publish(self, publish_id: str) -> tuple[str, int, int] | None:
        """``(subject, epoch, seq)`` of a recent message with this publish id (idempotent retries)."""
        if not publish_id:
            return None
        return self._ids.get(publish_id) or self._recent.get(publish_id)

    def sync(self, subject: str) -> SubjectSync | None:
        """The subject's whole state, to send to another replica."""
        state = self._states.get(subject)
        if state is None:
            return None
        entries = tuple(map(_entry, state.cache)) if state.cache else ()
        ids = tuple((pid, epoch, seq) for _, pid, epoch, seq in state.ids) if state.ids else ()
        return SubjectSync(subject, state.epoch, state.seq, state.snapshot, entries, ids)

    # --- numbering and live messages -----------------------------------------------------

    def next_seq(self, subject: str) -> int:
        """The seq the coordinator gives the subject's next message."""
        state = self._states.get(subject)
        return state.seq + 1 if state is not None else 1

    def apply(self, subject: str, entry: Entry, now: float = 0.0) -> Applied:
        """Apply a live message (the coordinator's own, or one it sent)."""
        state = self._states.get(subject)
        if state is None:
            state = self._new_state(subject)
        elif entry.seq <= state.seq:
            return Applied.DUPLICATE
        outcome = Applied.NEW
        if state.seq and entry.seq != state.seq + 1:
            outcome = Applied.GAP
            self.gaps += 1
            self._drop_cache(subject, state)  # the cache must stay contiguous
        self._advance(subject, state, entry, now)
        return outcome

    def _new_state(self, subject: str) -> _State:
        state = self._states[subject] = _State()
        wants = self.wants
        if wants is not None and self.keep_size and not self.cache_size and wants(subject):
            self._kept.add(subject)
        return state

    def _advance(self, subject: str, state: _State, entry: Entry, now: float) -> None:
        state.epoch = entry.epoch
        state.seq = entry.seq
        if entry.retained:
            previous = state.snapshot
            if previous is None:
                self._snapshots += 1
            fields = entry.fields if previous is None else merge_fields(previous.fields, entry.fields)
            state.snapshot = Snapshot(subject, entry.content, dict(fields), entry.seq, entry.epoch, entry.guaranteed)
        size = self.cache_size or (self.keep_size if self._kept and subject in self._kept else 0)
        if size:
            cache = state.cache
            if cache is None:
                cache = state.cache = deque()
                self._cache_from(subject, now)
            if len(cache) >= size:
                self._forget(cache.popleft())
                self._messages -= 1
            cache.append(_row(now, entry))
            self._messages += 1
            if entry.publish_id:
                self._ids[entry.publish_id] = (subject, entry.epoch, entry.seq)
        if self.id_window and entry.publish_id:
            self._remember(subject, state, entry.publish_id, entry.epoch, entry.seq, now)

    def _remember(self, subject: str, state: _State, pid: str, epoch: int, seq: int, now: float) -> None:
        """Keep a numbered publish id for ``id_window`` seconds (bounded per subject and in all)."""
        if pid in self._recent:
            return  # the first numbering is the one that counts
        ids = state.ids
        if ids is None:
            ids = state.ids = deque()
            self._ids_from(subject, now)
        if len(ids) >= IDS_PER_SUBJECT:
            self._unremember(ids.popleft())
        ids.append((now, pid, epoch, seq))
        self._recent[pid] = (subject, epoch, seq)
        if len(self._recent) > MAX_RECENT_IDS:
            self._recent.popitem(last=False)  # the oldest; its subject's deque forgets it later

    def _unremember(self, item: tuple[float, str, int, int]) -> None:
        _, pid, epoch, seq = item
        known = self._recent.get(pid)
        if known is not None and known[1:] == (epoch, seq):
            del self._recent[pid]

    def _forget(self, row: _Row) -> None:
        pid = row[6]
        if pid:
            known = self._ids.get(pid)
            if known is not None and known[1] == row[1] and known[2] == row[2]:
                del self._ids[pid]

    def _drop_cache(self, subject: str, state: _State) -> None:
        if state.cache:
            for row in state.cache:
                self._forget(row)
            self._messages -= len(state.cache)
        state.cache = None
        self._cached.pop(subject, None)

    def _cache_from(self, subject: str, when: float) -> None:
        """``subject``'s oldest cached message is from ``when``: file it for expiry then (if messages expire)."""
        self._cached[subject] = when
        if self.cache_ttl:
            heapq.heappush(self._cache_due, (when, subject))

    def _ids_from(self, subject: str, when: float) -> None:
        """``subject``'s oldest remembered publish id is from ``when``: file it for expiry then."""
        self._with_ids[subject] = when
        heapq.heappush(self._ids_due, (when, subject))

    def expire(self, now: float) -> int:
        """Drop cached messages older than ``cache_ttl`` (and publish ids older than ``id_window``);
        returns how many messages. Costs what is due, not the number of subjects."""
        if self.id_window:
            horizon = now - self.id_window
            heap, current = self._ids_due, self._with_ids
            while heap and heap[0][0] <= horizon:
                when, subject = heapq.heappop(heap)
                if current.get(subject) != when:
                    continue  # a stale entry: the subject's ids were dropped and remembered again since
                state = self._states[subject]
                ids = state.ids
                assert ids is not None
                while ids and ids[0][0] <= horizon:
                    self._unremember(ids.popleft())
                if ids:
                    self._ids_from(subject, ids[0][0])  # the oldest left (maybe pushed out by size)
                else:
                    state.ids = None
                    del current[subject]
        if not self.cache_ttl:
            return 0
        cutoff = now - self.cache_ttl
        dropped = 0
        heap, current = self._cache_due, self._cached
        while heap and heap[0][0] <= cutoff:
            when, subject = heapq.heappop(heap)
            if current.get(subject) != when:
                continue  # stale, as above
            state = self._states[subject]
            cache = state.cache
            assert cache is not None
            while cache and cache[0][0] <= cutoff:
                self._forget(cache.popleft())
                dropped += 1
            if cache:
                self._cache_from(subject, cache[0][0])
            else:
                state.cache = None
                del current[subject]
        self._messages -= dropped
        return dropped

    # --- merging another replica's state -----------------------------------------------

    def merge(self, sync: SubjectSync, now: float = 0.0) -> Merged:
        """Fold another replica's state of one subject into ours (see the module docstring)."""
        if sync.seq == 0 and sync.snapshot is None:
            return NOTHING
        merged = self._merge(sync, now)
        if self.id_window and sync.ids:
            state = self._states[sync.subject]
            for pid, epoch, seq in sync.ids:
                # only the ids of messages in our history: a history that lost the merge numbered messages
                # that are not in it, and a retry of one must be numbered, not answered as done
                if self.epoch_of(sync.subject, seq) in (None, epoch) and seq <= state.seq:
                    self._remember(sync.subject, state, pid, epoch, seq, now)
        return merged

    def _merge(self, sync: SubjectSync, now: float) -> Merged:
        subject = sync.subject
        state = self._states.get(subject)
        if state is None:
            if sync.entries and sync.entries[0].seq == 1 and sync.entries[-1].seq == sync.seq:
                state = self._new_state(subject)  # the whole history is cached: all of it is new here
                for entry in sync.entries:
                    self._advance(subject, state, entry, now)
                return Merged(new=sync.entries)
            self._adopt(sync, now)
            return Merged(resync=True)
        ours = (state.seq, state.epoch)
        theirs = (sync.seq, sync.epoch)
        if theirs == ours:
            self._prepend(subject, state, sync.entries, now)
            return NOTHING
        if theirs < ours:
            self._prepend(subject, state, sync.entries, now)
            return NOTHING
        after = _after(sync.entries, state.epoch, state.seq)
        if after is not None:
            new = sync.entries[after:]
            for entry in new:
                self._advance(subject, state, entry, now)
            return Merged(new=new)
        self._adopt(sync, now)
        return Merged(resync=True)

    def _adopt(self, sync: SubjectSync, now: float) -> None:
        state = self._states.get(sync.subject)
        if state is None:
            state = self._new_state(sync.subject)
        else:
            self._drop_cache(sync.subject, state)
        self._snapshots += (sync.snapshot is not None) - (state.snapshot is not None)
        state.epoch, state.seq, state.snapshot = sync.epoch, sync.seq, sync.snapshot
        if self._size(sync.subject) and sync.entries and sync.entries[-1].seq == sync.seq:
            self._fill(sync.subject, state, sync.entries, now)

    def _fill(self, subject: str, state: _State, entries: Iterable[Entry], now: float) -> None:
        kept = list(entries)[-self._size(subject) :]
        if not kept:
            return
        state.cache = deque(_row(now, entry) for entry in kept)
        self._messages += len(kept)
        self._cache_from(subject, now)
        for entry in kept:
            if entry.publish_id:
                self._ids[entry.publish_id] = (subject, entry.epoch, entry.seq)

    def _prepend(self, subject: str, state: _State, entries: tuple[Entry, ...], now: float) -> None:
        """Older messages we lack, from a history consistent with ours (a member that joined late)."""
        size = self._size(subject)
        if not size or not entries:
            return
        cache = state.cache
        anchor_seq, anchor_epoch = (cache[0][2], cache[0][1]) if cache else (state.seq, state.epoch)
        at = _find(entries, anchor_seq)
        if at is None or entries[at].epoch != anchor_epoch or (cache and at == 0):
            return
        room = size - (len(cache) if cache else 0)
        if room <= 0:
            return
        older = entries[max(0, at - room) : at] if cache else entries[max(0, at + 1 - room) : at + 1]
        merged = list(older) + ([_entry(row) for row in cache] if cache else [])
        self._drop_cache(subject, state)
        self._fill(subject, state, merged, now)

    # --- clients coming back -----------------------------------------------------------

    def recover(self, subject: str, epoch: int, seq: int) -> Recovery:
        """What a client that last saw ``(epoch, seq)`` of ``subject`` needs now (``(0, 0)``: it saw none of it)."""
        state = self._states.get(subject)
        if state is None:
            return Recovery(RecoveryKind.RESYNC)
        cached = self.caches(subject)
        if (epoch, seq) == (0, 0) and cached and state.cache and state.cache[0][2] == 1:
            return Recovery(RecoveryKind.RECOVER, tuple(map(_entry, state.cache)))  # saw nothing: all of it
        if seq > state.seq and epoch >= state.epoch:
            return Recovery(RecoveryKind.SYNC)  # it saw messages this replica is about to receive
        if not cached:  # Standard mode: after a failover, the current snapshot
            return Recovery(RecoveryKind.RESYNC, snapshot=state.snapshot)
        if (epoch, seq) == (state.epoch, state.seq):
            return Recovery(RecoveryKind.SYNC)
        if state.cache:
            after = _after_row(state.cache, epoch, seq)
            if after is not None:  # only what it missed is made into entries again
                return Recovery(RecoveryKind.RECOVER, tuple(map(_entry, itertools.islice(state.cache, after, None))))
        return Recovery(RecoveryKind.RESYNC, snapshot=state.snapshot)


def _after(entries: tuple[Entry, ...], epoch: int, seq: int) -> int | None:
    """Index of the message that follows ``(epoch, seq)`` in ``entries``, when they continue that history.

    They do when they hold ``(epoch, seq)`` itself, or start right after it in the same
    epoch (one coordinator numbers an epoch's messages without holes, so its seq + 1
    follows its seq).
    """
    at = _find(entries, seq)
    if at is not None:
        return at + 1 if entries[at].epoch == epoch else None
    if entries and entries[0].seq == seq + 1 and entries[0].epoch == epoch:
        return 0
    return None


def _after_row(cache: deque[_Row], epoch: int, seq: int) -> int | None:
    """:func:`_after` on a cache's rows (a row's epoch is at 1, its seq at 2)."""
    if not cache:
        return None
    at = seq - cache[0][2]
    if 0 <= at < len(cache) and cache[at][2] == seq:
        return at + 1 if cache[at][1] == epoch else None
    if cache[0][2] == seq + 1 and cache[0][1] == epoch:
        return 0
    return None


def _find(entries: tuple[Entry, ...], seq: int) -> int | None:
    """Index of the entry numbered ``seq`` in a contiguous run, or None."""
    if not entries:
        return None
    at = seq - entries[0].seq
    if 0 <= at < len(entries) and entries[at].seq == seq:
        return at
    return None
