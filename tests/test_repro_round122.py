"""bench failover round 122 (Guaranteed, lose-seed-majority), replayed on the in-memory network.

Three seed members; member 0 coordinates the subject's group. Publishers sit on member 1, a
subscriber on member 2. Member 0 numbers ``pub1.2-7`` and is SIGKILLed between its write to
member 2 and its write to member 1: member 2 hands the message to its subscriber at once, then is
SIGKILLed too. The only copies of the message, and of its publish id, die with them; the
subscriber fails over to member 1 (which never had it) with the position of that message.
Members 0 and 2 come back, a new coordinator of the group continues from member 1's history and
numbers the publishers' next messages under the same seq numbers: the subscriber takes the
acknowledged ``pub0.2-8`` for the message it already has (the client library drops anything at or
before its last seq) and receives ``pub1.2-7`` a second time, under a second number.

Promises at stake (docs/cluster.md): in Guaranteed mode nothing acknowledged is lost; a publish id
is numbered once by the cluster.
"""

from __future__ import annotations

from migratory import bus as b
from migratory.client import MigratoryClient
from migratory.protocol import Delivery, Status
from migratory.replica import RecoveryKind
from tests.member_sim import Net
from tests.test_member import owners, started, subjects_of_group

OK = (Status.OK, Status.NO_SUBSCRIBER)


class Subscriber:
    """One application subscriber behind the real client library's duplicate filter (client.py ``_accept``),
    reading what one member's worker delivers, and failing over to another member with its position."""

    def __init__(self, net: Net, subject: str, member: int) -> None:
        self.net = net
        self.subject = subject
        self.library = MigratoryClient(["ws://127.0.0.1:1"], reconnect=False)
        self.seen: list[tuple[int, int, bytes]] = []  # what the application received: (epoch, seq, content)
        self.resynced = False
        self.member = member
        self.read = 0

    def _offer(self, epoch: int, seq: int, content: bytes) -> None:
        frame = Delivery(self.subject, content, {}, seq, epoch, False, True, True)
        if self.library._accept(frame):
            self.seen.append((epoch, seq, content))

    def follow(self) -> None:
        delivered = self.net.workers[self.member].delivered.get(self.subject, [])
        for epoch, seq, content in delivered[self.read :]:
            if content != b"<resync>":
                self._offer(epoch, seq, content)
        self.read = len(delivered)

    def fail_over(self, member: int) -> RecoveryKind:
        """Reconnect to ``member`` and subscribe again with the last position (engine/core.py initial_frames)."""
        self.member = member
        self.read = len(self.net.workers[member].delivered.get(self.subject, []))
        position = self.library.position(self.subject) or (0, 0)
        recovery = self.net.workers[member].replica.recover(self.subject, *position)
        if recovery.kind is RecoveryKind.RECOVER:
            for entry in recovery.entries:
                self._offer(entry.epoch, entry.seq, entry.content)
        elif recovery.kind is RecoveryKind.RESYNC:
            self.resynced = True
            self.library._positions.pop(self.subject, None)
        return recovery.kind

    def contents(self) -> list[bytes]:
        return [c for _, _, c in self.seen]


def _deliver_one(net: Net, src: int, dst: int, kind: type) -> b.BusFrame:
    """Deliver the first queued frame of ``kind`` from ``src`` to ``dst`` (and nothing else)."""
    for at, (s, d, frame) in enumerate(net.queue):
        if (s, d) == (src, dst) and isinstance(frame, kind):
            del net.queue[at]
            net.members[dst].on_peer_frame(src, frame, net.now)
            return frame
    raise AssertionError(f"no {kind.__name__} queued from {src} to {dst}")


def _publish_until_answered_ok(net: Net, member: int, subject: str, content: bytes, pid: str) -> Status:
    """A publisher with retries: the same publish id until the cluster answers OK (or gives up)."""
    status = None
    for _ in range(10):
        request = net.publish(member, subject, content, pid)
        net.run(1)
        status = net.status(member, request)
        if status in OK:
            return status
    raise AssertionError(f"{pid} never acknowledged: {status}")


def test_round122_a_lost_unconfirmed_message_seen_by_a_subscriber_costs_no_acknowledged_message() -> None:
    net = started(3, guaranteed=True)
    group = next(g for g, owner in owners(net).items() if owner == 0)
    subject = subjects_of_group(group)[0]
    sub = Subscriber(net, subject, member=2)  # sub0 / sub5 of the round: on member-3 (index 2)
    acked: list[bytes] = []

    # pub0 and pub1 publish through member 1 (member-2 of the round), alternately, each id once
    for n in range(8):
        for publisher in ("pub0", "pub1"):
            if publisher == "pub1" and n == 7:
                break
            content, pid = f"{publisher}.2#{n}".encode(), f"{publisher}.2-{n}"
            assert _publish_until_answered_ok(net, 1, subject, content, pid) in OK
            acked.append(content)
    sub.follow()
    assert sub.contents() == acked  # ... pub0.2#7: seq 15 of the history
    assert net.members[1].replica.position(subject)[1] == 15

    # pub1.2-7: member 1 forwards it to the coordinator, member 0, which numbers it (seq 16) ...
    first = net.publish(1, subject, b"pub1.2#7", "pub1.2-7")
    _deliver_one(net, 1, 0, b.Forward)
    # ... and writes it to member 2 (today its subscriber gets it at once: round 122 saw (3, 16) there) ...
    _deliver_one(net, 0, 2, b.Published)
    assert net.members[2].replica.position(subject)[1] == 16
    sub.follow()
    # ... and is SIGKILLed before its write to member 1 (the queued copy dies with it); member 2 next
    net.kill(0)
    net.kill(2)
    assert net.members[1].replica.position(subject)[1] == 15  # the survivor never had seq 16

    # the subscriber fails over to member 1 with its last position (today (3, 16): member 1 answers SYNC, it is
    # 'ahead', Replica.recover)
    sub.fail_over(1)
    net.run(8)  # no seed majority: Guaranteed publications fail
    assert net.status(1, first) is Status.FAILED  # outcome unknown: the publisher retries with the same id

    # the killed members come back; the tables go on; a new coordinator takes the group over
    net.start(0)
    net.start(2)
    net.run(10)
    assert set(net.table.members) == {0, 1, 2}

    # pub0's next message (it failed during the outage) and pub1's retry of pub1.2-7, then more
    for content, pid in (
        (b"pub0.2#8", "pub0.2-8"),
        (b"pub1.2#7", "pub1.2-7"),
        (b"pub0.2#9", "pub0.2-9"),
        (b"pub1.2#8", "pub1.2-8"),
    ):
        assert _publish_until_answered_ok(net, 1, subject, content, pid) in OK
        if content not in acked:
            acked.append(content)
    net.run(2)
    sub.follow()

    got = sub.contents()
    lost = [c for c in acked if c not in got]
    twice = sorted({c for c in got if got.count(c) > 1})
    numbered = {(e, s) for e, s, c in sub.seen if c == b"pub1.2#7"}
    numbered |= {(e, s) for e, s, c in net.workers[1].delivered[subject] if c == b"pub1.2#7"}
    assert not sub.resynced
    assert not lost, f"acknowledged message(s) lost: {lost}; subscriber saw {sub.seen[-6:]}"
    assert not twice, f"delivered twice: {twice}"
    assert len(numbered) == 1, f"pub1.2-7 numbered twice: {sorted(numbered)}"
