"""Parsing of --since/--until: ISO 8601 dates or times, UTC unless an offset is given."""

from __future__ import annotations

from datetime import UTC, datetime

__all__ = ["parse_time"]


def parse_time(text: str) -> datetime:
    """``2026-11-22``, ``2026-11-22T15:04``, ``2026-11-22 15:04:05Z`` or with an offset -> aware UTC datetime."""
    raw = text.strip()
    if raw.endswith(("Z", "z")):
        raw = raw[:-1] + "+00:00"
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        raise ValueError(
            f"{text!r} is not an ISO 8601 date or time (e.g. 2026-11-22 or 2026-11-22T15:04:05Z)"
        ) from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC)
