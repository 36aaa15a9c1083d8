"""Issue 48: a coordinator's own subscribers resynced (and an acknowledged message skipped) across an epoch
change while another member rejoined; replayed on the in-memory network with the tables played by hand.

Round "partition-leader" (shared/evidence/guaranteed-epoch-resync): member 0 coordinated the group of
``s0`` under epoch 144 while member 1, the old Raft leader, rejoined after a partition. Member 0 numbered
(144, 163), member 2 held it, and before member 2's acknowledgement reached member 0 the leader's next
table gave the group to member 1, which was synchronising again and never claimed it; member 0 stepped
down, keeping (144, 163) for whoever would ask, and its publisher heard FAILED. The table after that gave
the group back to member 0 (epoch 150). Member 0 gathered member 2's state (which carried (144, 163)) and
numbered on, but what it had kept for a claimant was never handed to its own workers: they received
(150, 164) past a hole and resynced their subscribers, who never disconnected. The publisher's retry of
(144, 163) was answered OK.

Round "pause-long" is the same path one member over (epochs 163 -> 169 of the same coordinator). The
tables can also skip the one that moved the group away (a member adopts only the newest table): then the
coordinator keeps its group under a new epoch, and what waited for acknowledgements of the old one waited
forever, every later message of its subject behind it.
"""

from __future__ import annotations

from migratory import bus as b
from migratory.groups import Table, epoch_for
from migratory.protocol import Status
from tests.member_sim import Net
from tests.test_member import contents, owners, started, subjects_of_group
from tests.test_repro_round122 import _deliver_one

OK = (Status.OK, Status.NO_SUBSCRIBER)


def _moved(table: Table, group: int, owner: int, members: tuple[int, ...] | None = None) -> Table:
    """The leader's next table: ``group`` to ``owner`` under a new epoch (and ``members``, if given)."""
    members = members if members is not None else table.members
    epochs = list(table.epochs)
    epochs[group] = epoch_for(owner, 3, max(epochs))
    version = table.version + 1
    admitted = tuple(table.admitted_at(m) or version for m in members)
    incarnations = tuple(table.incarnation_of(m) or 0 for m in members)
    return Table(version, members, tuple(epochs), admitted, incarnations)


def _resynced(net: Net, index: int, subject: str) -> bool:
    return b"<resync>" in contents(net, index, subject)


def _publish_ok(net: Net, member: int, subject: str, content: bytes, pid: str) -> None:
    request = net.publish(member, subject, content, pid)
    net.run()
    assert net.status(member, request) in OK


def test_a_coordinator_given_its_group_back_hands_its_subscribers_what_it_kept_for_a_claimant() -> None:
    net = started(3, guaranteed=True)
    net.hold_tables = True  # the test is the seeds' consensus
    group = next(g for g, owner in owners(net).items() if owner == 0)
    subject = subjects_of_group(group)[0]
    for n in range(3):
        _publish_ok(net, 0, subject, f"m{n}".encode(), f"id-m{n}")
    net.frozen.add(1)  # member 1 is rejoining: nothing it is sent is read for now

    # member 0 numbers X; member 2 holds it, its acknowledgement still on the way
    x = net.publish(0, subject, b"X", "id-X")
    _deliver_one(net, 0, 2, b.Published)
    assert net.members[2].replica.position(subject)[1] == 4
    # the next table gives the group to member 1 (which will not claim it) ...
    moved_away = _moved(net.table, group, 1)
    net.give_table(moved_away, to=[0, 2])
    assert net.status(0, x) is Status.FAILED  # member 0 stepped down: outcome unknown, retry
    # ... and the one after gives it back to member 0, member 1 left out
    back = _moved(moved_away, group, 0, members=(0, 2))
    net.give_table(back, to=[0, 2])
    net._drain()  # member 0 claims, member 2 answers, member 0 announces its state; no tick

    retry = net.publish(0, subject, b"X", "id-X")
    y = net.publish(0, subject, b"Y", "id-Y")
    net._drain()
    assert net.status(0, retry) in OK
    assert net.status(0, y) in OK
    expected = [b"m0", b"m1", b"m2", b"X", b"Y"]
    for index in (0, 2):
        assert not _resynced(net, index, subject), (index, net.workers[index].delivered[subject])
        assert contents(net, index, subject) == expected, index
    assert [s for _, s, _ in net.workers[0].delivered[subject]] == [1, 2, 3, 4, 5]

    # member 1 runs again, learns it was left out, rejoins; the tables go on; nothing is lost or repeated
    net.frozen.discard(1)
    net.hold_tables = False
    net.run(10)
    assert set(net.table.members) == {0, 1, 2}
    _publish_ok(net, 2, subject, b"Z", "id-Z")
    net.run(2)
    for index in range(3):
        got = [c for c in contents(net, index, subject) if c != b"<resync>"]
        assert got[-1] == b"Z" and got.count(b"X") <= 1 and got.count(b"Y") <= 1, (index, got)
    for index in (0, 2):
        assert contents(net, index, subject) == [*expected, b"Z"], index


