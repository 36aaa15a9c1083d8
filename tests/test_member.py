"""The member state machine on an in-memory network: agreement, failover, joins, partitions."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migratory import bus as b
from migratory.groups import GROUPS, Table, epoch_for, group_of
from migratory.protocol import Status
from migratory.replica import Entry
from tests.member_sim import Net


def subjects_of_group(group: int, count: int = 3) -> list[str]:
    out, n = [], 0
    while len(out) < count:
        subject = f"/g/{n}"
        if group_of(subject) == group:
            out.append(subject)
        n += 1
    return out


def same(values: list[object]) -> bool:
    return all(v == values[0] for v in values)


def owners(net: Net) -> dict[int, int]:
    """group -> the one member that actively coordinates it (asserts there is exactly one)."""
    out = {}
    for group in range(GROUPS):
        active = [i for i, m in net.members.items() if m.active[group]]
        assert len(active) == 1, (group, active)
        out[group] = active[0]
    return out


def started(size: int, guaranteed: bool = False) -> Net:
    net = Net(size, guaranteed)
    for index in range(size):
        net.start(index)
    net.run(5)
    assert all(m.ready for m in net.members.values())
    return net


def contents(net: Net, index: int, subject: str) -> list[bytes]:
    return [c for _, _, c in net.workers[index].delivered.get(subject, [])]


def test_members_agree_on_one_coordinator_per_group() -> None:
    net = started(3)
    table = owners(net)
    assert set(table.values()) == {0, 1, 2}  # the groups spread over the members
    epochs = {tuple(m.epochs) for m in net.members.values()}
    assert len(epochs) == 1


def test_publish_anywhere_receive_everywhere_in_one_order() -> None:
    net = started(3)
    subjects = [f"/s/{i}" for i in range(12)]
    requests = []
    for n in range(20):
        for subject in subjects:
            publisher = (n + hash(subject)) % 3
            requests.append((publisher, net.publish(publisher, subject, f"{subject}:{n}".encode())))
        net.run()
    assert all(net.status(i, r) in (Status.OK, Status.NO_SUBSCRIBER) for i, r in requests)
    for subject in subjects:
        expected = [f"{subject}:{n}".encode() for n in range(20)]
        for index in range(3):
            assert contents(net, index, subject) == expected
            assert [s for _, s, _ in net.workers[index].delivered[subject]] == list(range(1, 21))
        assert same([net.workers[i].replica.get(subject) for i in range(3)])


def test_a_killed_coordinator_hands_its_groups_over_and_numbering_continues() -> None:
    net = started(3)
    table = owners(net)
    group = next(g for g, owner in table.items() if owner == 2)
    subject = subjects_of_group(group)[0]
    for n in range(5):
        net.publish(0, subject, f"a{n}".encode())
    net.run()
    net.kill(2)
    net.run(1)
    new_table = owners(net)
    assert new_table[group] in (0, 1)
    assert all(owner in (0, 1) for owner in new_table.values())
    for n in range(5):
        net.publish(1, subject, f"b{n}".encode())
    net.run()
    for index in (0, 1):
        delivered = net.workers[index].delivered[subject]
        assert [c for _, _, c in delivered] == [f"a{n}".encode() for n in range(5)] + [
            f"b{n}".encode() for n in range(5)
        ]
        assert [s for _, s, _ in delivered] == list(range(1, 11))
        assert delivered[5][0] > delivered[4][0]  # a new epoch after the failover


def test_a_late_member_joins_with_every_snapshot_then_takes_groups() -> None:
    net = Net(3)
    net.start(0)
    net.start(1)
    net.run(5)
    subjects = [f"/late/{i}" for i in range(10)]
    for subject in subjects:
        net.publish(0, subject, b"v1")
    net.run()
    for subject in subjects:
        net.publish(1, subject, b"v2")
    net.run()
    net.start(2)
    net.run(2)
    assert net.members[2].ready
    for subject in subjects:
        snapshot = net.workers[2].replica.get(subject)
        assert snapshot is not None and snapshot.content == b"v2" and snapshot.seq == 2
    assert 2 in owners(net).values()
    for subject in subjects:
        net.publish(2, subject, b"v3")
    net.run()
    for subject in subjects:
        assert {net.workers[i].replica.position(subject)[1] for i in range(3)} == {3}


def test_a_partition_heals_and_every_member_converges() -> None:
    net = started(3)
    subjects = [f"/p/{i}" for i in range(16)]
    for subject in subjects:
        net.publish(0, subject, b"before")
    net.run()
    net.partition(2)
    net.run(1)
    for subject in subjects:  # both sides go on (Standard tolerates a lone member)
        net.publish(0, subject, b"majority")
        net.publish(2, subject, b"minority")
    net.run(1)
    net.heal()
    net.run(3)
    owners(net)
    for subject in subjects:
        positions = {net.workers[i].replica.position(subject) for i in range(3)}
        snapshots = [net.workers[i].replica.get(subject) for i in range(3)]
        assert len(positions) == 1 and same(snapshots), subject


def test_standard_member_alone_serves() -> None:
    net = Net(3)
    net.start(1)
    net.run(4)
    assert net.members[1].ready
    request = net.publish(1, "/alone/x", b"1")
    net.run()
    assert net.status(1, request) == Status.NO_SUBSCRIBER
    assert owners(net)


def test_guaranteed_every_acknowledged_message_survives_the_coordinator() -> None:
    net = started(3, guaranteed=True)
    assert net.table.members == (0, 1, 2)
    table = owners(net)
    group = next(g for g, owner in table.items() if owner == 1)
    subject = subjects_of_group(group)[0]
    sent: list[tuple[int, bytes, str, int]] = []
    for n in range(10):
        pid = f"p{n}"
        sent.append((0, f"m{n}".encode(), pid, net.publish(0, subject, f"m{n}".encode(), pid)))
    net.run()
    assert all(net.status(0, r) in (Status.OK, Status.NO_SUBSCRIBER) for *_, r in sent)
    # the next ones are in flight when the coordinator dies
    for n in range(10, 15):
        pid = f"p{n}"
        sent.append((0, f"m{n}".encode(), pid, net.publish(0, subject, f"m{n}".encode(), pid)))
    net.kill(1)
    net.run(2)
    # publishers retry whatever was not OK, with the same publish id
    for _, content, pid, request in sent:
        if net.status(0, request) not in (Status.OK, Status.NO_SUBSCRIBER):
            retry = net.publish(0, subject, content, pid)
            net.run(1)
            assert net.status(0, retry) in (Status.OK, Status.NO_SUBSCRIBER)
    for index in (0, 2):
        got = contents(net, index, subject)
        assert got == [f"m{n}".encode() for n in range(15)], got


def test_guaranteed_refuses_publications_without_a_seed_majority() -> None:
    net = started(3, guaranteed=True)
    net.kill(1)
    net.kill(2)
    net.run(4)
    request = net.publish(0, "/q/x", b"lost?", "id-1")
    net.run()
    assert net.status(0, request) == Status.FAILED
    assert "quorum" in net.answers[(0, request)].reason or "second" in net.answers[(0, request)].reason


@settings(max_examples=int(os.environ.get("MIGRATORY_FAULT_EXAMPLES", "40")), deadline=None)
@given(st.integers(0, 2**32), st.sampled_from(["kill", "partition", "restart", "majority"]))
def test_random_faults_lose_no_acknowledged_guaranteed_message(seed: int, fault: str) -> None:
    partition = fault == "partition"
    rng = random.Random(seed)
    net = started(3 if fault == "majority" else 5, guaranteed=True)  # 3: the survivor has nobody left
    subjects = [f"/r/{i}" for i in range(6)]
    acked: dict[str, list[bytes]] = {s: [] for s in subjects}
    outstanding: list[tuple[int, str, bytes, str, int]] = []
    victim = rng.choice([1, 2, 3, 4]) if fault != "majority" else 1
    victims = [1, 2] if fault == "majority" else [victim]  # "majority": two of the three seeds
    for n in range(60):
        subject = rng.choice(subjects)
        publisher = rng.choice([i for i in net.members if i not in victims] or [0])
        pid = f"{subject}#{n}"
        outstanding.append(
            (publisher, subject, f"{n}".encode(), pid, net.publish(publisher, subject, f"{n}".encode(), pid))
        )
        if n == 25:
            for index in victims:
                if partition:
                    net.partition(index)
                else:
                    net.kill(index)
        if n == 40 and fault in ("restart", "majority"):
            for index in victims:
                net.start(index, stagger=rng.choice([0.0, 0.2, 1.0]))
        net.run(rng.choice([0.0, 0.1, 0.3]))
    net.run(3)
    # every publication gets an answer; publishers retry the failed ones with the same id
    for _ in range(5):
        still = []
        for publisher, subject, content, pid, request in outstanding:
            status = net.status(publisher, request)
            assert status is not None, "a publisher got no answer"
            if status in (Status.OK, Status.NO_SUBSCRIBER):
                acked[subject].append(content)
            else:
                alive = [i for i in net.members if i not in victims or fault in ("restart", "majority")]
                retry_from = publisher if publisher in alive else alive[0]
                still.append((retry_from, subject, content, pid, net.publish(retry_from, subject, content, pid)))
        net.run(1)
        outstanding = still
    assert not outstanding
    if partition:
        net.heal()
        net.run(4)
    net.run(3)
    owners(net)  # every group ends with exactly one working coordinator
    for index in net.members:
        if index in victims and fault == "kill":
            continue
        for subject in subjects:
            got = contents(net, index, subject)
            assert len(got) == len(set(got)), f"duplicate on member {index}: {got}"
            assert set(acked[subject]) <= set(got), f"member {index} lost {set(acked[subject]) - set(got)}"
            seqs = [s for _, s, _ in net.workers[index].delivered.get(subject, [])]
            assert seqs == sorted(seqs)


def test_guaranteed_a_message_whose_only_holders_died_is_confirmed_once_they_return() -> None:
    """The coordinator numbered it, both other members died before acknowledging, then came back.

    They hold it only from their join, so they must be asked again (a duplicate is acknowledged
    too), or the subject stays blocked behind it (found by `migratory bench failover`, round 28).
    """
    net = started(3, guaranteed=True)
    group = next(g for g, owner in owners(net).items() if owner == 0)
    subject = subjects_of_group(group)[0]
    first = net.publish(0, subject, b"only-here", "id-1")  # numbered by member 0, on its way to 1 and 2 ...
    net.kill(1)  # ... who die before it arrives
    net.kill(2)
    net.run(8)
    assert net.status(0, first) is Status.FAILED  # outcome unknown for now
    net.start(1)
    net.start(2)
    net.run(8)
    retry = net.publish(0, subject, b"only-here", "id-1")
    net.run(5)  # like a real publisher, nothing else is published on the subject until this is answered
    assert net.status(0, retry) in (Status.OK, Status.NO_SUBSCRIBER)
    after = net.publish(0, subject, b"next", "id-2")
    net.run(2)
    assert net.status(0, after) in (Status.OK, Status.NO_SUBSCRIBER)
    assert contents(net, 0, subject) == [b"only-here", b"next"]
    for index in (1, 2):
        assert contents(net, index, subject)[-1] == b"next" and b"only-here" not in contents(net, index, subject)[1:]


def test_guaranteed_a_retry_of_a_message_in_flight_is_never_numbered_again() -> None:
    """Even when the cache has already forgotten its publish id (a long wait for a second copy)."""
    net = started(3, guaranteed=True)
    group = next(g for g, owner in owners(net).items() if owner == 0)
    subject = subjects_of_group(group)[0]
    first = net.publish(0, subject, b"in-flight", "id-9")
    net.queue.clear()  # its copies are lost on the way: the links stay up, nobody acknowledges
    for member in net.members.values():
        member.replica.expire(net.now + 1e6)  # CacheExpireTime passed
    retry = net.publish(0, subject, b"in-flight", "id-9")
    net.run(5)  # the coordinator sends it again; the acknowledgement answers both
    assert net.status(0, first) in (Status.OK, Status.NO_SUBSCRIBER)
    assert net.status(0, retry) in (Status.OK, Status.NO_SUBSCRIBER)
    for index in range(3):
        assert contents(net, index, subject) == [b"in-flight"], index


def test_guaranteed_a_cut_off_coordinators_unconfirmed_message_never_enters_the_history() -> None:
    """bench failover, partition-member round 5: the coordinator numbered a message nobody confirmed, was cut
    off and left out; when the cut healed towards one member it announced its state there (the message
    included) before learning it was out, while the new coordinator numbered the publisher's retry again.
    Members then held the message under two numbers and subscribers were resynchronised. Now: once, under
    the retry's number, and no resync.
    """
    net = started(3, guaranteed=True)
    group = next(g for g, owner in owners(net).items() if owner == 1)
    subject = subjects_of_group(group)[0]
    for n in range(3):
        net.publish(0, subject, f"m{n}".encode(), f"id-m{n}")
    net.run(1)
    first = net.publish(1, subject, b"late", "id-late")  # numbered by member 1; its copies never arrive
    net.partition(1)
    net.run(5)  # 0 and 2 leave 1 out; another member claims the group at a new epoch
    assert 1 not in net.table.members
    # the cut heals towards member 0 first: 1 announces its stale state there before it learns it is out
    net.cut.discard(frozenset((0, 1)))
    net._link(0, 1)
    net._drain()  # the frames only: no tick, no new table yet
    assert net.status(1, first) in (None, Status.FAILED)
    retry = net.publish(0, subject, b"late", "id-late")  # the publisher, failed over to 0, retries: same id
    net._drain()  # the group's new coordinator (member 2) numbers it
    net.heal()
    net.run(5)
    assert 1 in net.table.members
    assert net.status(0, retry) in (Status.OK, Status.NO_SUBSCRIBER)
    for index in range(3):
        assert contents(net, index, subject) == [b"m0", b"m1", b"m2", b"late"], index
    positions = {net.members[i].replica.position(subject) for i in range(3)}
    assert len(positions) == 1, positions


def test_guaranteed_a_member_left_out_and_taken_back_unseen_starts_over() -> None:
    """Members adopt only the newest table: one that says we were added after the table we hold means we
    were left out in between (our groups moved on without us), so what we hold is dropped and we rejoin."""
    net = started(3, guaranteed=True)
    member = net.members[2]
    assert member.ready and net.table.admitted_at(2) <= member.table.version
    before = member.table
    # member 2 alone was left out and taken back (the others were admitted long before)
    admitted = tuple(before.version + 2 if m == 2 else before.admitted_at(m) for m in before.members)
    skipped = Table(before.version + 2, before.members, before.epochs, admitted, before.incarnations)
    member.set_table(skipped, net.now)
    assert not member.ready and member.counters["readmitted"] == 1
    net.run(5)  # it rejoins from a ready member, and the tables go on
    assert member.ready and 2 in net.table.members


def test_guaranteed_a_member_never_confirms_a_message_it_holds_under_another_epoch() -> None:
    """Two messages under one number is a broken history: confirming the second would count a copy that
    does not exist, so the member stays silent, starts over and rejoins."""
    net = started(3, guaranteed=True)
    group = next(g for g, owner in owners(net).items() if owner == 1)
    subject = subjects_of_group(group)[0]
    net.publish(0, subject, b"one", "id-1")
    net.run(1)
    member = net.members[2]
    epoch, seq = member.replica.position(subject)
    member.epochs[group] = epoch + 3  # as if a newer coordinator of the group had fenced it
    before = len(net.queue)
    other = b.Published.of(subject, Entry(epoch + 3, seq, b"two", {}, True, "id-2"), True)
    member.on_peer_frame(1, other, net.now)
    assert not any(isinstance(f, b.Ack) for *_, f in list(net.queue)[before:])
    assert member.counters["conflicts"] == 1 and not member.ready
    net.run(5)
    assert member.ready


def test_a_member_that_did_not_run_does_not_drop_peers_it_did_not_listen_to() -> None:
    """A tick that comes seconds after the previous one (the member itself was not scheduled) gives its
    peers a fresh timeout; a peer that then stays silent is dropped as before."""
    net = started(3)
    net.run(5, step=5.0)  # frames were delivered, then the members did not run for 5 s (timeout: 3 s)
    assert all(m.counters["link_down"] == 0 for m in net.members.values())
    assert all(m.counters["paused"] == 1 for m in net.members.values())
    net.members.pop(2)  # hung: its links stay up, it sends nothing and reads nothing
    net.run(6, step=1.2)  # and the others keep running late: the grace comes once per timeout, not forever
    assert net.members[0].counters["link_down"] == 1 and 2 not in net.members[0].peers
    assert net.members[1].counters["link_down"] == 1 and 2 not in net.members[1].peers
    assert 1 in net.members[0].peers and 0 in net.members[1].peers  # they heard each other all along


def test_the_cluster_counters_reach_the_metrics() -> None:
    """Every counter the member keeps is exported by /metrics as migratory_cluster_<name>_total."""
    from migratory.metrics import exposition, node_families

    net = started(3)
    net.run(5, step=5.0)
    document = net.members[0].describe()
    families = node_families({}, {}, {}, {}, {}, 0, cluster=document)
    text = exposition(families).decode()
    for name, value in document["counters"].items():
        assert f"migratory_cluster_{name}_total {float(value)}" in text, name
    assert "migratory_cluster_paused_total 1.0" in text


def test_a_rejoining_standard_member_takes_no_group_until_linked_to_every_live_member() -> None:
    """The fault checker's split: member 2 came back linked to member 0 only, coordinated member 1's
    groups beside it, and member 1's subscribers skipped messages without a resync."""
    net = started(3)
    subjects = [f"/rejoin/{i}" for i in range(32)]
    for subject in subjects:
        net.publish(0, subject, b"before")
    net.run()
    net.kill(2)
    net.run(4)
    net.cut.add(frozenset((1, 2)))  # it reaches member 0 first; member 1's link is not up yet
    net.start(2)
    net.run(4)
    late = net.members[2]
    assert late.ready and not late.serving and late.missing() == [1]
    assert late.coordinated() == [] and not net.workers[2].ready  # no group, and no clients
    ok, reason = late.health()
    assert not ok and "member(s) 1" in reason
    assert set(owners(net).values()) == {0, 1}  # one coordinator per group: the two live members
    for subject in subjects:
        net.publish(1, subject, b"during")
    net.run(1)
    net.heal()
    net.run(4)
    assert late.serving and net.workers[2].ready and late.health() == (True, "")
    assert 2 in owners(net).values()
    for subject in subjects:
        net.publish(2, subject, b"after")
    net.run()
    for subject in subjects:
        positions = {net.workers[i].replica.position(subject) for i in range(3)}
        assert len(positions) == 1, (subject, positions)
        histories = [[c for _, _, c in net.workers[i].delivered.get(subject, [])] for i in (0, 1)]
        assert histories[0] == histories[1] == [b"before", b"during", b"after"], histories


