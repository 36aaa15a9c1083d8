"""MQTT topic names and filters as subjects and subject patterns (docs/mqtt.md, "Mapping").

Every MQTT topic has a subject, and back, so native and MQTT clients reach the same data:

- a topic of two or more non-empty levels whose first level is not ``~`` is the subject of the same
  levels: ``a/b/c`` is ``/a/b/c``, as it always was;
- any other topic (one level, an empty level, a leading or trailing ``/``, a first level ``~``) is
  the *escaped* subject: ``/~`` and then every level with a ``~`` in front, so none is empty:
  ``TopicA`` is ``/~/~TopicA``, ``/TopicA`` is ``/~/~/~TopicA``, ``a//b`` is ``/~/~a/~/~b``.

Only the canonical escaped form is a valid subject (migratory/subjects.py), so no two subjects name
one topic. Topics beginning with ``$`` map as any other (``$app/x`` is ``/$app/x``), as Mosquitto's do;
``$SYS/...`` is the server's statistics (subject ``/$SYS/...``), which clients read and never write; ``+``
or ``#`` in the first level never match a ``$`` topic, nor the server's own subjects under
``/migratory/`` (statistics, MQTT session records).

A filter with wildcards becomes a pattern of topic levels, matched against a subject's topic levels
(:func:`subject_matches`): ``+`` matches one level (an empty one too), a last ``#`` zero or more
(``a/#`` matches ``a``, as MQTT says), and a last ``**`` one or more (what a ``#`` becomes when the
client may read below a level but not the level itself). The entitlement sees a pattern in its own
syntax (``*`` and ``**``), in both subject forms (:meth:`Filter.entitlement_subjects`); a pattern
entitled in one form only carries a first element that keeps it to that form.
"""

from __future__ import annotations

from migratory.subjects import ESCAPE, RESERVED_PREFIX, InvalidSubject, check_subject

__all__ = [
    "Filter",
    "Pattern",
    "TopicError",
    "is_sys",
    "parse_filter",
    "parse_shared",
    "pattern_matches",
    "subject_matches",
    "subject_to_topic",
    "topic_levels",
    "topic_to_subject",
]

Pattern = tuple[str, ...]

SYS = "$SYS/"
"""The server's statistics as MQTT topics (``$SYS/broker/...``): clients subscribe, never publish."""

PLAIN_ONLY = "\x01"
"""A pattern's first element when it may match plain subjects only (its escaped form is not entitled)."""
ESCAPED_ONLY = "\x02"
"""A pattern's first element when it may match escaped subjects only."""


class TopicError(ValueError):
    """A topic or filter the server refuses; ``reason`` is client-facing."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _escaped(levels: list[str]) -> str:
    return "/" + ESCAPE + "".join("/" + ESCAPE + level for level in levels)


def _is_plain(levels: list[str]) -> bool:
    return len(levels) >= 2 and levels[0] != ESCAPE and "" not in levels


def topic_to_subject(topic: str) -> str:
    """The subject of a PUBLISH topic name, or :class:`TopicError`."""
    if "+" in topic or "#" in topic:
        raise TopicError(f"topic name {topic!r} contains a wildcard (+ or #)")
    if is_sys(topic):
        raise TopicError(f"$SYS topics are the server's statistics: read-only ({topic!r})")
    return _subject(topic)


def is_sys(topic: str) -> bool:
    """Whether an MQTT topic is the server's statistics (``$SYS`` and below)."""
    return topic == "$SYS" or topic.startswith(SYS)


def _subject(topic: str) -> str:
    if not topic:
        raise TopicError("the topic name is empty")
    levels = topic.split("/")
    subject = "/" + topic if _is_plain(levels) else _escaped(levels)
    try:
        return check_subject(subject)
    except InvalidSubject as exc:
        raise TopicError(f"topic {topic!r} maps to an invalid subject: {exc.reason}") from None


def topic_levels(subject: str) -> list[str]:
    """The MQTT topic levels of a valid subject (the escaped form decoded)."""
    levels = subject[1:].split("/")
    if levels[0] == ESCAPE:
        return [level[1:] for level in levels[1:]]
    return levels


def subject_to_topic(subject: str) -> str:
    """The MQTT topic name of a valid subject: the inverse of :func:`topic_to_subject`."""
    if subject.startswith("/" + ESCAPE + "/"):
        return "/".join(topic_levels(subject))
    return subject[1:]


def pattern_matches(pattern: Pattern, levels: list[str]) -> bool:
    """Whether a topic's levels match ``pattern`` (a first-level wildcard never matches a ``$`` topic)."""
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


