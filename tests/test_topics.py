"""The MQTT topic <-> subject mapping (docs/mqtt.md, "Mapping"): every valid topic has exactly one subject and
back, the escaped form is canonical, and a pattern matches a subject exactly when it matches its topic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migratory.subjects import InvalidSubject, check_subject, is_valid_subject
from migratory.topics import (
    TopicError,
    parse_filter,
    pattern_matches,
    subject_matches,
    subject_to_topic,
    topic_levels,
    topic_to_subject,
)

# levels with the characters that matter (the escape, empty levels) and some others
LEVEL = st.text(alphabet=st.sampled_from(["a", "b", "~", "x", "é", " ", "$"]), max_size=4)
TOPIC = st.lists(LEVEL, min_size=1, max_size=5).map("/".join).filter(lambda t: t != "" and not t.startswith("$"))


@given(TOPIC)
@settings(max_examples=500)
def test_every_topic_round_trips_through_a_valid_subject(topic: str) -> None:
    subject = topic_to_subject(topic)
    assert is_valid_subject(subject)
    assert subject_to_topic(subject) == topic
    assert topic_levels(subject) == topic.split("/")


@given(TOPIC, TOPIC)
def test_two_topics_never_share_a_subject(one: str, other: str) -> None:
    assert (topic_to_subject(one) == topic_to_subject(other)) is (one == other)


@given(st.lists(st.text(alphabet=st.sampled_from(["a", "~", "b"]), min_size=1, max_size=3), min_size=2, max_size=5))
def test_a_valid_subject_is_the_subject_of_its_own_topic(segments: list[str]) -> None:
    """No second spelling: any subject the syntax accepts is what its topic maps to."""
    subject = "/" + "/".join(segments)
    if is_valid_subject(subject):
        assert topic_to_subject(subject_to_topic(subject)) == subject


@pytest.mark.parametrize(
    ("topic", "subject"),
    [
        ("a/b", "/a/b"),
        ("TopicA", "/~/~TopicA"),
        ("/TopicA", "/~/~/~TopicA"),
        ("a//b", "/~/~a/~/~b"),
        ("a/b/", "/~/~a/~b/~"),
        ("/", "/~/~/~"),
        ("~/x", "/~/~~/~x"),
        ("x/~", "/x/~"),
    ],
)
def test_the_documented_examples(topic: str, subject: str) -> None:
    assert topic_to_subject(topic) == subject and subject_to_topic(subject) == topic


@pytest.mark.parametrize(
    ("subject", "why"),
    [
        ("/~/~a/~b", "is the subject /a/b"),  # the plain form is the only one
        ("/~/a", "does not start with ~"),
        ("/~/~", "empty topic"),
    ],
)
def test_non_canonical_escaped_subjects_are_refused(subject: str, why: str) -> None:
    with pytest.raises(InvalidSubject, match=why):
        check_subject(subject)


@given(st.lists(st.sampled_from(["a", "b", "", "+"]), min_size=1, max_size=4), st.booleans(), TOPIC)
@settings(max_examples=500)
def test_a_pattern_matches_a_subject_as_it_matches_its_topic(levels: list[str], hash_last: bool, topic: str) -> None:
    text = "/".join([*levels, "#"] if hash_last else levels)
    if "+" not in text and "#" not in text:
        return
    filt = parse_filter(text)
    assert filt.pattern is not None
    subject = topic_to_subject(topic)
    assert subject_matches(filt.pattern, subject) is pattern_matches(filt.pattern, topic.split("/"))


@given(st.lists(st.sampled_from(["a", "", "+"]), min_size=1, max_size=4), TOPIC)
def test_a_restricted_pattern_matches_only_its_form(levels: list[str], topic: str) -> None:
    filt = parse_filter("/".join([*levels, "#"]))
    subject = topic_to_subject(topic)
    plain, escaped = (filt.restricted(plain=True), filt.restricted(plain=False))
    assert plain.pattern is not None and escaped.pattern is not None and filt.pattern is not None
    whole = subject_matches(filt.pattern, subject)
    assert (subject_matches(plain.pattern, subject) or subject_matches(escaped.pattern, subject)) is whole
    assert not (subject_matches(plain.pattern, subject) and subject_matches(escaped.pattern, subject))
    assert plain.key == escaped.key == filt.key


def test_too_long_a_topic_is_refused_with_the_subject_reason() -> None:
    with pytest.raises(TopicError, match="longer than"):
        topic_to_subject("x" * 1030)
