"""MQTT topic names and filters as subjects and subject patterns (docs/mqtt.md, "Mapping").

Topic ``a/b/c`` is subject ``/a/b/c`` and back; a topic that would be an invalid subject (a
single level, an empty level, a leading or trailing ``/``) is refused with the subject rule's
own reason, the same one a native client gets. Topics beginning with ``$`` are the server's:
clients cannot publish there, and ``+`` or ``#`` in the first level never match them.

A filter with wildcards becomes a pattern: a tuple of levels where ``+`` matches one level,
a last ``#`` zero or more levels (``a/#`` matches ``a`` too, as MQTT says), and a last ``**``
one or more (what a ``#`` becomes when the client may read below a level but not the level
itself). The entitlement sees a pattern in its own syntax (``*`` and ``**``).
"""

from __future__ import annotations

from migratory.subjects import InvalidSubject, check_subject

__all__ = [
    "Filter",
    "TopicError",
    "parse_filter",
    "pattern_matches",
    "subject_to_topic",
    "topic_to_subject",
]

Pattern = tuple[str, ...]


class TopicError(ValueError):
    """A topic or filter the server refuses; ``reason`` is client-facing."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def topic_to_subject(topic: str) -> str:
    """The subject of a PUBLISH topic name, or :class:`TopicError`."""
    if "+" in topic or "#" in topic:
        raise TopicError(f"topic name {topic!r} contains a wildcard (+ or #)")
    if topic.startswith("$"):
        raise TopicError(f"topic names beginning with $ are the server's ({topic!r})")
    try:
        return check_subject("/" + topic)
    except InvalidSubject as exc:
        raise TopicError(f"topic {topic!r} maps to an invalid subject: {exc.reason}") from None


def subject_to_topic(subject: str) -> str:
    return subject[1:]


class Filter:
    """A parsed SUBSCRIBE filter: an exact subject, or a pattern (with its key and entitlement form)."""

    __slots__ = ("key", "pattern", "subject")

    def __init__(self, subject: str | None, pattern: Pattern | None) -> None:
        self.subject = subject
        self.pattern = pattern
        # a pattern's name among the client's subscriptions: NUL never occurs in a subject
        self.key = subject if subject is not None else "\x00/" + "/".join(pattern or ())

    def entitlement_subject(self) -> str:
        """The pattern as the entitlement reads it (``*``, ``**``); an exact subject as is."""
        if self.subject is not None:
            return self.subject
        assert self.pattern is not None
        levels = ["*" if level == "+" else "**" if level == "#" else level for level in self.pattern]
        return "/" + "/".join(levels)

    def parent(self) -> str | None:
        """For a filter ending in ``#``: the level it also matches (``a/b`` of ``a/b/#``), if a valid subject."""
        if self.pattern is None or self.pattern[-1] != "#" or "+" in self.pattern:
            return None
        subject = "/" + "/".join(self.pattern[:-1])
        try:
            return check_subject(subject)
        except InvalidSubject:
            return None

    def children_only(self) -> Filter:
        """The same filter with its last ``#`` matching one or more levels, not zero."""
        assert self.pattern is not None
        return Filter(None, (*self.pattern[:-1], "**"))


def parse_filter(topic_filter: str) -> Filter:
    """Check a filter as MQTT does (``#`` last and alone in its level, ``+`` alone) and map it."""
    if topic_filter.startswith("$share/"):
        raise TopicError("shared subscriptions ($share/...) are not supported")
    if topic_filter.startswith("$"):
        raise TopicError(
            f"topics beginning with $ are the server's and it publishes none ({topic_filter!r}); "
            "its statistics are under migratory/stats/"
        )
    levels = topic_filter.split("/")
    wild = False
    for index, level in enumerate(levels):
        if level == "#":
            if index != len(levels) - 1:
                raise TopicError(f"filter {topic_filter!r}: # must be the last level")
            wild = True
        elif level == "+":
            wild = True
        elif "#" in level or "+" in level:
            raise TopicError(f"filter {topic_filter!r}: a wildcard must be a whole level")
        elif level == "":
            raise TopicError(f"filter {topic_filter!r}: level {index + 1} is empty (subjects have no empty level)")
    if not wild:
        return Filter(topic_to_subject(topic_filter), None)
    return Filter(None, tuple(levels))


def pattern_matches(pattern: Pattern, levels: list[str]) -> bool:
    """Whether a subject's levels (without the leading empty one) match ``pattern``."""
    if levels and levels[0].startswith("$") and pattern[0] in ("+", "#", "**"):
        return False
    for index, want in enumerate(pattern):
        if want == "#":
            return len(levels) >= index
        if want == "**":
            return len(levels) > index
        if index >= len(levels) or (want != "+" and want != levels[index]):
            return False
    return len(levels) == len(pattern)