@pytest.mark.parametrize("guaranteed", [False, True], ids=["Standard", "Guaranteed"])
def test_a_publish_id_is_numbered_once_through_a_change_of_coordinator(guaranteed: bool) -> None:
    """A publisher whose connection dropped before the answer retries with the same id on another
    member, after the coordinator died: the new coordinator knows the id from the replicated state."""
    net = started(3, guaranteed)
    subject = next(f"/once/{i}" for i in range(1000) if owners(net)[group_of(f"/once/{i}")] == 2)
    net.publish(0, subject, b"first", publish_id="order-7")
    net.run(1)
    assert {net.workers[i].replica.position(subject)[1] for i in range(3)} == {1}
    net.kill(2)
    net.run(5)
    assert owners(net)[group_of(subject)] in (0, 1)
    request = net.publish(1, subject, b"first", publish_id="order-7")  # the retry, through another member
    net.run(2)
    answer = net.answers[(1, request)]
    assert (Status(answer.status), answer.seq) in ((Status.OK, 1), (Status.NO_SUBSCRIBER, 1))
    net.publish(0, subject, b"second")
    net.run(2)
    for i in (0, 1):
        assert [c for _, _, c in net.workers[i].delivered[subject]] == [b"first", b"second"]
    net.start(2)  # a member that joins later learns the id with the state, and may coordinate it
    net.run(6)
    assert net.members[2].replica.find_publish("order-7") is not None


