"""Replicated subject state: live apply, cache, recovery and merging (no sockets)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migratory.replica import Applied, Entry, RecoveryKind, Replica

S = "/s/x"


def history(epoch: int, first: int, count: int, tag: str = "") -> list[Entry]:
    return [
        Entry(epoch, seq, f"{tag}{seq}".encode(), {f"f{seq % 3}": str(seq)}, True, f"{tag}id{seq}")
        for seq in range(first, first + count)
    ]


def fed(entries: list[Entry], cache: int = 0) -> Replica:
    replica = Replica(cache_size=cache, cache_ttl=100.0)
    for entry in entries:
        replica.apply(S, entry, 0.0)
    return replica


def test_live_messages_in_order_duplicates_and_gaps() -> None:
    replica = Replica(cache_size=10)
    assert replica.next_seq(S) == 1
    assert replica.apply(S, Entry(3, 1, b"a", {"x": "1"})) is Applied.NEW
    assert replica.apply(S, Entry(3, 2, b"b", {"y": "2"})) is Applied.NEW
    assert replica.apply(S, Entry(3, 2, b"b")) is Applied.DUPLICATE
    assert replica.apply(S, Entry(3, 1, b"a")) is Applied.DUPLICATE
    snapshot = replica.get(S)
    assert snapshot is not None and (snapshot.content, dict(snapshot.fields), snapshot.seq) == (
        b"b",
        {"x": "1", "y": "2"},
        2,
    )
    assert replica.apply(S, Entry(3, 5, b"e")) is Applied.GAP
    assert replica.position(S) == (3, 5) and replica.gaps == 1
    # the cache restarted at the gap: a client that saw seq 2 cannot be recovered, only resynced
    assert replica.recover(S, 3, 2).kind is RecoveryKind.RESYNC
    assert replica.recover(S, 3, 5).kind is RecoveryKind.SYNC


def test_non_retained_messages_are_numbered_and_cached_but_leave_the_snapshot() -> None:
    replica = Replica(cache_size=10)
    replica.apply(S, Entry(1, 1, b"kept"))
    replica.apply(S, Entry(1, 2, b"live only", retained=False))
    snapshot = replica.get(S)
    assert snapshot is not None and snapshot.content == b"kept" and replica.position(S) == (1, 2)
    assert [e.content for e in replica.recover(S, 1, 1).entries] == [b"live only"]


def test_recovery_sends_exactly_what_was_missed() -> None:
    replica = fed(history(4, 1, 20), cache=8)
    recovery = replica.recover(S, 4, 15)
    assert recovery.kind is RecoveryKind.RECOVER
    assert [e.seq for e in recovery.entries] == [16, 17, 18, 19, 20]
    assert replica.recover(S, 4, 20).kind is RecoveryKind.SYNC
    assert len(replica.recover(S, 4, 12).entries) == 8  # 13, the oldest cached, follows 12 in the same epoch
    assert replica.recover(S, 4, 11).kind is RecoveryKind.RESYNC  # evicted: the snapshot instead
    assert replica.recover(S, 9, 15).kind is RecoveryKind.RESYNC  # another history's position
    assert replica.recover(S, 4, 23).kind is RecoveryKind.SYNC  # ahead of us: live messages will catch up
    resync = replica.recover(S, 4, 3)
    assert resync.snapshot is not None and resync.snapshot.seq == 20
    assert replica.recover("/none/here", 1, 1).kind is RecoveryKind.RESYNC


def test_cache_expiry_and_publish_ids() -> None:
    replica = Replica(cache_size=3, cache_ttl=10.0)
    for seq in range(1, 5):
        replica.apply(S, Entry(1, seq, b"m", publish_id=f"p{seq}"), now=float(seq))
    assert replica.find_publish("p1") is None  # evicted with its entry
    assert replica.find_publish("p4") == (S, 1, 4)
    assert replica.expire(12.5) == 1  # seq 2 was cached at t=2
    assert replica.find_publish("p2") is None and replica.cached_messages() == 2
    assert replica.expire(100.0) == 2
    assert replica.recover(S, 1, 3).kind is RecoveryKind.RESYNC
    assert replica.find_publish("p4") is None


def test_a_replica_behind_catches_up_with_the_missing_messages() -> None:
    full = fed(history(2, 1, 30), cache=50)
    behind = fed(history(2, 1, 22), cache=50)
    sync = full.sync(S)
    assert sync is not None
    merged = behind.merge(sync)
    assert not merged.resync and [e.seq for e in merged.new] == list(range(23, 31))
    assert behind.sync(S) == sync
    assert full.merge(sync).changed is False


def test_standard_mode_without_cache_resyncs_to_the_snapshot() -> None:
    full = fed(history(2, 1, 30))
    behind = fed(history(2, 1, 22))
    sync = full.sync(S)
    assert sync is not None and sync.entries == ()
    merged = behind.merge(sync)
    assert merged.resync and merged.new == ()
    assert behind.get(S) == full.get(S) and behind.position(S) == (2, 30)


def test_a_replica_that_never_saw_the_subject_gets_its_whole_history_or_adopts_it() -> None:
    full = fed(history(2, 1, 5), cache=10)
    empty = Replica(cache_size=10)
    sync = full.sync(S)
    assert sync is not None
    assert [e.seq for e in empty.merge(sync).new] == [1, 2, 3, 4, 5]  # all cached: every message is new here
    assert empty.sync(S) == sync
    assert empty.find_publish("id3") == (S, 2, 3)
    trimmed = fed(history(2, 1, 15), cache=10).sync(S)  # the first messages fell out of the cache
    assert trimmed is not None
    late = Replica(cache_size=10)
    merged = late.merge(trimmed)
    assert merged.resync and not merged.new
    assert late.sync(S) == trimmed


def test_late_joiner_gets_older_cached_messages() -> None:
    base = history(2, 1, 10)
    full = fed(base, cache=20)
    joiner = Replica(cache_size=20)
    joiner.apply(S, base[-1])  # it saw only the last message live
    sync = full.sync(S)
    assert sync is not None
    assert joiner.merge(sync).changed is False  # same position: nothing to deliver ...
    assert joiner.recover(S, 2, 4).kind is RecoveryKind.RECOVER  # ... but its cache now reaches back


lineages = st.tuples(
    st.integers(0, 12),  # common prefix length
    st.integers(0, 8),  # messages only on side A
    st.integers(0, 8),  # messages only on side B
    st.integers(0, 25),  # cache size (0: Standard mode)
    st.booleans(),  # which side got the higher epoch
)


@settings(max_examples=300, deadline=None)
@given(lineages)
def test_two_diverged_replicas_converge_whoever_merges_first(case: tuple[int, int, int, int, bool]) -> None:
    common, only_a, only_b, cache, a_higher = case
    prefix = history(1, 1, common, "c")
    epoch_a, epoch_b = (7, 5) if a_higher else (5, 7)
    a_side = prefix + history(epoch_a, common + 1, only_a, "a")
    b_side = prefix + history(epoch_b, common + 1, only_b, "b")
    if not a_side and not b_side:
        return
    a, b = fed(a_side, cache), fed(b_side, cache)
    sync_a, sync_b = a.sync(S), b.sync(S)
    if sync_a is not None:
        b.merge(sync_a)
    if sync_b is not None:
        a.merge(sync_b)
    assert a.position(S) == b.position(S)
    assert a.get(S) == b.get(S)
    winner = max(a_side[-1:] + b_side[-1:], key=lambda e: (e.seq, e.epoch))
    assert a.position(S) == (winner.epoch, winner.seq)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(0, 40), st.integers(1, 30))
def test_merge_delivers_a_contiguous_continuation_or_a_resync(total: int, seen: int, cache: int) -> None:
    seen = min(seen, total)
    full = fed(history(3, 1, total), cache)
    behind = fed(history(3, 1, seen), cache)
    sync = full.sync(S)
    assert sync is not None
    merged = behind.merge(sync)
    if seen == total:
        assert not merged.changed
    elif total - seen <= cache:  # seen == 0: the whole history is cached, all of it is new
        assert [e.seq for e in merged.new] == list(range(seen + 1, total + 1)) and not merged.resync
    else:
        assert merged.resync and not merged.new
    assert behind.get(S) == full.get(S)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["/a", "/b", "/c"]), st.booleans(), st.integers(0, 3), st.booleans()), max_size=30
    )
)
def test_snapshot_count_follows_applies_and_merges(steps: list[tuple[str, bool, int, bool]]) -> None:
    """len(replica) is kept as snapshots come and go (the monitor asks every second; counting was O(subjects))."""
    replica = Replica(cache_size=4, cache_ttl=100.0)
    other = Replica(cache_size=4, cache_ttl=100.0)
    for subject, retained, skip, from_other in steps:
        if from_other:  # another replica's state of the subject, merged in: may bring or replace a snapshot
            other.apply(subject, Entry(9, other.next_seq(subject) + skip, b"o", {}, retained), 0.0)
            state = other.sync(subject)
            assert state is not None
            replica.merge(state, 0.0)
        else:
            replica.apply(subject, Entry(1, replica.next_seq(subject) + skip, b"m", {}, retained), 0.0)
        assert len(replica) == sum(replica.get(s) is not None for s in replica.subjects())
        assert replica.subject_count() == len(replica.subjects())


def test_a_replica_without_a_cache_keeps_the_subjects_a_stored_session_wants() -> None:
    """A single node caches nothing, except what a stored MQTT session's QoS 1 subscriptions want."""
    replica = Replica(0, 60.0, keep_size=3)
    replica.wants = lambda subject: subject.startswith("/w/")  # a wildcard filter's answer for new subjects
    replica.keep("/k", True)  # kept before its first message
    for seq in range(1, 6):
        for subject in ("/k", "/w/x", "/plain"):
            replica.apply(subject, Entry(1, seq, b"m%d" % seq), now=float(seq))
    assert replica.kept() == {"/k", "/w/x"}
    assert replica.caches("/k") and not replica.caches("/plain")
    recovery = replica.recover("/k", 1, 3)
    assert recovery.kind is RecoveryKind.RECOVER and [e.seq for e in recovery.entries] == [4, 5]
    assert [e.seq for e in replica.recover("/w/x", 1, 2).entries] == [3, 4, 5]  # at most keep_size
    assert replica.recover("/w/x", 1, 1).kind is RecoveryKind.RESYNC  # older than the cache
    assert replica.recover("/plain", 1, 3).kind is RecoveryKind.RESYNC  # not kept: the snapshot, as before
    assert replica.expire(64.5) == 4  # kept caches expire like any cache
    replica.keep("/w/x", False)
    assert replica.kept() == {"/k"} and replica.recover("/w/x", 1, 4).kind is RecoveryKind.RESYNC
    everything = Replica(5, 60.0, keep_size=3)  # a Guaranteed replica caches every subject: keep changes nothing
    everything.keep("/k", True)
    assert everything.kept() == set() and everything.caches("/other")


