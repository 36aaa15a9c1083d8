"""Subject syntax: the Architecture Guide's Table 4.2, plus generated subjects."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migratory.subjects import InvalidSubject, check_subject, is_valid_subject

# Table "Examples of Invalid Subjects" (invalid subject, words the reason must contain)
SEED_INVALID = [
    ("/Stocks//IBM/BID", "empty"),
    ("Stocks/IBM/BID", "does not start with a slash"),
    ("/Stocks/IBM/BID/", "last segment is empty"),
    ("/", "single empty segment"),
    ("/Stocks", "only one segment"),
]


@pytest.mark.parametrize(("subject", "reason"), SEED_INVALID)
def test_seed_invalid_subjects_are_refused_with_reason(subject: str, reason: str) -> None:
    with pytest.raises(InvalidSubject) as info:
        check_subject(subject)
    assert reason in info.value.reason
    assert not is_valid_subject(subject)


@pytest.mark.parametrize("subject", ["/Stocks/NYSE/IBM", "/a/b", "/Ünïcode/株式/ÎBM", "/a b/c-d/e.f"])
def test_valid_subjects(subject: str) -> None:
    assert check_subject(subject) == subject


def test_empty_and_nul_and_oversized() -> None:
    for bad in ["", "/a/\x00", "/a/" + "x" * 2000]:
        with pytest.raises(InvalidSubject):
            check_subject(bad)


segment = st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=["Cs"]), min_size=1, max_size=10)


@given(st.lists(segment, min_size=2, max_size=6).filter(lambda s: s[0] != "~"))
def test_generated_valid_subjects_pass(segments: list[str]) -> None:
    """(A first segment ``~`` is an escaped MQTT topic, with rules of its own: tests/test_topics.py.)"""
    assert is_valid_subject("/" + "/".join(segments))


@given(st.lists(segment, min_size=2, max_size=6), st.integers(min_value=0, max_value=5))
def test_an_empty_segment_anywhere_is_refused(segments: list[str], where: int) -> None:
    segments.insert(min(where, len(segments)), "")
    assert not is_valid_subject("/" + "/".join(segments))


@given(st.text(max_size=30))
def test_checker_never_raises_anything_else(text: str) -> None:
    try:
        check_subject(text)
    except InvalidSubject as exc:
        assert exc.reason