def test_publish_ids_travel_with_a_subjects_state_and_expire() -> None:
    from migratory.replica import Replica

    source = Replica(0, 0.0, id_window=60.0)
    for n in range(1, 4):
        source.apply("/ids", Entry(1, n, b"x", {}, True, f"id-{n}"), now=float(n))
    state = source.sync("/ids")
    assert state is not None and [pid for pid, _, _ in state.ids] == ["id-1", "id-2", "id-3"]
    frame = b.decode(b.encode(b.SyncSubject(state))[4:])
    assert isinstance(frame, b.SyncSubject) and frame.state.ids == state.ids
    target = Replica(0, 0.0, id_window=60.0)
    target.merge(frame.state, now=10.0)
    assert target.find_publish("id-2") == ("/ids", 1, 2)
    source.expire(62.5)  # id-1 and id-2 were numbered more than 60 s ago
    assert source.find_publish("id-1") is None and source.find_publish("id-3") == ("/ids", 1, 3)
    assert Replica(0, 0.0).sync is not None and not Replica(0, 0.0).find_publish("id-1")


def test_a_restarted_guaranteed_agent_is_healthy_only_once_the_table_admits_this_process() -> None:
    """The agent restarted before the leader saw it go: the table still listed the member (as the old
    process). It said ready, then the table that left the old process out dropped it again."""
    net = started(3, guaranteed=True)
    subjects = [f"/inc/{i}" for i in range(16)]
    for subject in subjects:
        net.publish(0, subject, b"before")
    net.run(1)
    before = net.table
    net.kill(2)
    net.start(2)  # no consensus step in between: the table lists member 2, as the old process
    restarted = net.members[2]
    assert 2 in net.table.members and net.table.incarnation_of(2) != restarted.s.incarnation
    seen: list[bool] = []
    for _ in range(60):
        net.run(0.1)
        seen.append(restarted.health()[0])
        if seen[-1]:
            assert net.table.incarnation_of(2) == restarted.s.incarnation  # never on the old process's place
    first = seen.index(True)
    assert all(seen[first:]), seen  # healthy once, and it stayed so (no ready, dropped, ready again)
    assert restarted.counters["readmitted"] == 0 and restarted.ready
    mine = [g for g in range(GROUPS) if net.table.owner(g, 3) == 2]
    assert mine and all(net.table.epochs[g] > before.epochs[g] for g in mine)  # new epochs for the new process
    for subject in subjects:
        net.publish(2, subject, b"after")
    net.run(2)
    for subject in subjects:
        assert {net.workers[i].replica.position(subject)[1] for i in range(3)} == {2}