def test_the_subjects_kept_for_stored_sessions_follow_their_latest_record() -> None:
    """mqttstore.Wanted: a stale record coming back from its coordinator after a newer one was applied here
    changes nothing; an ended session releases its filters; the server's private subjects are never kept."""
    from types import SimpleNamespace

    from migratory.server.sessions.mqttstore import Record, Wanted

    replica = Replica(0, 60.0, keep_size=10)
    wanted = Wanted(SimpleNamespace(replica=replica))  # type: ignore[arg-type]
    subscribed = Record("w/1", 1.0, True, 600, 2.0, [("a/b", 1, 0, False), ("#", 1, 0, False)])
    connected = Record("w/1", 1.0, True, 600, 1.0)  # written first, heard last
    wanted.heard("c1", subscribed, 2.0)
    wanted.heard("c1", connected, 2.1)
    for subject in ("/a/b", "/x/y", "/migratory/mqtt/cYzE", "/migratory/mqtt/t3"):
        replica.apply(subject, Entry(1, 1, b"m"), now=2.0)
    assert replica.kept() == {"/a/b", "/x/y"}  # "#" matches every subject but the private ones
    other = Record("w/2", 3.0, True, 600, 3.0, [("a/b", 1, 0, False)])
    wanted.heard("c2", other, 3.0)
    wanted.heard("c1", Record.ended("w/3", 4.0), 4.0)
    assert replica.kept() == {"/a/b"}  # still wanted by c2
    wanted.heard("c2", Record("w/2", 3.0, False, 600, 5.0, [("a/b", 1, 0, False)]), 700.0)  # expired away
    assert replica.kept() == set()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["apply", "apply", "apply", "gap", "ahead", "level", "keep", "expire"]),
            st.integers(0, 4),  # subject
            st.floats(0.0, 3.0),  # time step
            st.integers(1, 9),  # how far the other replica runs ahead
        ),
        max_size=80,
    ),
    st.booleans(),
)
def test_expiry_drops_exactly_the_old_front_of_every_cache(
    steps: list[tuple[str, int, float, int]], keep_only: bool
) -> None:
    """Expiry visits only the subjects due (a heap, not a walk over all of them) but must drop what the walk
    did: in every subject, the run of oldest messages (and publish ids) past their time, nothing more,
    through caches dropped and made again (a gap, a merge that adopts or prepends, keep() off and on)."""
    ttl = 5.0
    replica = Replica(0 if keep_only else 3, ttl, id_window=ttl, keep_size=3 if keep_only else 0)
    source = Replica(6, 0.0)  # another replica of the same history, with a longer cache
    now = 0.0
    seqs = dict.fromkeys(range(5), 0)
    for op, n, step, ahead in steps:
        now += step
        subject = f"/s/{n}"
        if op in ("apply", "gap"):  # a gap: the replica misses one, its cache starts again
            if op == "gap":
                seqs[n] += 1
                source.apply(subject, Entry(1, seqs[n], b"m"), now)
            seqs[n] += 1
            replica.apply(subject, Entry(1, seqs[n], b"m", publish_id=f"{n}-{seqs[n]}"), now)
            source.apply(subject, Entry(1, seqs[n], b"m"), now)
        elif op == "ahead":  # the other replica is ahead: the missing messages, or its state adopted
            for _ in range(ahead):
                seqs[n] += 1
                source.apply(subject, Entry(1, seqs[n], b"o", publish_id=f"{n}-{seqs[n]}"), now)
            sync = source.sync(subject)
            assert sync is not None
            replica.merge(sync, now)
        elif op == "level":  # the same position: the older messages we lack are prepended
            sync = source.sync(subject)
            if sync is not None:
                replica.merge(sync, now)
        elif op == "keep":
            replica.keep(subject, subject not in replica.kept())
        else:
            cutoff = now - ttl
            states = replica._states
            expected = 0
            for state in states.values():
                for when, *_ in state.cache or ():
                    if when > cutoff:
                        break
                    expected += 1
            assert replica.expire(now) == expected
            for state in states.values():
                assert not state.cache or state.cache[0][0] > cutoff
                assert not state.ids or state.ids[0][0] > cutoff
            assert set(replica._cached) == {s for s, state in states.items() if state.cache}
            assert set(replica._with_ids) == {s for s, state in states.items() if state.ids}
            assert replica.cached_messages() == sum(len(state.cache or ()) for state in states.values())
            for current, heap in ((replica._cached, replica._cache_due), (replica._with_ids, replica._ids_due)):
                # filed (a cache dropped and made again in the same instant may leave an identical stale
                # entry beside it, skipped when it comes up), no later than its oldest entry
                assert all((when, s) in heap for s, when in current.items())
            assert all(when <= states[s].cache[0][0] for s, when in replica._cached.items())  # type: ignore[index]
            assert all(when <= states[s].ids[0][0] for s, when in replica._with_ids.items())  # type: ignore[index]


