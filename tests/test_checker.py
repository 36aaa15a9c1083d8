"""The history checker of the fault suite: each rule catches what it names, and passes a clean history."""

from __future__ import annotations

from migratory.bench.checker import History, check, content_of
from migratory.client import EventKind


def _history(
    name: str, rows: list[tuple[str, int, int, bytes]], notices: tuple[tuple[str, float], ...] = ()
) -> History:
    history = History(name)
    for t, (kind, epoch, seq, content) in enumerate(rows):
        history.messages.setdefault("/s", []).append((kind, epoch, seq, content, float(t)))
    history.notices = [(kind, "/s", t) for kind, t in notices]
    return history


def test_a_clean_history_passes() -> None:
    rows = [("UPDATE", 1, n, content_of("p", n)) for n in range(1, 6)]
    acked = {"/s": [(content_of("p", n), 0.0) for n in range(1, 6)]}
    assert check([_history("a", rows), _history("b", rows)], acked) == []


def test_a_silent_gap_is_a_violation_and_a_told_one_is_not() -> None:
    rows = [("UPDATE", 1, 1, content_of("p", 1)), ("UPDATE", 2, 4, content_of("p", 4))]
    assert any("silent gap" in v for v in check([_history("a", rows)]))
    told = _history("a", [rows[0], ("SNAPSHOT", 2, 3, b"s"), rows[1]], ((EventKind.NOTIFY_DATA_RESYNC.value, 0.5),))
    assert check([told]) == []


def test_one_publication_at_two_positions_is_numbered_twice() -> None:
    """Each subscriber's own history is clean; only side by side do they show the second numbering."""
    first = _history("a", [("UPDATE", 1, 1, content_of("p", 1)), ("UPDATE", 1, 2, content_of("p", 2))])
    second = _history("b", [("UPDATE", 1, 1, content_of("p", 1)), ("UPDATE", 4, 2, content_of("p", 1))])
    assert not check([first])
    violations = check([first, second])
    assert any("numbered twice" in v for v in violations), violations


def test_standard_mode_may_lose_only_what_it_says_it_resynced() -> None:
    rows = [("UPDATE", 1, 1, content_of("p", 1)), ("UPDATE", 1, 2, content_of("p", 3))]
    acked = {"/s": [(content_of("p", n), 0.0) for n in (1, 2, 3)]}
    assert check([_history("a", rows[:1])], acked, guaranteed=False) == []  # a partition's losing side
    assert any("lost" in v for v in check([_history("a", rows)], acked, guaranteed=False, lossless=True))
    told = _history("a", rows, ((EventKind.NOTIFY_DATA_RESYNC.value, 0.5),))
    assert check([told], acked, guaranteed=False, lossless=True) == []
    assert any("resynchronised" in v for v in check([told], acked, guaranteed=True))