def test_a_standard_coordinator_resumed_after_sigstop_numbers_nothing_under_its_old_epochs() -> None:
    """The fault checker's SIGSTOP: the hung coordinator, resumed, numbered the publications that had
    waited in its sockets, which the cluster had already numbered through the publishers' retries."""
    net = started(3)
    subject = next(f"/hang/{i}" for i in range(1000) if owners(net)[group_of(f"/hang/{i}")] == 2)
    net.publish(0, subject, b"before", publish_id="p-1")
    net.run(1)
    net.frozen.add(2)
    net.run(5)  # the others drop it after the heartbeat timeout and move its groups
    assert [i for i in (0, 1) if net.members[i].active[group_of(subject)]] in ([0], [1])
    retried = net.publish(0, subject, b"during", publish_id="p-2")  # the retry of a publication member 2 holds
    net.run(1)
    assert net.status(0, retried) in (Status.OK, Status.NO_SUBSCRIBER)
    net.thaw(2)
    hung = net.members[2]
    stale = net.publish(2, subject, b"during", publish_id="p-2")  # the original, read first after SIGCONT
    assert net.status(2, stale) is Status.FAILED and hung.counters["resumed"] == 1 and not hung.ready
    net.run(0.5)  # it sees its links reset, and redials them (a full heartbeat timeout before it would start alone)
    net.heal()
    net.run(8)
    assert hung.ready and hung.serving
    owners(net)
    # its own subscribers missed "during" while it hung: the join's state carries it (the agents' merge cache)
    for i in range(3):
        assert [c for _, _, c in net.workers[i].delivered[subject]] == [b"before", b"during"]
    for i in range(3):
        snapshot = net.workers[i].replica.get(subject)
        assert snapshot is not None and snapshot.content == b"during" and snapshot.seq == 2


