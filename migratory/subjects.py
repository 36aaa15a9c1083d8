"""Subject syntax: ``/Seg1/Seg2[/...]``, like a Unix absolute path.

A subject is an initial ``/`` followed by two or more non-empty segments separated
by single slashes; ``/`` is reserved inside a segment. Subjects are UTF-8 text. A first
segment ``~`` is the escaped form of an MQTT topic that is not a subject as it stands
(migratory/topics.py): every later segment starts with ``~``, and it is the canonical form,
so no two subjects name one topic.
Every interface (WebSocket, HTTP, MQTT) validates with this one function so that
the reasons a client sees are the same everywhere.
"""

from __future__ import annotations

__all__ = [
    "ESCAPE",
    "MAX_SUBJECT_BYTES",
    "PRIVATE_PREFIX",
    "RESERVED_PREFIX",
    "SHARE_PREFIX",
    "InvalidSubject",
    "check_subject",
    "is_valid_subject",
    "private_first",
]

RESERVED_PREFIX = "/migratory/"
"""The server's own subjects (statistics, MQTT session state): no client publishes there, and no first-level
MQTT wildcard matches them."""

ESCAPE = "~"
"""The first segment of an escaped MQTT topic, and the prefix of each of its levels."""

PRIVATE_PREFIX = "/migratory/mqtt/"
"""The server's private state (MQTT session records and claims): no client reads or writes it, wildcards
never match it, and a replica sends it first in a state sync (it says what the receiver is to cache)."""

SHARE_PREFIX = PRIVATE_PREFIX + "g"
"""Markers of MQTT shared subscription groups: ``<prefix><group hash>/<member>``, subscribed by each worker that
holds members of the group (never published). Their subscriber counts, which the member agents pass on to their
workers, tell every worker which members and workers hold the group (migratory/server/sessions/mqttshare.py)."""

MAX_SUBJECT_BYTES = 1024


class InvalidSubject(ValueError):
    """Raised for a subject that breaks the syntax; ``reason`` is client-facing."""

    def __init__(self, subject: str, reason: str) -> None:
        super().__init__(f"invalid subject {subject!r}: {reason}")
        self.subject = subject
        self.reason = reason


def check_subject(subject: str) -> str:
    """Return ``subject`` unchanged if valid, else raise :class:`InvalidSubject`."""
    if not subject:
        raise InvalidSubject(subject, "the subject is empty")
    if "\x00" in subject:
        raise InvalidSubject(subject, "the subject contains a NUL character")
    try:
        encoded = subject.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidSubject(subject, "the subject is not valid UTF-8") from None
    if len(encoded) > MAX_SUBJECT_BYTES:
        raise InvalidSubject(subject, f"the subject is longer than {MAX_SUBJECT_BYTES} bytes")
    if subject[0] != "/":
        raise InvalidSubject(subject, "the subject does not start with a slash (/) character")
    segments = subject[1:].split("/")
    if len(segments) == 1:
        if segments[0] == "":
            raise InvalidSubject(subject, "subject formed from a single empty segment")
        raise InvalidSubject(subject, "subject has only one segment (two or more are required)")
    if segments[-1] == "":
        raise InvalidSubject(subject, "the last segment is empty")
    for index, segment in enumerate(segments):
        if segment == "":
            raise InvalidSubject(
                subject,
                f"segment {index + 1} is empty: the slash (/) character is not allowed "
                "in a segment and every segment must contain at least one character",
            )
    if segments[0] == ESCAPE:
        _check_escaped(subject, segments[1:])
    return subject


def _check_escaped(subject: str, levels: list[str]) -> None:
    for index, level in enumerate(levels):
        if level[0] != ESCAPE:
            raise InvalidSubject(
                subject,
                f"segment {index + 2} does not start with {ESCAPE}: a subject /{ESCAPE}/... is an escaped "
                f"MQTT topic, every level written {ESCAPE}level",
            )
    topic = [level[1:] for level in levels]
    if topic == [""]:
        raise InvalidSubject(subject, "it is the escaped form of an empty topic")
    if len(topic) >= 2 and topic[0] != ESCAPE and "" not in topic:
        raise InvalidSubject(subject, f"topic {'/'.join(topic)!r} is the subject /{'/'.join(topic)}, not escaped")


def is_valid_subject(subject: str) -> bool:
    """Return whether ``subject`` is valid, for callers that only need a yes/no."""
    try:
        check_subject(subject)
    except InvalidSubject:
        return False
    return True


def private_first(subjects: list[str]) -> list[str]:
    """``subjects`` with the private ones first, in place: a state sync sends them ahead (the MQTT session
    records say which subjects the receiving replica is to cache)."""
    subjects.sort(key=lambda subject: not subject.startswith(PRIVATE_PREFIX))
    return subjects
