"""Subscription index: subject -> subscribers, split by conflation period.

Kept separate from the connection objects so the fan-out loop touches one dict and
one set per publication, and so unsubscribe and disconnect cost O(subscriptions of
that client), not O(subjects).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from migratory.topics import subject_matches, topic_levels

__all__ = [
    "PatternIndex",
    "SubjectSet",
    "SubjectSubscribers",
    "SubscriptionIndex",
    "subject_set_add",
    "subject_set_remove",
]

SubjectSet = tuple[()] | str | list[str] | set[str]
"""A client's own subjects, as small as its count allows: nothing, the subject
itself (most subscribers have one: no container at all), a list while small, and a
set past ``SMALL_SET`` so membership stays O(1) for big subscribers."""

SMALL_SET = 16


def subject_set_add(subjects: SubjectSet, subject: str) -> SubjectSet:
    """Add ``subject``; returns the value to keep (its representation may change)."""
    if isinstance(subjects, set):
        subjects.add(subject)
        return subjects
    if isinstance(subjects, str):
        return subjects if subjects == subject else [subjects, subject]
    if not subjects:
        return subject
    assert isinstance(subjects, list)
    if subject not in subjects:
        subjects.append(subject)
        if len(subjects) > SMALL_SET:
            return set(subjects)
    return subjects


def subject_set_remove(subjects: SubjectSet, subject: str) -> tuple[SubjectSet, bool]:
    """Remove ``subject``; returns (the value to keep, whether it was there)."""
    if isinstance(subjects, str):
        return ((), True) if subjects == subject else (subjects, False)
    if not subjects:
        return subjects, False
    assert isinstance(subjects, list | set)
    try:
        subjects.remove(subject)
    except (ValueError, KeyError):
        return subjects, False
    return subjects, True


def subject_set_items(subjects: SubjectSet) -> list[str]:
    """The subjects, as a list (a copy: callers may modify the set while iterating)."""
    if isinstance(subjects, str):
        return [subjects]
    return list(subjects)


def subject_set_len(subjects: SubjectSet) -> int:
    return 1 if isinstance(subjects, str) else len(subjects)


def subject_set_contains(subjects: SubjectSet, subject: str) -> bool:
    return subjects == subject if isinstance(subjects, str) else subject in subjects


S = TypeVar("S", bound=Hashable)


class SubjectSubscribers(Generic[S]):
    """The subscribers of one subject: plain ones, and conflated ones per period."""

    __slots__ = ("conflated", "plain")

    def __init__(self) -> None:
        self.plain: set[S] = set()
        self.conflated: dict[int, set[S]] = {}

    def __len__(self) -> int:
        return len(self.plain) + sum(len(s) for s in self.conflated.values())


class SubscriptionIndex(Generic[S]):
    """subject -> :class:`SubjectSubscribers`; empty entries are removed."""

    __slots__ = ("_subjects",)

    def __init__(self) -> None:
        self._subjects: dict[str, SubjectSubscribers[S]] = {}

    def add(self, subject: str, subscriber: S, period_ms: int) -> None:
        """Subscribe (or re-subscribe with a new period)."""
        entry = self._subjects.get(subject)
        if entry is None:
            entry = self._subjects[subject] = SubjectSubscribers()
        else:
            self._discard(entry, subscriber)
        if period_ms:
            entry.conflated.setdefault(period_ms, set()).add(subscriber)
        else:
            entry.plain.add(subscriber)

    def remove(self, subject: str, subscriber: S) -> bool:
        """Unsubscribe; return whether the subscriber was there."""
        entry = self._subjects.get(subject)
        if entry is None:
            return False
        found = self._discard(entry, subscriber)
        if not entry.plain and not entry.conflated:
            del self._subjects[subject]
        return found

    @staticmethod
    def _discard(entry: SubjectSubscribers[S], subscriber: S) -> bool:
        if subscriber in entry.plain:
            entry.plain.discard(subscriber)
            return True
        for period, members in list(entry.conflated.items()):
            if subscriber in members:
                members.discard(subscriber)
                if not members:
                    del entry.conflated[period]
                return True
        return False

    def get(self, subject: str) -> SubjectSubscribers[S] | None:
        return self._subjects.get(subject)

    def count(self, subject: str) -> int:
        entry = self._subjects.get(subject)
        return 0 if entry is None else len(entry)

    def subjects(self) -> list[str]:
        return list(self._subjects)


class PatternIndex(Generic[S]):
    """Wildcard subscriptions (MQTT ``+`` and ``#``): pattern key -> (levels, subscribers).

    Matched by walking every pattern on each delivery: the fan-out pays only while some client
    of this worker holds a wildcard subscription, and in proportion to the distinct patterns.
    """

    __slots__ = ("_patterns",)

    def __init__(self) -> None:
        self._patterns: dict[str, tuple[tuple[str, ...], set[S]]] = {}

    def __bool__(self) -> bool:
        return bool(self._patterns)

    def add(self, key: str, pattern: tuple[str, ...], subscriber: S) -> None:
        entry = self._patterns.get(key)
        if entry is None:
            entry = self._patterns[key] = (pattern, set())
        entry[1].add(subscriber)

    def remove(self, key: str, subscriber: S) -> bool:
        entry = self._patterns.get(key)
        if entry is None or subscriber not in entry[1]:
            return False
        entry[1].discard(subscriber)
        if not entry[1]:
            del self._patterns[key]
        return True

    def match(self, subject: str) -> set[S]:
        """The subscribers of every pattern ``subject`` matches (each once)."""
        found: set[S] = set()
        levels = topic_levels(subject)  # once, for every pattern
        for pattern, members in self._patterns.values():
            if subject_matches(pattern, subject, levels):
                found |= members
        return found