def test_a_standard_member_does_not_resync_when_a_new_coordinators_state_overtakes_live_messages() -> None:
    """The five-member test's resync with no fault: a new coordinator's merged state reached a member
    before the old coordinator's last live messages (two links, no order between them). With no cache
    in Standard mode the member could only adopt the state and resync its subscribers; the agents now
    keep the last few messages of each subject for such merges."""
    net = started(3)
    subject = next(f"/race/{i}" for i in range(1000) if owners(net)[group_of(f"/race/{i}")] == 0)
    group = group_of(subject)
    net.publish(0, subject, b"m1")
    net.run()
    net.publish(0, subject, b"m2")
    net.publish(0, subject, b"m3")
    late = [item for item in net.queue if item[:2] == (0, 2)]  # member 0's live messages to member 2, slow
    net.queue = type(net.queue)(item for item in net.queue if item[:2] != (0, 2))
    claimant = net.members[1]
    claimant._claim({group: epoch_for(1, 3, max(claimant.epochs))}, [0, 1, 2], net.now)  # a rebalance
    net.run()
    net.queue.extend(late)  # they arrive after the new coordinator's state
    net.run(1)
    for i in range(3):
        assert [c for _, _, c in net.workers[i].delivered[subject]] == [b"m1", b"m2", b"m3"], i


