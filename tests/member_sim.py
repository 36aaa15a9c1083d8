"""An in-memory network of cluster members (migratory/member.py) for deterministic tests.

Links are FIFO queues that can be cut; a member can be killed (its state is gone) and
started again; each member has one worker whose replica applies exactly what the agent
sends it, as a real worker does. A stand-in for the seed members' consensus computes
Guaranteed mode's table from what the leader sees, as the real leader does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from migratory import bus as b
from migratory.groups import Table, assign
from migratory.member import Member, MemberSettings
from migratory.protocol import Status
from migratory.replica import Applied, Replica


class Sent(tuple):  # type: ignore[type-arg]
    """A queued frame, (src, dst, frame), and the connection it was written on: a frame written on a link that
    dropped since is gone with it (TCP), even when the two members are linked again by the time it would
    arrive, and a frame written while they were not linked was never sent."""

    connection: int
    at: float  # when it was written


def _sent(src: int, dst: int, frame: b.BusFrame, connection: int, at: float) -> Sent:
    item = Sent((src, dst, frame))
    item.connection = connection
    item.at = at
    return item


@dataclass
class Worker:
    replica: Replica
    delivered: dict[str, list[tuple[int, int, bytes]]] = field(default_factory=dict)
    ready: bool = False

    def take(self, frame: b.BusFrame) -> None:
        if isinstance(frame, b.Published):
            applied = self.replica.apply(frame.subject, frame.entry())
            if applied is Applied.GAP:  # as engine/core.py does: the subscribers are resynced, never a silent hole
                self.delivered.setdefault(frame.subject, []).append((frame.epoch, frame.seq, b"<resync>"))
                if frame.retained:
                    return  # the snapshot they got is this message
            if applied is not Applied.DUPLICATE:
                self.delivered.setdefault(frame.subject, []).append((frame.epoch, frame.seq, frame.content))
        elif isinstance(frame, b.SyncSubject):
            merged = self.replica.merge(frame.state)
            for entry in merged.new:
                self.delivered.setdefault(frame.state.subject, []).append((entry.epoch, entry.seq, entry.content))
            if merged.resync:
                pos = self.replica.position(frame.state.subject)
                self.delivered.setdefault(frame.state.subject, []).append((pos[0], pos[1], b"<resync>"))
        elif isinstance(frame, b.ClusterInfo):
            self.ready = frame.ready


class Net:
    def __init__(self, size: int, guaranteed: bool = False, cache: int = 1000) -> None:
        self.size = size
        self.guaranteed = guaranteed
        self.cache = cache
        self.now = 0.0
        self.members: dict[int, Member] = {}
        self.workers: dict[int, Worker] = {}
        self.queue: deque[tuple[int, int, b.BusFrame]] = deque()
        self.links: set[frozenset[int]] = set()
        self.connections: dict[frozenset[int], int] = {}  # the current connection of each linked pair
        self.cut: set[frozenset[int]] = set()
        self.answers: dict[tuple[int, int], b.ForwardStatus] = {}
        self.requests = 0
        self.incarnations = 0
        self.table = Table()
        self.leader = 0
        # what each member's agent sent its worker and the worker has not read yet, in order: frames, and
        # whole states (streams) rendered only when the worker reads them, after the members stop talking
        self.outbox: dict[int, deque[b.BusFrame | Iterator[b.BusFrame]]] = {}
        self.frozen: set[int] = set()  # SIGSTOPped: no ticks, nothing read, until thawed
        # a test that plays the seeds' consensus itself (tables skipped or delivered to some members only)
        self.hold_tables = False
        self.thawed: list[tuple[int, int]] = []  # (member, peer): link losses it will see when it runs again

    # --- the wire of one member ---------------------------------------------------------

    def wire(self, me: int) -> _Wire:
        return _Wire(self, me)

    def start(self, index: int, stagger: float = 0.0) -> None:
        """Start member ``index``; with ``stagger``, its links come up one by one that many seconds apart."""
        settings = MemberSettings(
            index,
            self.size,
            guaranteed=self.guaranteed,
            seeds=3 if self.guaranteed else 0,
            cache_size=self.cache,
            heartbeat_interval=0.5,
            heartbeat_timeout=3.0,
            epoch_floor=self.incarnations * self.size,
            incarnation=1000 + self.incarnations,
        )
        self.incarnations += 1
        member = Member(settings, self.wire(index), self.now)
        self.members[index] = member
        self.workers[index] = Worker(Replica(self.cache if self.guaranteed else 0, 1e9))
        self.outbox[index] = deque()
        member.worker_up(0)
        if self.guaranteed and member.me < member.s.seeds:
            member.set_table(self.table, self.now)
        for other in list(self.members):
            if other != index and frozenset((index, other)) not in self.cut and other in self.members:
                self._link(index, other)
                if stagger:
                    self.run(stagger)

    def _link(self, a: int, c: int) -> None:
        for member, peer in [t for t in self.thawed if frozenset(t) == frozenset((a, c))]:
            self.thawed.remove((member, peer))  # the old connection's loss comes before the new one
            if member in self.members:
                self.members[member].peer_down(peer, self.now)
        self.links.add(frozenset((a, c)))
        self.connections[frozenset((a, c))] = self.connections.get(frozenset((a, c)), 0) + 1
        self.members[a].peer_up(c, self.members[c].s.incarnation, self.now)
        self.members[c].peer_up(a, self.members[a].s.incarnation, self.now)

    def _unlink(self, a: int, c: int) -> None:
        if frozenset((a, c)) in self.links:
            self.links.discard(frozenset((a, c)))
            for x, y in ((a, c), (c, a)):
                if x in self.members:
                    self.members[x].peer_down(y, self.now)

    def kill(self, index: int) -> None:
        for other in list(self.members):
            if other != index:
                self._unlink(index, other)
        del self.members[index]
        self.outbox.pop(index, None)
        self.queue = deque(item for item in self.queue if index not in item[:2])

    def partition(self, index: int) -> None:
        for other in list(self.members):
            if other != index:
                self.cut.add(frozenset((index, other)))
                self._unlink(index, other)

    def thaw(self, index: int) -> None:
        """SIGCONT: it runs again; the link losses it missed reach it at the next :meth:`run`."""
        self.frozen.discard(index)

    def heal(self) -> None:
        self.cut.clear()
        for a in self.members:
            for c in self.members:
                if a < c and frozenset((a, c)) not in self.links:
                    self._link(a, c)

    # --- driving ----------------------------------------------------------------------------

    def run(self, seconds: float = 0.0, step: float = 0.1) -> None:
        """Deliver everything queued, ticking the clock ``seconds`` forward in ``step``s."""
        end = self.now + seconds
        while True:
            self._drain()
            self._consensus()
            self._drain()
            if self.now >= end:
                return
            self.now = min(end, self.now + step)
            for index, member in list(self.members.items()):
                if index not in self.frozen:
                    member.tick(self.now)

    def _drain(self) -> None:
        for member, peer in [t for t in self.thawed if t[0] not in self.frozen]:
            self.thawed.remove((member, peer))
            if member in self.members:
                self.members[member].peer_down(peer, self.now)
        for _ in range(1_000_000):
            if not self.queue:
                self._workers_read()
                if not self.queue:
                    return
                continue
            if all(dst in self.frozen for _, dst, _ in self.queue):
                before = len(self.queue)
                self._workers_read()  # what is left waits in a stopped member's sockets; the others' workers read
                if len(self.queue) == before:
                    return
                continue
            item = self.queue.popleft()
            src, dst, frame = item
            if dst in self.frozen:
                self.queue.append(item)
                continue
            if self.arrives(item) and dst in self.members:
                self.members[dst].on_peer_frame(src, frame, self.now)
        raise AssertionError("the members never stop talking")

    def arrives(self, item: tuple[int, int, b.BusFrame]) -> bool:
        """Whether a queued frame still reaches its receiver: written on the pair's current connection."""
        pair = frozenset(item[:2])
        connection = getattr(item, "connection", None)
        return pair in self.links and (connection is None or connection == self.connections.get(pair))

    def _workers_read(self) -> None:
        """Every worker reads what its agent sent it; a stream's states are rendered only now."""
        for index, outbox in self.outbox.items():
            if index in self.frozen:
                continue
            while outbox:
                item = outbox.popleft()
                for frame in item if isinstance(item, Iterator) else (item,):
                    self.workers[index].take(frame)

    def _consensus(self) -> None:
        """Guaranteed mode: the lowest live seed leads, and its view becomes the table."""
        if not self.guaranteed or self.hold_tables:
            return
        seeds = [i for i in sorted(self.members) if i < 3]
        for index, member in self.members.items():
            member.leader = bool(seeds) and index == seeds[0]  # as Raft's flag: it changes only at an election
        if not seeds:
            return
        leader = self.members[seeds[0]]
        reachable = [s for s in seeds if s == seeds[0] or frozenset((s, seeds[0])) in self.links]
        quorum = len(reachable) >= 2
        leader.leader, leader.leader_quorum = True, quorum
        if not quorum:
            return
        proposal = assign(self.table, leader.live_members(), self.size, leader.live_incarnations())
        if proposal.version != self.table.version:
            self.table = proposal
            for s in reachable:
                self.members[s].set_table(proposal, self.now)

    def give_table(self, table: Table, to: Iterable[int]) -> None:
        """The consensus committed ``table``; only the members ``to`` learn it now (the others later, or never)."""
        self.table = table
        for index in to:
            self.members[index].set_table(table, self.now)

    def publish(self, index: int, subject: str, content: bytes, publish_id: str = "") -> int:
        self.requests += 1
        frame = b.Forward(self.requests, subject, content, {}, True, self.guaranteed, {}, publish_id)
        self.members[index].on_worker_frame(0, frame, self.now)
        return self.requests

    def status(self, index: int, request: int) -> Status | None:
        answer = self.answers.get((index, request))
        return Status(answer.status) if answer is not None else None


