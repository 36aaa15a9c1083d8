"""Snapshot model: the Architecture Guide's Table 4.3 ("Examples of Snapshot Messages")."""

from __future__ import annotations

from migratory.message import merge_fields
from migratory.replica import Entry, Replica

IBM = "/Stocks/NYSE/IBM"

# (published content, published fields) -> expected snapshot (content, fields)
SEED_SNAPSHOTS = [
    ((b"193", {"volume": "6.62M"}), (b"193", {"volume": "6.62M"})),
    ((b"192", {}), (b"192", {"volume": "6.62M"})),
    ((b"195", {"ask": "190"}), (b"195", {"ask": "190", "volume": "6.62M"})),
    ((b"193", {"bid": "194", "ask": "191"}), (b"193", {"bid": "194", "ask": "191", "volume": "6.62M"})),
]


def test_seed_snapshot_table() -> None:
    replica = Replica()
    for (content, fields), (want_content, want_fields) in SEED_SNAPSHOTS:
        replica.apply(IBM, Entry(7, replica.next_seq(IBM), content, fields))
        snapshot = replica.get(IBM)
        assert snapshot is not None
        assert snapshot.content == want_content
        assert dict(snapshot.fields) == want_fields
        assert snapshot.epoch == 7
    snapshot = replica.get(IBM)
    assert snapshot is not None and snapshot.seq == 4


def test_non_retained_message_does_not_change_snapshot_but_takes_a_seq() -> None:
    replica = Replica()
    replica.apply("/a/b", Entry(1, replica.next_seq("/a/b"), b"1"))
    seq = replica.next_seq("/a/b")
    replica.apply("/a/b", Entry(1, seq, b"2", retained=False))
    snap = replica.get("/a/b")
    assert snap is not None and snap.content == b"1" and snap.seq == 1
    assert seq == 2 and replica.position("/a/b") == (1, 2)


def test_merge_fields_latest_wins() -> None:
    assert merge_fields({"a": "1", "b": "2"}, {"b": "3", "c": "4"}) == {"a": "1", "b": "3", "c": "4"}


def test_subject_without_snapshot() -> None:
    assert Replica().get("/x/y") is None