def test_a_guaranteed_member_resumed_after_sigstop_is_unhealthy_until_the_seeds_confirm_its_table() -> None:
    """The fault suite's stop-member round: the resumed member read a leader heartbeat that had waited in
    its socket since before the pause, took the leader for fresh and its old table for current, and
    /health said ready; 0.1 s later the table that had left it out arrived and its publications FAILED."""
    net = started(3, guaranteed=True)
    hung = net.members[2]
    leader = net.members[0]
    net.run(1)
    stale = b.Heartbeat(0, True, True, True, net.table.version, int(net.now * 1e6), 0, 0, b"{}")
    old_version = net.table.version
    net.frozen.add(2)
    net.run(6)  # the others drop it and commit a table without it
    assert net.table.version > old_version and 2 not in net.table.members
    assert hung.table.version == old_version and leader.leader
    net.thaw(2)
    hung.on_peer_frame(0, stale, net.now)  # read first after SIGCONT, with the frames that waited
    assert hung.health() == (False, "resumed after a pause: waiting for the seed members to confirm the current table")
    assert hung.counters["resumed"] == 1
    net.run(0.5)
    net.heal()
    seen: list[bool] = []
    for _ in range(100):
        net.run(0.1)
        seen.append(hung.health()[0])
        if seen[-1]:  # healthy only on a table that admits this member as it is now
            assert hung.table.version == net.table.version and 2 in net.table.members
    assert seen[-1] and hung.ready
    first = seen.index(True)
    assert all(seen[first:]), seen