@dataclass
class _Wire:
    net: Net
    me: int

    def to_peer(self, member: int, frame: b.BusFrame) -> None:
        b.decode(b.encode(frame)[4:])  # every frame the machine emits must survive the codec
        pair = frozenset((self.me, member))
        connection = self.net.connections.get(pair, 0) if pair in self.net.links else -1
        self.net.queue.append(_sent(self.me, member, frame, connection, self.net.now))

    def stream_to_peer(self, member: int, frames: Iterator[b.BusFrame]) -> None:
        for frame in frames:  # taken in the member's turn: the link's pacing changes when they leave, not what
            self.to_peer(member, frame)

    def to_workers(self, frame: b.BusFrame) -> None:
        self.to_worker(0, frame)

    def to_worker(self, worker: int, frame: b.BusFrame) -> None:
        if isinstance(frame, b.ForwardStatus):
            self.net.answers[(self.me, frame.request)] = frame
        else:
            self.net.outbox[self.me].append(frame)

    def stream_to_worker(self, worker: int, frames: Iterator[b.BusFrame]) -> None:
        self.net.outbox[self.me].append(frames)  # rendered when the worker reads it, as the bus does

    def stream_to_workers(self, workers: Iterable[int], frames: Iterator[b.BusFrame]) -> None:
        if list(workers):  # the simulation's workers are one outbox
            self.stream_to_worker(0, frames)

    def drop_peer(self, member: int, reason: str) -> None:
        self.net.links.discard(frozenset((self.me, member)))
        if member in self.net.frozen:
            self.net.thawed.append((member, self.me))  # it sees the reset only when it runs again
        elif member in self.net.members:
            self.net.members[member].peer_down(self.me, self.net.now)
