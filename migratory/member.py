"""One cluster member's decisions, without I/O: routing, numbering, replication, failover.

The member's *agent* process (migratory/server/cluster/agent.py) feeds this state machine
what arrives from its peers (the other members' agents) and from its own workers,
plus a clock tick; the machine answers through a :class:`Wire`. docs/cluster.md
tells the same story for operators. In short:

- **Groups and epochs.** Every subject belongs to one of 64 groups; every group has
  an epoch whose owner (``epoch % members``, migratory/groups.py) is the group's
  coordinator. Only the coordinator numbers the group's messages: ``(epoch, seq)``
  with ``seq`` continuing the subject's history by one.
- **Fencing, then merging.** A member that becomes a group's coordinator picks a new,
  higher epoch and sends it to the other members in a :class:`SyncRequest`. Each
  adopts the higher epoch *before* it answers with its state of the group's subjects,
  and from then on drops messages of older epochs for that group. When everyone
  expected has answered, the new coordinator holds the merge of all their states
  (migratory/replica.py), sends that merged state to every member, and only then
  starts numbering. So whatever any member had accepted from the old coordinator is
  carried into the new epoch, and nothing the old coordinator sends later is.
- **Standard mode**: every member decides who coordinates from its own view of who is
  alive (rendezvous hashing), waits for the answers of the members it sees, and
  answers publishers as soon as a message is numbered.
- **Guaranteed mode**: the seed members' consensus decides who is a member and who
  coordinates (a :class:`~migratory.groups.Table`); a new coordinator waits for every
  member of the table; every member caches recent messages; a coordinator releases a
  message to its own subscribers, and answers its publisher, only when another member
  of the table has acknowledged it, so each acknowledged message is held by at least
  two members. Without a quorum, Guaranteed publications are refused.
- **Joining.** A member that starts (or was dropped from the table) is not *ready*: it
  takes a full state sync from a ready member before it serves anyone; live messages
  that arrive meanwhile wait, then apply on top.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from migratory.bus import (
    Ack,
    BusFrame,
    ClusterInfo,
    Forward,
    ForwardStatus,
    Heartbeat,
    Interest,
    Published,
    Relay,
    SyncDone,
    SyncRequest,
    SyncSubject,
    TableFrame,
    sync_frames,
)
from migratory.groups import GROUPS, Table, epoch_for, group_of, owner_of, rendezvous
from migratory.protocol import Status
from migratory.replica import Applied, Entry, Replica, SubjectSync
from migratory.subjects import SHARE_PREFIX, private_first

__all__ = ["Member", "MemberSettings", "Wire"]

MAX_HOPS = 4
MERGE_CACHE = 32  # Standard mode: messages per subject an agent keeps for merges (not for clients)
MERGE_CACHE_TTL = 10.0  # s
QUORUM_GRACE = 0.5  # s without a quorum before a Guaranteed member that served sends its clients away


class Wire(Protocol):
    """What the member asks of its I/O adapter."""

    def to_peer(self, member: int, frame: BusFrame) -> None: ...

    def stream_to_peer(self, member: int, frames: Iterator[BusFrame]) -> None:
        """Send frames encoded only as the link has room for them; what is sent to ``member`` after follows them."""

    def to_workers(self, frame: BusFrame) -> None: ...

    def to_worker(self, worker: int, frame: BusFrame) -> None: ...

    def stream_to_worker(self, worker: int, frames: Iterator[BusFrame]) -> None:
        """Send frames rendered only as the worker reads them (a whole state: they are not all held at once)."""

    def stream_to_workers(self, workers: Iterable[int], frames: Iterator[BusFrame]) -> None:
        """As stream_to_worker, to several workers, each frame rendered once for all of them."""

    def drop_peer(self, member: int, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class MemberSettings:
    index: int
    size: int
    guaranteed: bool = False
    seeds: int = 0
    cache_size: int = 1000
    cache_ttl: float = 180.0
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 3.0
    publish_timeout: float = 6.0
    epoch_floor: int = 0  # epochs this member issues start above this (its restart counter times size)
    incarnation: int = 0  # this agent process (random at start): a restarted agent is another member to the table


@dataclass(slots=True)
class _Peer:
    index: int
    incarnation: int
    heard: float
    ready: bool = False
    leader: bool = False
    table_version: int = 0
    sees: tuple[int, ...] = ()  # the members this peer sees serving (from its heartbeats)
    their_sent: int = 0
    their_sent_at: float = 0.0
    rtt_ms: float = -1.0
    status: dict[str, Any] = field(default_factory=dict)
    linked: float = 0.0  # when this link came up
    beats: int = 0  # heartbeats heard on it


@dataclass(slots=True)
class _Pending:
    """A publication this member accepted and must answer: from one of its workers or from a peer."""

    source: tuple[str, int, int]  # ("worker" | "peer", index, their request id)
    frame: Forward
    deadline: float
    sent_to: int = -1  # the peer it was forwarded to, -1 while it waits here


@dataclass(slots=True)
class _Claim:
    request: int
    groups: dict[int, int]  # group -> the epoch claimed
    awaiting: set[int]
    deadline: float


@dataclass(slots=True)
class _Unacked:
    """Guaranteed mode, coordinator: numbered, cached here, not yet held by a second member.

    ``epoch`` is the coordinator's epoch whose acknowledgements release it: the message's own, or, for
    a message numbered under an earlier epoch of this member and carried into a new claim of its group
    (:meth:`Member._carry`), the new one; peers then acknowledge the coordinator's state, not the message.
    """

    seq: int
    frame: Published
    waiters: list[_Pending]
    sent: float = 0.0  # when it was last sent to the other members
    epoch: int = 0

    @property
    def carried(self) -> bool:
        return self.epoch != self.frame.epoch


class Member:
    """The state machine of one member's agent.

    Why it is long: failover, joins, numbering and replication decide on the same state (epochs,
    table, peers, claims, unconfirmed messages); each transition must see all of it, which is what
    lets tests/test_member.py replay any interleaving without I/O.
    """

    def __init__(self, settings: MemberSettings, wire: Wire, now: float) -> None:
        self.s = settings
        self.me = settings.index
        self.n = settings.size
        self.wire = wire
        self.replica = self._new_replica()
        self.epochs = [0] * GROUPS
        self.active = [False] * GROUPS
        self.peers: dict[int, _Peer] = {}
        self.workers: set[int] = set()
        self.ready = False  # holds the cluster's state (joined)
        self.serving = False  # ready and linked to every member the others see: what heartbeats advertise
        self.links_problem: Callable[[], str] = str  # the agent's word on its worker links ("" when all are up)
        self.started = now
        self.table = Table()
        self._leader = False
        self._leading_since = 0.0  # when this member last became the seeds' leader
        self.leader_quorum = False
        self.term = 0  # the seed members' Raft term, as this seed's consensus knows it (0 elsewhere)
        self.last_leader_heartbeat = -1e9
        self._leader_fresh = False
        self._resumed_at: float | None = None  # Guaranteed: a long pause whose view is not confirmed yet
        self._resume_confirmed: set[int] = set()  # seeds that answered a post-pause heartbeat at our version
        self._next_request = 0
        self._claims: dict[int, _Claim] = {}
        self._pending: dict[int, _Pending] = {}
        self._waiting: list[_Pending] = []  # publications with no reachable coordinator yet
        self._unacked: dict[str, deque[_Unacked]] = {}
        self._unacked_ids: dict[str, tuple[str, int, int]] = {}  # publish id -> (subject, epoch, seq), in flight
        self._confirmed: dict[str, tuple[int, int]] = {}  # subject -> the (epoch, seq) last confirmed to the peers
        self._asked: dict[int, float] = {}  # group -> when its coordinator was last asked for its state (a hole)
        # Guaranteed: applied here, not yet confirmed held by two members of the table (received from the coordinator
        # and acknowledged; or numbered here under an epoch since superseded): kept from the workers, so that no
        # subscriber sees what the cluster can still lose. The group's coordinator's confirmations release them.
        self._unconfirmed: dict[str, deque[Published]] = {}
        self._expect_admission = True  # the next table that adds us is the one we wait for (not a missed exclusion)
        self._serving_since = 0.0
        self._no_quorum_since: float | None = None  # Guaranteed: since when this member has no quorum
        self._has_served = False  # this process was ready once (Guaranteed: it never starts a cluster alone again)
        self._join: tuple[int, int] | None = None  # (request, peer) of the full sync in progress
        self._held: list[tuple[int, BusFrame]] = []  # live frames that arrived while joining
        self._partial: dict[tuple[int, str], list[Entry]] = {}
        self._local: dict[str, dict[int, int]] = {}  # subject -> worker -> subscribers
        self._totals: dict[str, int] = {}
        self._interest_dirty: set[str] = set()
        self._remote: dict[str, dict[int, int]] = {}  # subject -> member -> subscribers
        self._last_beat = -1e9
        self._last_tick: float | None = None
        self._last_grace = -1e9
        self._pause_seen: float | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "replicated_in",
                "replicated_out",
                "forwarded",
                "link_up",
                "link_down",
                "resyncs",
                "syncs_served",
                "joins",
                "paused",
                "stale_dropped",
                "readmitted",
                "conflicts",
                "claims",
                "acks_in",
                "publish_failed",
                "resumed",
                "holes",
            ),
            0,
        )
        self.status: Callable[[], Mapping[str, Any]] = dict

    # --- helpers ----------------------------------------------------------------------

    def _new_replica(self) -> Replica:
        """The cache in Guaranteed mode; in both modes the publish ids numbered in the last CacheExpireTime.

        In Standard mode the agent keeps the last :data:`MERGE_CACHE` messages of each subject for
        :data:`MERGE_CACHE_TTL` seconds: a new coordinator's merged state and the old one's last live
        messages travel on two links, in no order between them, and a state that overtakes them must
        carry them, or the member could only resync its subscribers for what is about to arrive.
        """
        s = self.s
        if s.guaranteed:
            return Replica(s.cache_size, s.cache_ttl, id_window=s.cache_ttl)
        return Replica(MERGE_CACHE, min(s.cache_ttl, MERGE_CACHE_TTL), id_window=s.cache_ttl)

    def _request(self) -> int:
        self._next_request += 1
        return self._next_request

    def owner(self, group: int) -> int:
        return owner_of(self.epochs[group], self.n)

    @property
    def leader(self) -> bool:
        """This member is the seed members' Raft leader (set by the consensus adapter)."""
        return self._leader

    @leader.setter
    def leader(self, value: bool) -> None:
        if value and not self._leader:
            self._leading_since = self._last_tick if self._last_tick is not None else self.started
        self._leader = value

    @property
    def quorum(self) -> bool:
        """Guaranteed mode: whether this member may number or accept guaranteed publications."""
        if not self.s.guaranteed:
            return True
        return self.leader_quorum if self.leader else self._leader_fresh

    def _ready_peers(self) -> list[int]:
        return [j for j, peer in self.peers.items() if peer.ready]

    def missing(self) -> list[int]:
        """Members that a linked peer sees serving but that this member is not linked to (or not heard
        ready from) yet: until there are none, this member may not coordinate anything, or it would
        number a group beside a coordinator it cannot see (a rejoin's classic split)."""
        wanted = {j for peer in self.peers.values() for j in peer.sees} - {self.me}
        return sorted(j for j in wanted if j not in self.peers or not self.peers[j].ready)

    def _check_serving(self, now: float) -> None:
        """Start serving (advertise ready, take groups) once the state is held and the view is complete."""
        if self.serving or not self.ready or self.missing():
            return
        self.serving = True
        self._serving_since = now
        for member in self.peers:
            self._beat(member, now)
        self.wire.to_workers(self.info())
        if not self.s.guaranteed:
            self._rebalance(now)

    def _subjects_of(self, groups: Iterable[int]) -> list[str]:
        wanted = set(groups)
        return [s for s in self.replica.subjects() if group_of(s) in wanted]

    def _send_state(self, member: int, subjects: Iterable[str]) -> None:
        """The state of ``subjects`` as it is now (taken in this turn: the frames after it depend on it),
        encoded and written as the peer reads it: a full cache is seconds of encoding and hundreds of MB."""
        self.wire.stream_to_peer(member, iter(list(self._state_frames(subjects, peer=True))))

    # --- links ------------------------------------------------------------------------

    def _awake(self, now: float) -> None:
        """Called before anything else is acted upon: a member that did not run for longer than the
        heartbeat timeout (SIGSTOP, a frozen VM) has been given up by the others, who moved its groups
        on. Whatever waited in its sockets must not be numbered under its old epochs: in Standard mode
        it rejoins as a restarted member would; in Guaranteed mode its leader's word is stale, so it
        has no quorum until the leader is heard again."""
        last = self._last_tick
        if last is None or now - last <= self.s.heartbeat_timeout or last == self._pause_seen:
            return
        self._pause_seen = last  # acted upon once; tick() still grants the peers their grace
        if self.s.guaranteed:
            if self._leader_fresh and now - self.last_leader_heartbeat > self.s.heartbeat_timeout:
                self._leader_fresh = False
            # Raft's view (leader, quorum) and the table are as old as the pause, and heartbeats that
            # waited in the sockets look fresh: /health waits for a majority of the seeds to answer a
            # heartbeat sent after the pause (their echo proves it) without a newer table than ours.
            self._resumed_at = now
            self._resume_confirmed = set()
            self.counters["resumed"] += 1
            self._resume_settled()  # a lone seed has nobody to ask
        elif self.ready:
            self.counters["resumed"] += 1
            self.started = now  # a full heartbeat timeout to find the others before starting alone
            self._dropped(now)

    def peer_up(self, member: int, incarnation: int, now: float) -> None:
        """An authenticated link to ``member`` came up (a new process of it if ``incarnation`` changed)."""
        self._awake(now)
        self.peers[member] = _Peer(member, incarnation, now, linked=now)
        self.counters["link_up"] += 1
        for subject, total in self._totals.items():
            if total:
                self.wire.to_peer(member, Interest(subject, total))
        if self.s.guaranteed and self.table.version and self.me < self.s.seeds:
            self.wire.to_peer(member, self._table_frame())
        if self.ready:
            self._announce(member, [g for g in range(GROUPS) if self.active[g]])
        for claim in self._claims.values():
            if member in claim.awaiting:  # it was not linked when we claimed, or the link broke since
                self.wire.to_peer(member, SyncRequest(claim.request, tuple(claim.groups.items())))
        self._beat(member, now)
        self._drain_waiting(now)

    def _announce(self, member: int, groups: list[int]) -> None:
        """Tell a peer which groups we coordinate, then the state of their subjects."""
        if not groups:
            return
        fence = tuple((g, self.epochs[g]) for g in groups)
        self.wire.to_peer(member, SyncRequest(self._request(), fence, reply=False))
        subjects = self._subjects_of(groups)
        self._send_state(member, subjects)
        if self.s.guaranteed:
            for subject in subjects:
                unacked = self._unacked.get(subject)
                seq = unacked[0].seq - 1 if unacked else self.replica.position(subject)[1]
                if seq:
                    self._confirm(subject, self.epochs[group_of(subject)], seq, (member,))

    def peer_down(self, member: int, now: float) -> None:
        self._awake(now)
        if self.peers.pop(member, None) is None:
            return
        self.counters["link_down"] += 1
        for subject in [s for s, counts in self._remote.items() if counts.pop(member, None) is not None and not counts]:
            del self._remote[subject]
            if subject.startswith(SHARE_PREFIX):
                self.wire.to_workers(Interest(subject, 0))  # its shared subscription groups went with it
        self._partial = {k: v for k, v in self._partial.items() if k[0] != member}
        if self._join is not None and self._join[1] == member:
            self._join = None
        for claim in list(self._claims.values()):
            if member in claim.awaiting and not self.s.guaranteed:
                claim.awaiting.discard(member)
                self._maybe_complete(claim, now)
        for request, pending in list(self._pending.items()):
            if pending.sent_to == member:
                del self._pending[request]
                if self.s.guaranteed:
                    pending.sent_to = -1
                    self._route(pending, now)  # publish ids make the retry idempotent
                else:
                    self._answer(pending, Status.FAILED, "the coordinator failed; the outcome is unknown")
        if not self.s.guaranteed:
            self._rebalance(now)

    def worker_up(self, worker: int) -> None:
        self.workers.add(worker)
        if self.ready:
            self._state_to_worker(worker)
        self.wire.to_worker(worker, self.info())
        for subject, counts in self._remote.items():  # the other members' shared subscription groups
            if subject.startswith(SHARE_PREFIX):
                self.wire.to_worker(worker, Interest(subject, sum(counts.values())))

    def _state_to_worker(self, worker: int) -> None:
        self.wire.stream_to_worker(worker, self._whole_state())

    def _whole_state(self) -> Iterator[BusFrame]:
        """Every subject's state, the private ones first (the MQTT session records say what the rest is to cache)."""
        return self._state_frames(private_first(self.replica.subjects()))

    def _state_frames(self, subjects: Iterable[str], peer: bool = False) -> Iterator[BusFrame]:
        """The state of ``subjects`` as it is when each is read (each under its group's epoch): a starting
        worker's copy is rendered as the worker (or, shared, the first of the workers) takes it. What a
        worker is sent meanwhile follows the stream on its link: already in the state, it counts as a
        duplicate; not yet in it, it comes after it, in order.

        Guaranteed mode: a peer gets the whole state and the first seq held back from subscribers here;
        our workers get it without what is held back (the confirmations release that, in order)."""
        for subject in subjects:
            state = self.replica.sync(subject)
            if state is None:
                continue
            held = self._held_from(subject)
            if peer:
                yield from sync_frames(state, self.epochs[group_of(subject)], held)
            else:
                shown = self._without_held(state, held)
                if shown is not None:
                    yield from sync_frames(shown)

    def _held_from(self, subject: str) -> int:
        """Guaranteed: the first seq of ``subject`` held back here from subscribers (0: nothing is)."""
        firsts = [queue[0].seq for queue in (self._unconfirmed.get(subject), self._unacked.get(subject)) if queue]
        return min(firsts) if firsts else 0

    @staticmethod
    def _without_held(state: SubjectSync, held: int) -> SubjectSync | None:
        """``state`` up to the message before ``held`` (None: nothing of it may be shown yet). Its snapshot
        stays the whole state's: a worker reads it only when it adopts the state (a resync), never when the
        state continues its own history, which it builds from the messages."""
        if not held or held > state.seq:
            return state
        kept = tuple(e for e in state.entries if e.seq < held)
        if not kept or kept[-1].seq != held - 1:
            return None
        last = kept[-1]
        ids = tuple(i for i in state.ids if i[2] < held)
        return SubjectSync(state.subject, last.epoch, last.seq, state.snapshot, kept, ids)

    def worker_down(self, worker: int) -> None:
        self.workers.discard(worker)
        for subject in [s for s, counts in self._local.items() if worker in counts]:
            self._set_local_interest(subject, worker, 0)

    # --- frames from peers ----------------------------------------------------------------

    def on_peer_frame(self, member: int, frame: BusFrame, now: float) -> None:
        self._awake(now)
        peer = self.peers.get(member)
        if peer is None:
            return
        peer.heard = now
        if isinstance(frame, Published):
            if not self.ready:
                self._held.append((member, frame))
            else:
                self._replicated(member, frame, now)
        elif isinstance(frame, Ack):
            if not self.ready and self._is_confirmation(member, frame):
                self._held.append((member, frame))  # after the Published frames it confirms, as it was sent
            else:
                self._acked(member, frame)
        elif isinstance(frame, Forward):
            pending = _Pending(("peer", member, frame.request), frame, now + self.s.publish_timeout)
            self._route(pending, now)
        elif isinstance(frame, ForwardStatus):
            answered = self._pending.pop(frame.request, None)
            if answered is not None:
                self._answer(answered, Status(frame.status), frame.reason, frame.seq, frame.epoch, frame.recipients)
        elif isinstance(frame, Heartbeat):
            self._heartbeat(peer, frame, now)
        elif isinstance(frame, Interest):
            counts = self._remote.setdefault(frame.subject, {})
            if frame.count:
                counts[member] = frame.count
            else:
                counts.pop(member, None)
                if not counts:
                    del self._remote[frame.subject]
            if frame.subject.startswith(SHARE_PREFIX):  # a shared subscription group's holders: the workers choose
                self.wire.to_workers(Interest(frame.subject, sum(counts.values())))
        elif isinstance(frame, SyncSubject):
            self._sync_subject(member, frame, now)
        elif isinstance(frame, SyncRequest):
            self._sync_request(member, frame, now)
        elif isinstance(frame, SyncDone):
            self._sync_done(member, frame, now)
        elif isinstance(frame, TableFrame):
            table = Table(frame.version, frame.members, frame.epochs, frame.admitted, frame.incarnations)
            self.set_table(table, now)

    def _heartbeat(self, peer: _Peer, beat: Heartbeat, now: float) -> None:
        was_ready = peer.ready
        peer.beats += 1
        peer.ready, peer.leader, peer.table_version = beat.ready, beat.leader, beat.table_version
        peer.sees = ()
        peer.their_sent, peer.their_sent_at = beat.sent, now
        if self._resumed_at is not None:
            self._confirm_resume(peer.index, beat)
        if beat.echo:
            peer.rtt_ms = max(0.0, now * 1e6 - beat.echo - beat.held) / 1000
        if beat.status:
            try:
                peer.status = dict(json.loads(beat.status))
                peer.sees = tuple(int(j) for j in peer.status.pop("sees", ()) if 0 <= int(j) < self.n)
            except (ValueError, TypeError):
                peer.status = {}
        if beat.leader and beat.quorum:
            self.last_leader_heartbeat = now
            self._leader_fresh = True
        if peer.ready and not self.ready and self._join is None:
            request = self._request()
            self._join = (request, peer.index)
            self.wire.to_peer(peer.index, SyncRequest(request, (), everything=True))
        if peer.ready != was_ready and not self.s.guaranteed:
            self._rebalance(now)
        self._check_serving(now)

    def _replicated(self, member: int, frame: Published, now: float) -> None:
        group = group_of(frame.subject)
        if frame.epoch != self.epochs[group]:
            self.counters["stale_dropped"] += 1  # an old coordinator (fenced), or a fence we have not seen yet
            return
        if self.s.guaranteed:
            at = self.replica.position(frame.subject)[1]
            if at and frame.seq > at + 1:
                # A hole: what came before it reached us neither live nor in a state (we joined from a member
                # that lagged behind the coordinator's stream). Applied, it would be acknowledged as a copy of
                # a history we do not hold, and our subscribers resynced; so it is not, and the coordinator's
                # own state of the group (which has it) is asked for once, and fills the hole.
                self._ask_state(member, group, now)
                return
        outcome = self.replica.apply(frame.subject, frame.entry(), now)
        if outcome is not Applied.DUPLICATE:
            self.counters["replicated_in"] += 1
            if self.s.guaranteed:
                # not for our subscribers yet: if the coordinator and we die now, nobody else may have it, and
                # the next coordinator would number other messages under this seq (bench failover round 122)
                self._unconfirmed.setdefault(frame.subject, deque()).append(frame)
            else:
                self.wire.to_workers(frame)
        elif self.s.guaranteed and self.replica.epoch_of(frame.subject, frame.seq) not in (None, frame.epoch):
            # we hold another message under this number: never confirm a copy we do not have; start over
            self.counters["conflicts"] += 1
            if self.ready:
                self._dropped(now)
            return
        if self.s.guaranteed:
            self.wire.to_peer(member, Ack(frame.subject, frame.epoch, frame.seq))

    def _ask_state(self, member: int, group: int, now: float) -> None:
        """Ask ``member`` (the group's coordinator) for its state of ``group``, at most once a heartbeat interval."""
        if now - self._asked.get(group, -1e9) < self.s.heartbeat_interval:
            return
        self._asked[group] = now
        self.counters["holes"] += 1
        self.wire.to_peer(member, SyncRequest(self._request(), ((group, self.epochs[group]),)))

    def _is_confirmation(self, member: int, ack: Ack) -> bool:
        """An Ack from the member that issued its epoch: that coordinator's word that a second member holds
        the subject's messages up to ``ack.seq`` (acknowledgements to a coordinator carry its own epoch)."""
        return self.s.guaranteed and member != self.me and owner_of(ack.epoch, self.n) == member

    def _acked(self, member: int, ack: Ack) -> None:
        if self._is_confirmation(member, ack):
            self._expose(ack.subject, ack.epoch, ack.seq)
            return
        self.counters["acks_in"] += 1
        if member not in self.table.members:
            return  # only a member of the table counts as the second copy
        group = group_of(ack.subject)
        if ack.epoch != self.epochs[group] or self.owner(group) != self.me:
            return
        queue = self._unacked.get(ack.subject)
        while queue and queue[0].seq <= ack.seq and queue[0].epoch == ack.epoch:
            self._release(queue.popleft())
        if queue is not None and not queue:
            del self._unacked[ack.subject]
        # The peer holds our history up to ack.seq: what of it nothing waits for here is held by two members,
        # released messages and a state's messages that were never ours to wait for alike (a claim merged
        # them from a peer); the others may deliver it. Told once per point, not once per acknowledgement.
        upto = min(ack.seq, self.replica.position(ack.subject)[1], queue[0].seq - 1 if queue else ack.seq)
        if upto > 0 and self._confirmed.get(ack.subject, (0, 0)) < (ack.epoch, upto):
            self._confirmed[ack.subject] = (ack.epoch, upto)
            self._confirm(ack.subject, ack.epoch, upto, self.peers)

    def _confirm(self, subject: str, epoch: int, seq: int, members: Iterable[int]) -> None:
        """Tell the other members that their copies up to ``seq`` are held by two members: they may deliver them."""
        confirmation = Ack(subject, epoch, seq)
        for member in members:
            self.wire.to_peer(member, confirmation)

    def _expose(self, subject: str, epoch: int, seq: int) -> None:
        """Hand our confirmed copies up to ``(epoch, seq)`` to the workers, in order."""
        queue = self._unconfirmed.get(subject)
        while queue and queue[0].seq <= seq and queue[0].epoch <= epoch:
            self.wire.to_workers(queue.popleft())
        if not queue:
            self._unconfirmed.pop(subject, None)

    def _release(self, item: _Unacked) -> None:
        self._unacked_ids.pop(item.frame.publish_id, None)
        self.wire.to_workers(item.frame)
        for waiter in item.waiters:
            self._answer_numbered(waiter, item.frame)

    def _sync_subject(self, member: int, frame: SyncSubject, now: float) -> None:
        state = frame.state
        key = (member, state.subject)
        if self._stale_sender(member, frame):
            self._partial.pop(key, None)
            self.counters["stale_dropped"] += 1
            return
        if frame.more:
            self._partial.setdefault(key, []).extend(state.entries)
            return
        earlier = self._partial.pop(key, None)
        if earlier:
            state = SubjectSync(
                state.subject, state.epoch, state.seq, state.snapshot, (*earlier, *state.entries), state.ids
            )
        self._merge(state, now, frame.held if self.s.guaranteed and member >= 0 else None)
        if (
            self.s.guaranteed
            and member >= 0
            and frame.fence == self.epochs[group_of(state.subject)]
            and owner_of(frame.fence, self.n) == member
            and state.seq
            and self.replica.epoch_of(state.subject, state.seq) == state.epoch
        ):
            # the coordinator's own state (its announcement after a claim): we hold its history up to here,
            # which may carry messages it numbered under earlier epochs and holds back until a second member
            # has them (Member._carry)
            self.wire.to_peer(member, Ack(state.subject, frame.fence, state.seq))

    def _stale_sender(self, member: int, frame: SyncSubject) -> bool:
        """Guaranteed mode: state from a member still behind this group's epoch (a coordinator that was
        cut off and not yet told) may hold messages it numbered that no second member confirmed and that
        the group's new coordinator never gathered: they must not enter the history. A claimant's gather
        and a join are answered under the asker's epoch or a newer one, so they pass."""
        if not self.s.guaranteed or member < 0 or not frame.fence:
            return False
        if self._join is not None and self._join[1] == member:
            return False
        group = group_of(frame.state.subject)
        if self.active[group] and self.owner(group) == self.me:
            # we coordinate it and our claim is complete: the state of a member it did not wait for (left out
            # of the table meanwhile) arrives late, with what that member numbered alone
            return True
        return frame.fence < self.epochs[group]

    def _merge(self, state: SubjectSync, now: float, held: int | None = None) -> None:
        """Fold a peer's (or a worker's) state of a subject into ours; our workers get what may be shown of it.

        Guaranteed, from a peer: ``held`` is the first seq the sender holds back from its subscribers (0:
        none), so everything before it is held by two members. Our workers get our history up to there,
        what we held back of it included; what follows waits here until the coordinator confirms it.
        Shown at once, a joining member's subscribers saw messages that a failure could still take out of
        the history, and the rest of that history reached them as a resync (tests/test_member_schedules.py).
        """
        subject = state.subject
        before = self._held_from(subject)
        shown_until = before - 1 if before else self.replica.position(subject)[1]  # what our workers have
        merged = self.replica.merge(state, now)
        if merged.resync:
            self.counters["resyncs"] += 1
            self._unconfirmed.pop(subject, None)  # another history replaced ours: what we held is not in it
            shown_until = 0
        if held is None:
            if merged.changed:
                for sync in sync_frames(state):
                    self.wire.to_workers(sync)
            return
        durable = held - 1 if held else state.seq
        mark = next((e.epoch for e in state.entries if e.seq == durable), state.epoch if durable == state.seq else 0)
        if durable <= 0 or self.replica.epoch_of(subject, durable) != mark:
            durable = 0  # their history is not ours there: they vouch for nothing of it
        queue = self._unconfirmed.get(subject)
        released = queue is not None and bool(queue) and queue[0].seq <= durable
        while queue and queue[0].seq <= durable:
            queue.popleft()
        # what this state brought beyond the durable point, and beyond what our workers have, waits
        known = {frame.seq for frame in queue} if queue else set()
        tail = [
            e
            for e in state.entries
            if e.seq > max(durable, shown_until)
            and e.seq not in known
            and self.replica.epoch_of(subject, e.seq) == e.epoch
        ]
        if tail:
            waiting = sorted([*(queue or ()), *(Published.of(subject, e, True) for e in tail)], key=lambda f: f.seq)
            queue = self._unconfirmed[subject] = deque(waiting)
        if queue is not None and not queue:
            self._unconfirmed.pop(subject, None)
        if merged.changed or released:
            ours = self.replica.sync(subject)
            shown = self._without_held(ours, self._held_from(subject)) if ours is not None else None
            if shown is not None:
                for sync in sync_frames(shown):
                    self.wire.to_workers(sync)

    def _sync_request(self, member: int, request: SyncRequest, now: float) -> None:
        for group, epoch in request.fence:
            self._fence(group, epoch, now)
        if request.fence:
            self._drain_waiting(now)
        if not request.reply:
            return
        # Our state goes to the claimant, with what we hold back: it becomes history once the claimant has
        # merged it and tells us so (its confirmations release it to our workers). Released now, our
        # subscribers could see what a claim that never completes (the link drops, a newer claim that
        # could not ask us supersedes it) leaves out of the history (tests/test_member_schedules.py).
        self.counters["syncs_served"] += 1
        subjects = self.replica.subjects() if request.everything else self._subjects_of(g for g, _ in request.fence)
        self._send_state(member, subjects)
        epochs = tuple((g, self.epochs[g]) for g, _ in request.fence)
        self.wire.to_peer(member, SyncDone(request.request, epochs))

    def _sync_done(self, member: int, done: SyncDone, now: float) -> None:
        if self._join is not None and self._join[0] == done.request:
            self._join = None
            self.counters["joins"] += 1  # ready because a ready member's full state arrived, not by default
            self._become_ready(now)
            return
        claim = self._claims.get(done.request)
        if claim is None:
            return
        for group, epoch in done.epochs:
            if epoch > claim.groups.get(group, epoch):
                del claim.groups[group]  # someone claimed it after us
                self._fence(group, epoch, now)
        claim.awaiting.discard(member)
        self._maybe_complete(claim, now)

    # --- coordinatorship --------------------------------------------------------------

    def _fence(self, group: int, epoch: int, now: float) -> None:
        """Adopt a higher epoch for ``group``: its coordinator is now ``epoch``'s owner."""
        if epoch <= self.epochs[group]:
            return
        was_owner = self.owner(group) == self.me
        self.epochs[group] = epoch
        self.active[group] = False
        for claim in self._claims.values():
            claim.groups.pop(group, None)
        if was_owner:
            # even when the new epoch is ours again (the tables moved the group away and back, or we saw only
            # the newest): acknowledgements of the old epoch no longer count, and what waited for them would
            # block every later message of its subject
            self._step_down(group, now)

    def _step_down(self, group: int, now: float) -> None:
        """``group`` has a new epoch: hand over what was numbered here under the old one and not confirmed."""
        for subject in [s for s in self._unacked if group_of(s) == group]:
            # If the new coordinator waits for our state (we are in its table), these messages
            # carry over into its epoch: they reach our workers when it confirms them, or, when the new
            # coordinator is this member again, once a second member holds our merged state (_carry).
            # If it did not wait (we were cut off and left out), they are dropped with our state.
            # Either way their publishers hear FAILED and may retry with the same publish id.
            held = self._unconfirmed.setdefault(subject, deque())
            for item in self._unacked.pop(subject):
                self._unacked_ids.pop(item.frame.publish_id, None)
                if not held or held[-1].seq < item.seq:
                    held.append(item.frame)
                for waiter in item.waiters:
                    self._answer(
                        waiter, Status.FAILED, "the subject's coordinator changed; retry with the same publish id"
                    )
        self._drain_waiting(now)

    def _drain_waiting(self, now: float) -> None:
        """Route again the publications that waited for a coordinator (one may be known now)."""
        if self._waiting:
            waiting, self._waiting = self._waiting, []
            for pending in waiting:
                self._route(pending, now)

    def _claim(self, groups: dict[int, int], members: Iterable[int], now: float) -> None:
        """Become coordinator of ``groups`` at the given epochs: fence everyone, gather, merge."""
        groups = {g: e for g, e in groups.items() if e >= self.epochs[g]}  # never back to an older epoch
        if not groups:
            return
        for group, epoch in groups.items():
            self._fence(group, epoch, now)
            self.epochs[group] = epoch
        self.counters["claims"] += 1
        claim = _Claim(self._request(), dict(groups), set(members) - {self.me}, now + self.s.heartbeat_timeout)
        self._claims[claim.request] = claim
        fence = tuple(groups.items())
        for member in claim.awaiting:
            if member in self.peers:
                self.wire.to_peer(member, SyncRequest(claim.request, fence))
        self._maybe_complete(claim, now)

    def _maybe_complete(self, claim: _Claim, now: float) -> None:
        if claim.awaiting or claim.request not in self._claims:
            return
        del self._claims[claim.request]
        groups = [g for g, e in claim.groups.items() if self.epochs[g] == e and owner_of(e, self.n) == self.me]
        for group in groups:
            self.active[group] = True
            if self.s.guaranteed:
                self._carry(group, now)
        for member in list(self.peers):
            self._announce(member, groups)
        self._drain_waiting(now)

    def _carry(self, group: int, now: float) -> None:
        """Guaranteed, a claim of ``group`` completed: what this member held back of it (numbered under an
        earlier epoch of its own and not confirmed, or received and not confirmed) is part of the merged
        history now. It reaches our subscribers once a second member holds it, as any message does: it
        waits at the head of its subject's queue for a peer's acknowledgement of our state, which the
        announcement that follows sends to every peer, and the new epoch's messages wait behind it. Handed
        to the workers at once, a copy only this member held could be seen by a subscriber and lost with
        this member (bench failover round 122); and not handed at all, the first message of the new epoch
        reached them past a hole, and they were resynchronised (round partition-leader, issue 48)."""
        frames: list[Published] = []
        for subject in [s for s in self._unconfirmed if group_of(s) == group]:
            frames.extend(self._unconfirmed.pop(subject))
        frames.sort(key=lambda f: f.seq)  # stable: in order within each subject
        epoch = self.epochs[group]
        for frame in frames:
            if self.replica.epoch_of(frame.subject, frame.seq) != frame.epoch:
                continue  # the merge replaced it with another history (and resynced the workers), or it expired
            queue = self._unacked.setdefault(frame.subject, deque())
            if queue and queue[-1].seq >= frame.seq:
                continue
            queue.append(_Unacked(frame.seq, frame, [], now, epoch))
            if frame.publish_id:
                self._unacked_ids[frame.publish_id] = (frame.subject, frame.epoch, frame.seq)

    def _rebalance(self, now: float) -> None:
        """Standard mode: claim the groups this member should coordinate among those it sees."""
        if self.s.guaranteed or not self.serving:
            return
        view = [self.me, *self._ready_peers()]
        top = max(max(self.epochs), self.s.epoch_floor)
        wanted: dict[int, int] = {}
        claiming = {g for c in self._claims.values() for g in c.groups}
        for group in range(GROUPS):
            if rendezvous(group, view) != self.me or group in claiming:
                continue
            if self.owner(group) == self.me and self.active[group]:
                continue
            wanted[group] = epoch_for(self.me, self.n, top)
        if wanted:
            self._claim(wanted, view, now)

    def _admits(self, table: Table) -> bool:
        """Whether ``table`` lists this member as this agent process (not as the one before a restart)."""
        return self.me in table.members and table.incarnation_of(self.me) in (None, self.s.incarnation)

    def live_incarnations(self) -> dict[int, int]:
        """The members the leader's proposal admits, each with its agent process (see :meth:`live_members`)."""
        table = self.table
        now = self._last_tick if self._last_tick is not None else self.started
        live = {}
        for j, p in self.peers.items():
            listed = j in table.members and table.incarnation_of(j) in (None, p.incarnation)
            serving = p.ready and (listed or p.table_version >= table.version)
            unheard = listed and not p.beats and now - p.linked < self.s.heartbeat_timeout
            if serving or unheard:
                live[j] = p.incarnation
        if self.serving:
            live[self.me] = self.s.incarnation
            if now - max(self._serving_since, self._leading_since) < self.s.heartbeat_timeout:
                # serving again only just (after a cut-off, a pause, a rejoin), or leading only just (a seed
                # that was cut off can win the election its higher term forces once the cut heals): its links
                # to the others may not be back yet, and what it does not see is no evidence against them
                for j in table.members:
                    if j not in live and j != self.me and (j not in self.peers or not self.peers[j].beats):
                        live[j] = table.incarnation_of(j) or 0
            elif not any(j != self.me and j in table.members for j in live):
                # it hears none of the table's other members: more likely its own links failed (a reset that
                # left it leading) than all of them at once; it takes nobody out until it hears one again
                for j in table.members:
                    live.setdefault(j, table.incarnation_of(j) or 0)
        return live

    def _table_frame(self) -> TableFrame:
        table = self.table
        return TableFrame(table.version, table.members, table.epochs, table.admitted, table.incarnations)

    def set_table(self, table: Table, now: float) -> None:
        """Guaranteed mode: adopt a newer table from the seed members' consensus."""
        if table.version <= self.table.version:
            return
        old, self.table = self.table, table
        if self.me < self.s.seeds:
            frame = self._table_frame()
            for member in self.peers:
                self.wire.to_peer(member, frame)
        if self.ready and self._admits(old):
            if self.me not in table.members:
                self._dropped(now)
            elif table.admitted_at(self.me) > old.version and not self._expect_admission:
                # left out and taken back in by tables we never saw (we adopt only the newest): meanwhile
                # our groups moved on without us, and what we numbered alone must not stay
                self.counters["readmitted"] += 1
                self._dropped(now)
        if self._admits(table) and table.admitted_at(self.me) > old.version:
            self._expect_admission = False
        claimed: dict[int, int] = {}
        for group, epoch in enumerate(table.epochs):
            if epoch > self.epochs[group]:
                self._fence(group, epoch, now)
                if owner_of(epoch, self.n) == self.me and self.ready and self._admits(table):
                    claimed[group] = epoch
        for claim in list(self._claims.values()):
            claim.awaiting &= set(table.members)
            self._maybe_complete(claim, now)
        if self.ready and old.version and set(old.members) - set(table.members):
            # A member left the table: what it acknowledged has one holder left here. Our state goes to every
            # member still listed, so that one more failure (another member cut off or paused while the
            # removed one rejoins) does not take the last copy (tests/test_member_schedules.py).
            groups = [g for g in range(GROUPS) if self.active[g]]
            for member in table.members:
                if member != self.me and member in self.peers:
                    self._announce(member, groups)
        if claimed:
            self._claim(claimed, table.members, now)
        self._drain_waiting(now)

    def _confirm_resume(self, member: int, beat: Heartbeat) -> None:
        """After a long pause, count the seeds whose heartbeat echoes one we sent after it (so it is not a
        frame that waited in a socket) and whose table is not newer than ours; a majority ends the wait."""
        assert self._resumed_at is not None
        if member < self.s.seeds and beat.echo >= int(self._resumed_at * 1e6):
            if beat.table_version <= self.table.version:
                self._resume_confirmed.add(member)
            else:
                self._resume_confirmed.discard(member)  # ours is stale: set_table() comes first
        self._resume_settled()

    def _resume_settled(self) -> None:
        votes = len(self._resume_confirmed) + (1 if self.me < self.s.seeds else 0)
        if votes > self.s.seeds // 2:
            self._resumed_at = None
            self._resume_confirmed = set()

    def _dropped(self, now: float) -> None:
        """The table no longer lists us (we were cut off or hung): forget our state and rejoin."""
        self.ready = self.serving = False
        self.replica = self._new_replica()
        self._unacked_ids.clear()
        self._unconfirmed.clear()
        self._confirmed.clear()
        self._expect_admission = True  # the leader will take us back in once we are ready again
        for subject in list(self._unacked):
            for item in self._unacked.pop(subject):
                for waiter in item.waiters:
                    self._answer(waiter, Status.FAILED, "this member lost its place in the cluster; retry")
        self.active = [False] * GROUPS
        self._claims.clear()
        self.wire.to_workers(self.info())

    def _become_ready(self, now: float) -> None:
        self.ready = True
        self._has_served = True
        # one stream for every worker, rendered once as the first of them reads it
        self.wire.stream_to_workers(sorted(self.workers), self._whole_state())
        self.wire.to_workers(self.info())
        held, self._held = self._held, []
        for member, frame in held:
            if member in self.peers and isinstance(frame, Published):
                self._replicated(member, frame, now)
            elif member in self.peers and isinstance(frame, Ack):
                self._acked(member, frame)
        for member in self.peers:
            self._beat(member, now)
        if self.s.guaranteed:
            claimed = {
                g: e for g, e in enumerate(self.table.epochs) if owner_of(e, self.n) == self.me and not self.active[g]
            }
            if claimed and self._admits(self.table):
                self._claim(claimed, self.table.members, now)
        self._check_serving(now)

    # --- publications -----------------------------------------------------------------

    def on_worker_frame(self, worker: int, frame: BusFrame, now: float) -> None:
        self._awake(now)
        if isinstance(frame, Forward):
            self._route(_Pending(("worker", worker, frame.request), frame, now + self.s.publish_timeout), now)
        elif isinstance(frame, Interest):
            self._set_local_interest(frame.subject, worker, frame.count)
        elif isinstance(frame, SyncSubject):
            self._sync_subject(-1 - worker, frame, now)  # a worker that outlived its agent: keep what it knew
        elif isinstance(frame, Relay):
            self.wire.to_worker(frame.worker, frame)  # an HTTP stream's input, for the worker that holds it

    def _set_local_interest(self, subject: str, worker: int, count: int) -> None:
        counts = self._local.setdefault(subject, {})
        if count:
            counts[worker] = count
        else:
            counts.pop(worker, None)
        total = sum(counts.values())
        if not counts:
            del self._local[subject]
        if total != self._totals.get(subject, 0):
            if total:
                self._totals[subject] = total
            else:
                self._totals.pop(subject, None)
            self._interest_dirty.add(subject)  # sent to the peers at the next tick, once however often it changed

    @property
    def interest_pending(self) -> bool:
        return bool(self._interest_dirty)

    def flush_interest(self) -> None:
        """Send the subscriber counts that changed since the last flush (the agent calls it once per loop turn)."""
        dirty, self._interest_dirty = self._interest_dirty, set()
        for subject in dirty:
            frame = Interest(subject, self._totals.get(subject, 0))
            for member in self.peers:
                self.wire.to_peer(member, frame)

    def recipients(self, subject: str) -> int:
        remote = self._remote.get(subject)
        return self._totals.get(subject, 0) + (sum(remote.values()) if remote else 0)

    def _route(self, pending: _Pending, now: float) -> None:
        frame = pending.frame
        if not self.ready:
            self._answer(pending, Status.FAILED, "this member is synchronising with the cluster")
            return
        if self.s.guaranteed and not self.quorum:
            self._answer(pending, Status.FAILED, "no quorum: a majority of the seed members is not reachable")
            return
        if frame.hops >= MAX_HOPS:
            self._answer(pending, Status.FAILED, "no member agrees to coordinate this subject yet")
            return
        group = group_of(frame.subject)
        coordinator = self.owner(group)
        if coordinator == self.me:
            if self.active[group]:
                self._number(pending, group, now)
            else:
                self._waiting.append(pending)
            return
        if coordinator < 0 or coordinator not in self.peers or not self._coordinates_now(coordinator):
            self._waiting.append(pending)
            return
        request = self._request()
        pending.sent_to = coordinator
        self._pending[request] = pending
        self.counters["forwarded"] += 1
        hop = Forward(
            request,
            frame.subject,
            frame.content,
            frame.fields,
            frame.retained,
            frame.guaranteed,
            frame.origin,
            frame.publish_id,
            frame.hops + 1,
        )
        self.wire.to_peer(coordinator, hop)

    def _coordinates_now(self, member: int) -> bool:
        """Guaranteed: whether the linked process of ``member`` is the one the table admitted. A member restarted
        a moment ago owns its old process's groups by their epochs until the leader's next table moves them;
        it can number none of them (not admitted, it has not heard the leader), and would answer FAILED what
        waits here for that table instead (set_table routes it again)."""
        if not self.s.guaranteed:
            return True
        admitted = self.table.incarnation_of(member)
        return admitted is None or admitted == self.peers[member].incarnation

    def _number(self, pending: _Pending, group: int, now: float) -> None:
        frame = pending.frame
        subject = frame.subject
        if self.s.guaranteed and not any(m in self.peers for m in self.table.members if m != self.me):
            self._answer(pending, Status.FAILED, "no other member is reachable to hold a second copy")
            return
        known = self._unacked_ids.get(frame.publish_id) or self.replica.find_publish(frame.publish_id)
        if known is not None and self.replica.epoch_of(subject, known[2]) not in (None, known[1]):
            known = None  # numbered in a history that lost a merge: not in ours, so numbered now
        if known is not None:  # a retry, through any member, of what the cluster numbered already
            self._duplicate(pending, known)
            return
        entry = Entry(
            self.epochs[group],
            self.replica.next_seq(subject),
            frame.content,
            frame.fields,
            frame.retained,
            frame.publish_id,
            frame.guaranteed,
        )
        self.replica.apply(subject, entry, now)
        published = Published.of(subject, entry, frame.guaranteed)
        for member in self.peers:
            self.wire.to_peer(member, published)
        self.counters["replicated_out"] += len(self.peers)
        if self.s.guaranteed:
            self._unacked.setdefault(subject, deque()).append(
                _Unacked(entry.seq, published, [pending], now, entry.epoch)
            )
            if entry.publish_id:  # known here until a second member holds it, whatever the cache forgets
                self._unacked_ids[entry.publish_id] = (subject, entry.epoch, entry.seq)
        else:
            self.wire.to_workers(published)
            self._answer_numbered(pending, published)

    def _duplicate(self, pending: _Pending, known: tuple[str, int, int]) -> None:
        """A retry of a publication already numbered: the same outcome, no second message."""
        subject, epoch, seq = known
        for item in self._unacked.get(subject, ()):
            if (item.frame.epoch, item.seq) == (epoch, seq):
                item.waiters.append(pending)  # still waiting for its second copy
                return
        recipients = self.recipients(subject)
        self._answer(pending, Status.OK if recipients else Status.NO_SUBSCRIBER, "", seq, epoch, recipients)

    def _answer_numbered(self, pending: _Pending, published: Published) -> None:
        recipients = self.recipients(published.subject)
        status = Status.OK if recipients else Status.NO_SUBSCRIBER
        self._answer(pending, status, "", published.seq, published.epoch, recipients)

    def _answer(
        self, pending: _Pending, status: Status, reason: str, seq: int = 0, epoch: int = 0, recipients: int = 0
    ) -> None:
        kind, index, request = pending.source
        if status is Status.FAILED:
            self.counters["publish_failed"] += 1
        answer = ForwardStatus(request, status, seq, reason, epoch, recipients)
        if kind == "worker":
            if index in self.workers:
                self.wire.to_worker(index, answer)
        elif index in self.peers:
            self.wire.to_peer(index, answer)

    # --- time -------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Heartbeats, failure detection, time-outs, cache expiry, and starting alone."""
        self._awake(now)
        if self._interest_dirty:
            self.flush_interest()
        interval = self.s.heartbeat_interval
        if now - self._last_beat >= interval:
            self._last_beat = now
            for member in list(self.peers):
                self._beat(member, now)
        timeout = self.s.heartbeat_timeout
        paused = self._last_tick is not None and now - self._last_tick > max(2 * interval, timeout / 3)
        if paused and now - self._last_grace >= 2 * timeout:
            # This member did not run for a while (a saturated host, a long pause): its peers' frames
            # may be waiting unread, and silence it did not listen to is no evidence against them.
            # Each gets a full timeout from now (Cassandra's failure detector also ignores local pauses),
            # at most once per two timeouts, so that a member that is always late still drops a dead peer.
            self._last_grace = now
            self.counters["paused"] += 1
            for peer in self.peers.values():
                peer.heard = max(peer.heard, now)
        self._last_tick = now
        if self.s.guaranteed:
            if self.quorum:
                self._no_quorum_since = None
            elif self._no_quorum_since is None:
                self._no_quorum_since = now
        for member, peer in list(self.peers.items()):
            if now - peer.heard > timeout:
                self.wire.drop_peer(member, f"no heartbeat for {timeout:.1f} s")
                self.peer_down(member, now)
        if self._leader_fresh and now - self.last_leader_heartbeat > timeout:
            self._leader_fresh = False
        if not self.ready and self._join is None and now - self.started >= timeout:
            self._start_alone(now)
        for claim in list(self._claims.values()):
            if now < claim.deadline:
                continue
            if not self.s.guaranteed:
                claim.awaiting.clear()  # Standard mode: go on with the members that answered
                self._maybe_complete(claim, now)
            else:  # Guaranteed mode waits for every member of the table; ask again in case a frame was lost
                claim.deadline = now + self.s.heartbeat_timeout
                for member in claim.awaiting & set(self.peers):
                    self.wire.to_peer(member, SyncRequest(claim.request, tuple(claim.groups.items())))
        for request, pending in list(self._pending.items()):
            if now >= pending.deadline:
                del self._pending[request]
                self._answer(pending, Status.FAILED, "no answer from the coordinating member in time")
        if self._waiting:
            still = []
            for pending in self._waiting:
                if now >= pending.deadline:
                    self._answer(pending, Status.FAILED, "no coordinator for this subject in time")
                else:
                    still.append(pending)
            self._waiting = still
        holders = [m for m in self.table.members if m != self.me and m in self.peers]
        for subject, queue in self._unacked.items():
            restated = False
            for item in queue:
                if holders and now - item.sent >= timeout:
                    # Not confirmed yet: its first copies may have gone to members that died since,
                    # and members that came back hold it only from their join. Send it again: a
                    # member that has it acknowledges the duplicate (a carried message: our state,
                    # which its holders acknowledge under our epoch).
                    item.sent = now
                    if not item.carried:
                        for member in holders:
                            self.wire.to_peer(member, item.frame)
                    elif not restated:
                        restated = True
                        for member in holders:
                            self._send_state(member, [subject])
                if item.waiters and now >= item.waiters[0].deadline:
                    # still cached here and released if a second member confirms it later
                    for waiter in item.waiters:
                        self._answer(waiter, Status.FAILED, "no second member confirmed the message in time")
                    item.waiters = []
        self.replica.expire(now)
        self._check_serving(now)
        if self.serving and not self.s.guaranteed:
            self._rebalance(now)

    def _start_alone(self, now: float) -> None:
        """Nobody ready answered within the heartbeat timeout: the lowest-numbered starter goes first."""
        if self._ready_peers():
            return
        if self.s.guaranteed:
            if not self.leader:
                return  # in Guaranteed mode only the seeds' leader may start a cluster from nothing
            if self._has_served:
                # this process held the cluster's state and dropped it because the cluster moved on without
                # it: the others hold the history, and starting from nothing would number over it
                return
        elif any(j < self.me for j in self.peers):
            return
        self._become_ready(now)

    def _beat(self, member: int, now: float) -> None:
        peer = self.peers.get(member)
        if peer is None:
            return
        held = int((now - peer.their_sent_at) * 1e6) if peer.their_sent else 0
        status = json.dumps({**self.status(), "sees": self._ready_peers()}, separators=(",", ":")).encode()
        beat = Heartbeat(
            self.me,
            self.serving,
            self.leader,
            self.leader_quorum,
            self.table.version,
            int(now * 1e6),
            peer.their_sent,
            held,
            status,
        )
        self.wire.to_peer(member, beat)

    # --- status -------------------------------------------------------------------------

    def live_members(self) -> list[int]:
        """The members a leader's proposal admits: itself when serving; each peer heard serving, one the table
        does not list only once its heartbeats say it holds the table (one that has not learned yet that a
        table left it out will drop its state when it does: admitted on a heartbeat from before that, it
        would count as a holder of what it no longer holds); and a peer the table lists whose link came up
        again and has not spoken yet, for a heartbeat timeout (a link that broke and came back is not a
        member that died: without this grace the leader dropped it from the table at once, and it started
        over). Every member the table lists counts too while this member has served, or led, for less than
        a heartbeat timeout, and while it hears none of them (its own links failed, more likely than all of
        theirs). Found by tests/test_member_schedules.py: a leader whose links had just reset took the
        members holding the history out of the table, and what they acknowledged was lost."""
        return sorted(self.live_incarnations())

    def leader_index(self) -> int:
        """The seed members' Raft leader as this member knows it (-1: none known)."""
        if self.leader:
            return self.me
        return next((j for j, p in sorted(self.peers.items()) if p.leader), -1)

    def coordinated(self) -> list[int]:
        return [g for g in range(GROUPS) if self.active[g]]

    def readiness(self) -> tuple[bool, str]:
        """Whether the node may take clients, and if not why: the state is held, every member the others
        see is linked, and every worker is linked to the agent both ways."""
        if not self.ready:
            return False, "synchronising with the cluster"
        if not self.serving:  # latched: once serving, a peer's stale view of a dead member changes nothing
            missing = self.missing()
            return False, ("not linked yet to member(s) " + ", ".join(map(str, missing))) if missing else "joining"
        problem = self.links_problem()
        if problem:
            return False, problem
        return True, ""

    def health(self) -> tuple[bool, str]:
        """What /health answers: :meth:`readiness`, and in Guaranteed mode a quorum and a place in the table."""
        ready, reason = self.readiness()
        if not ready or not self.s.guaranteed:
            return ready, reason
        if self._resumed_at is not None:
            return False, "resumed after a pause: waiting for the seed members to confirm the current table"
        if not self.quorum:
            return False, "no quorum: a majority of the seed members is not reachable"
        if not self._admits(self.table):
            return False, "not yet admitted to the cluster's table by the seed members"
        return True, ""

    def isolated(self) -> str:
        """Guaranteed: why this member sends its clients to the other members ("" when it does not). A member that
        served and then lost the seeds' majority (cut off), resumed behind the others after a pause, or lost its
        place in the table cannot acknowledge a publication, and its subscribers would wait out the fault: on
        the majority's side they are served, and recover what they missed from its caches."""
        if not self.s.guaranteed or not self._has_served:
            return ""
        if not self.ready:
            return "this member lost its place in the cluster and is rejoining"
        if self._resumed_at is not None:
            return "this member resumed after a pause and waits for the seed members"
        if self._no_quorum_since is not None and (self._last_tick or 0.0) - self._no_quorum_since >= QUORUM_GRACE:
            # a follower loses it only after a heartbeat timeout without the leader's word; the grace keeps a
            # leader just elected, whose Raft majority is confirmed a round trip later, from sending its
            # clients away at every election
            return "this member is cut off from the majority of the seed members"
        return ""

    def info(self) -> ClusterInfo:
        ready = self.readiness()[0] and not self.isolated()
        return ClusterInfo(ready, json.dumps(self.describe(), separators=(",", ":")).encode())

    def describe(self) -> dict[str, Any]:
        """This member's view of the cluster, for /health, /cluster and `migratory cluster status`."""
        healthy, reason = self.health()
        return {
            "member": self.me,
            "ready": self.ready,
            "serving": self.serving,
            "healthy": healthy,
            "reason": reason,
            "missing": self.missing(),
            "isolated": self.isolated(),
            "mode": "Guaranteed" if self.s.guaranteed else "Standard",
            "quorum": self.quorum,
            "leader": self.leader,
            "leader_index": self.leader_index(),
            "term": self.term,
            "table_version": self.table.version,
            "table_members": list(self.table.members),
            "groups": self.coordinated(),
            "subjects": self.replica.subject_count(),
            "snapshots": len(self.replica),
            "cached_messages": self.replica.cached_messages(),
            "self": dict(self.status()),
            "counters": dict(self.counters),
            "peers": {
                str(j): {
                    "ready": p.ready,
                    "leader": p.leader,
                    "rtt_ms": round(p.rtt_ms, 3),
                    "status": p.status,
                }
                for j, p in sorted(self.peers.items())
            },
        }