def test_a_guaranteed_member_cut_off_from_the_majority_says_it_is_isolated_and_only_it() -> None:
    """Issue 48: the member that lost the seeds' majority sends its clients away (ClusterInfo says so, and not
    ready); the majority's members do not, nor does a member that never served; back in, it serves again."""
    net = started(3, guaranteed=True)
    assert all(not m.isolated() for m in net.members.values())
    net.partition(2)
    net.run(1)
    assert not net.members[2].isolated()  # within the heartbeat timeout the leader's word is still fresh
    net.run(4)
    assert "cut off" in net.members[2].isolated() or "rejoining" in net.members[2].isolated()
    assert not net.members[2].info().ready
    assert all(not net.members[i].isolated() and net.members[i].info().ready for i in (0, 1))
    net.heal()
    net.run(10)
    assert all(not m.isolated() and m.info().ready for m in net.members.values())
    fresh = Net(3, guaranteed=True)
    fresh.start(0)
    fresh.run(1)
    assert not fresh.members[0].isolated()  # starting, it never served: nothing to send away


def test_a_publication_waits_for_the_table_rather_than_reach_a_restarted_coordinator_not_yet_admitted() -> None:
    """CI, lose-seed-majority: a healthy member forwarded a publication to its group's coordinator by epoch,
    a member restarted a moment before; its new process, neither admitted nor hearing the leader yet,
    answered FAILED ("no quorum") to a publisher whose own member /health had just called ready."""
    net = started(3, guaranteed=True)
    group = next(g for g in range(GROUPS) if net.table.owner(g, 3) == 2)
    subject = subjects_of_group(group, 1)[0]
    net.publish(0, subject, b"before")
    net.run(1)
    net.kill(2)
    net.start(2)  # linked at once; the table still lists member 2 as the old process, which owns the group
    assert net.table.incarnation_of(2) != net.members[2].s.incarnation
    request = net.publish(0, subject, b"after", publish_id="p-after")
    net.run(8)
    assert net.status(0, request) in (Status.OK, Status.NO_SUBSCRIBER)  # no subscriber in the simulation
    assert all(contents(net, i, subject)[-1:] == [b"after"] for i in range(3))
