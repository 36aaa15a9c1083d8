"""Subscription index: subject -> subscribers, split by conflation period.

Kept separate from the connection objects so the fan-out loop touches one dict and
one set per publication, and so unsubscribe and disconnect cost O(subscriptions of
that client), not O(subjects).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["SubjectSet", "SubjectSubscribers", "SubscriptionIndex", "subject_set_add", "subject_set_remove"]

SubjectSet = list[str] | set[str]
"""A client's own subjects: a list while small (64 bytes for one, against 184 for a
dict), a set past ``SMALL_SET`` so membership stays O(1) for big subscribers."""

SMALL_SET = 16


def subject_set_add(subjects: SubjectSet, subject: str) -> SubjectSet:
    """Add ``subject``; returns the container to keep (it may have become a set)."""
    if isinstance(subjects, set):
        subjects.add(subject)
        return subjects
    if subject not in subjects:
        subjects.append(subject)
        if len(subjects) > SMALL_SET:
            return set(subjects)
    return subjects


def subject_set_remove(subjects: SubjectSet, subject: str) -> bool:
    """Remove ``subject``; return whether it was there."""
    try:
        subjects.remove(subject)
    except (ValueError, KeyError):
        return False
    return True


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