def subject_matches(pattern: Pattern, subject: str, levels: list[str] | None = None) -> bool:
    """Whether ``subject`` is one the MQTT ``pattern`` delivers: its topic matches, it is in a form the pattern
    is entitled to, and a first-level wildcard never reaches the server's own subjects. ``levels``: the
    subject's :func:`topic_levels`, when a caller tries many patterns on one subject."""
    first = pattern[0]
    if first in (PLAIN_ONLY, ESCAPED_ONLY):
        if subject.startswith("/" + ESCAPE + "/") != (first == ESCAPED_ONLY):
            return False
        pattern = pattern[1:]
        first = pattern[0]
    if first in ("+", "#", "**") and subject.startswith(RESERVED_PREFIX):
        return False
    return pattern_matches(pattern, topic_levels(subject) if levels is None else levels)


def _entitlement_level(level: str) -> str:
    return "*" if level == "+" else "**" if level in ("#", "**") else level


class Filter:
    """A parsed SUBSCRIBE filter: an exact subject, or a pattern, with the text the client wrote and its key
    among the client's subscriptions (the same however the pattern is restricted)."""

    __slots__ = ("key", "pattern", "subject", "text")

    def __init__(self, text: str, subject: str | None, pattern: Pattern | None) -> None:
        self.text = text
        self.subject = subject
        self.pattern = pattern
        # a pattern's name among the client's subscriptions: NUL never occurs in a subject
        self.key = subject if subject is not None else "\x00/" + text

    def _levels(self) -> Pattern:
        assert self.pattern is not None
        return self.pattern[1:] if self.pattern[0] in (PLAIN_ONLY, ESCAPED_ONLY) else self.pattern

    def entitlement_subject(self) -> str:
        """The subject or pattern the entitlement decides on (for a pattern, the first of its forms)."""
        if self.subject is not None:
            return self.subject
        return next(form for form in self.entitlement_subjects() if form is not None)

    def entitlement_subjects(self) -> tuple[str | None, str]:
        """A pattern in the entitlement's syntax as it reads plain subjects (None if it can match none) and
        as it reads escaped ones: ``a/+`` is ``/a/*`` and ``/~/~a/*``."""
        levels = self._levels()
        last = levels[-1]
        literal = [level for level in levels if level not in ("+", "#", "**")]
        # a plain subject has two or more levels, none empty, and a first that is not the escape
        plain_possible = "" not in literal and levels[0] != ESCAPE and (len(levels) >= 2 or last in ("#", "**"))
        plain = "/" + "/".join(map(_entitlement_level, levels)) if plain_possible else None
        escaped = (
            "/"
            + ESCAPE
            + "".join(
                "/" + (_entitlement_level(level) if level in ("+", "#", "**") else ESCAPE + level) for level in levels
            )
        )
        return plain, escaped

    def restricted(self, plain: bool) -> Filter:
        """The same filter kept to plain subjects (``plain``) or to escaped ones."""
        return Filter(self.text, None, (PLAIN_ONLY if plain else ESCAPED_ONLY, *self._levels()))

    def parent(self) -> str | None:
        """For a filter ending in ``#``: the subject of the level it also matches (``a/b`` of ``a/b/#``)."""
        levels = self._levels() if self.pattern is not None else ()
        if not levels or levels[-1] != "#" or "+" in levels or len(levels) < 2:
            return None
        try:
            return topic_to_subject("/".join(levels[:-1]))
        except TopicError:
            return None

    def children_only(self) -> Filter:
        """The same filter with its last ``#`` matching one or more levels, not zero."""
        assert self.pattern is not None
        return Filter(self.text, None, (*self.pattern[:-1], "**"))


SHARE = "$share/"


def parse_shared(topic_filter: str) -> Filter:
    """``$share/{group}/{filter}`` (MQTT 5 4.8.2): the filter, its text the whole, keyed among the client's
    subscriptions by it (led by \x01: neither a subject nor a pattern's key)."""
    group, sep, inner = topic_filter[len(SHARE) :].partition("/")
    if not group or not sep or "+" in group or "#" in group:
        raise TopicError(f"shared subscription {topic_filter!r}: $share/ needs a group name, then / and a filter")
    filt = parse_filter(inner)
    shared = Filter(topic_filter, filt.subject, filt.pattern)
    shared.key = "\x01" + topic_filter
    return shared


def parse_filter(topic_filter: str) -> Filter:
    """Check a filter as MQTT does (non-empty, ``#`` last and alone in its level, ``+`` alone) and map it."""
    if topic_filter.startswith(SHARE):
        raise TopicError("a shared subscription ($share/...) is subscribed on its own (parse_shared)")
    if not topic_filter:
        raise TopicError("the topic filter is empty")
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
    if not wild:
        return Filter(topic_filter, _subject(topic_filter), None)
    return Filter(topic_filter, None, tuple(levels))