def test_a_coordinator_whose_group_gets_a_new_epoch_of_its_own_releases_what_waited_for_the_old_one() -> None:
    """The tables skip the one that moved the group away: the group stays member 0's, under a new epoch."""
    net = started(3, guaranteed=True)
    net.hold_tables = True
    group = next(g for g, owner in owners(net).items() if owner == 0)
    subject = subjects_of_group(group)[0]
    for n in range(3):
        _publish_ok(net, 0, subject, f"m{n}".encode(), f"id-m{n}")

    x = net.publish(0, subject, b"X", "id-X")  # its copies and their acknowledgements are on the way ...
    net.give_table(_moved(net.table, group, 0), to=[0, 1, 2])  # ... when the group gets a new epoch of member 0's
    net.run(1)
    assert net.status(0, x) in (*OK, Status.FAILED)
    retry = net.publish(0, subject, b"X", "id-X")
    y = net.publish(0, subject, b"Y", "id-Y")
    net.run(1)
    assert net.status(0, retry) in OK
    assert net.status(0, y) in OK  # not blocked behind X for ever
    for index in range(3):
        assert not _resynced(net, index, subject), (index, net.workers[index].delivered[subject])
        assert contents(net, index, subject) == [b"m0", b"m1", b"m2", b"X", b"Y"], index
    positions = {net.members[i].replica.position(subject) for i in range(3)}
    assert len(positions) == 1, positions


def test_a_message_only_the_reclaiming_coordinator_holds_reaches_nobody_before_a_second_member_has_it() -> None:
    """Carried into the new epoch, a message held by this member alone waits for a peer's acknowledgement of
    the merged state, as any message waits for its second copy (bench failover round 122)."""
    net = started(3, guaranteed=True)
    net.hold_tables = True
    group = next(g for g, owner in owners(net).items() if owner == 0)
    subject = subjects_of_group(group)[0]
    _publish_ok(net, 0, subject, b"m0", "id-m0")

    x = net.publish(0, subject, b"X", "id-X")
    net.queue.clear()  # its copies are lost on the way: only member 0 holds X
    net.give_table(_moved(net.table, group, 0), to=[0, 1, 2])
    assert net.status(0, x) is Status.FAILED
    # member 0's claim: both peers answer; it announces its state (X in it) to both
    while not net.members[0].active[group]:
        src, dst, frame = net.queue.popleft()
        net.members[dst].on_peer_frame(src, frame, net.now)
    net._workers_read()
    assert contents(net, 0, subject) == [b"m0"]  # nobody else has X yet: not for member 0's subscribers either
    retry = net.publish(0, subject, b"X", "id-X")
    assert net.status(0, retry) is None  # waits for a second copy
    net._drain()  # the peers merge the announcement and acknowledge it
    assert net.status(0, retry) in OK
    for index in range(3):
        assert contents(net, index, subject) == [b"m0", b"X"], index