def test_the_recent_publish_ids_keep_the_newest_across_subjects_and_drop_the_oldest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past MAX_RECENT_IDS the oldest id, whichever its subject, goes first (an OrderedDict's popitem: a
    plain dict's first key dropped again and again cost 104 us each at 100,000 ids, enough to stall a
    rejoining agent merging 200,000 cached messages for a second a turn)."""
    from migratory import replica as r

    monkeypatch.setattr(r, "MAX_RECENT_IDS", 50)
    replica = Replica(cache_size=1, cache_ttl=100.0, id_window=100.0)
    order = []
    for seq in range(1, 41):
        for subject in ("/a", "/b", "/c"):
            replica.apply(subject, Entry(1, seq, b"m", publish_id=f"{subject}-{seq}"), now=1.0)
            order.append((subject, seq))
    for subject, seq in order[:-50]:
        assert replica.find_publish(f"{subject}-{seq}") is None
    for subject, seq in order[-50:]:
        assert replica.find_publish(f"{subject}-{seq}") == (subject, 1, seq)


def test_cached_messages_are_not_tracked_by_the_garbage_collector() -> None:
    """Issue 50: a Guaranteed worker's cache (1,000 messages of every subject) held two tracked objects per
    message, and every full collection walked them all (0.25-1.0 s pauses under load). Cached, a message is
    a tuple of atoms the collector drops from its lists; a recovery still gets entries, fields and all."""
    import gc

    replica = Replica(cache_size=100, cache_ttl=180.0)
    for n in range(1, 301):
        fields = {"price": str(n)} if n % 2 else {}
        replica.apply(f"/gc/s{n % 3}", Entry(1, n // 3 + 1, b"x", fields, True, f"p-{n}"), now=float(n))
    gc.collect()
    gc.collect()  # a tuple is untracked once the one it holds (the fields) is
    rows = [row for state in replica._states.values() for row in state.cache or ()]
    tracked = [row for row in rows if gc.is_tracked(row)]
    assert len(rows) == 300 and not tracked, (tracked[:2], [gc.is_tracked(x) for x in tracked[0]] if tracked else 0)
    recovery = replica.recover("/gc/s1", 1, 50)
    assert recovery.kind is RecoveryKind.RECOVER
    assert [e.seq for e in recovery.entries] == list(range(51, 101))
    assert all(isinstance(e.fields, dict) for e in recovery.entries)
    assert {e.fields.get("price") for e in recovery.entries} - {None} and replica.find_publish("p-298")
