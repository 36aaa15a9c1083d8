"""Subscription index and the compact per-client subject sets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from migratory.subscriptions import (
    SubjectSet,
    SubscriptionIndex,
    subject_set_add,
    subject_set_contains,
    subject_set_items,
    subject_set_len,
    subject_set_remove,
)


def test_index_splits_plain_and_conflated_and_cleans_up() -> None:
    index: SubscriptionIndex[str] = SubscriptionIndex()
    index.add("/a/b", "c1", 0)
    index.add("/a/b", "c2", 500)
    index.add("/a/b", "c2", 1000)  # re-subscribe with another period moves it
    entry = index.get("/a/b")
    assert entry is not None
    assert entry.plain == {"c1"} and entry.conflated == {1000: {"c2"}}
    assert index.count("/a/b") == 2
    assert index.remove("/a/b", "c2") and not index.remove("/a/b", "c2")
    assert index.remove("/a/b", "c1")
    assert index.get("/a/b") is None and index.subjects() == []


@given(st.lists(st.tuples(st.booleans(), st.sampled_from([f"/s/{i}" for i in range(40)])), max_size=200))
def test_subject_set_behaves_like_a_set(operations: list[tuple[bool, str]]) -> None:
    compact: SubjectSet = ()
    reference: set[str] = set()
    for add, subject in operations:
        if add:
            compact = subject_set_add(compact, subject)
            reference.add(subject)
        else:
            compact, found = subject_set_remove(compact, subject)
            assert found == (subject in reference)
            reference.discard(subject)
        assert sorted(subject_set_items(compact)) == sorted(reference)
        assert subject_set_len(compact) == len(reference)
        assert all(subject_set_contains(compact, s) for s in reference)


def test_a_single_subscription_costs_no_container() -> None:
    assert subject_set_add((), "/a/b") == "/a/b"
    assert isinstance(subject_set_add("/a/b", "/a/c"), list)
