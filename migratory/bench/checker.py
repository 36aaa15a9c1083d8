"""Histories of what subscribers received, and the checker that judges them.

A recorder subscribes with the client library and keeps, per subject, every message
the application saw (type, epoch, seq, content) and every NOTIFY. Publishers publish
contents of the form ``<publisher>#<n>`` and record the status of each. The checker
then proves, per subscriber and subject:

- **no duplicate**: no content delivered twice (snapshots excluded: a resync snapshot
  legitimately repeats the latest value);
- **order**: seq increases, and each publisher's ``n`` increases;
- **nothing acknowledged lost** (Guaranteed mode, and Standard mode for the faults that
  lose nothing there, ``lossless``): every publication answered OK after the subscriber
  subscribed reached it, unless the subscriber was told NOTIFY_DATA_RESYNC for that
  subject (which Guaranteed runs count as a failure too). Standard mode may lose what a
  crashed coordinator numbered but had not sent, and one side's history of a partition
  (docs/cluster.md): a subscriber whose own history has no gap is then not told;
- **no silent gap**: a seq that skips ahead is preceded by NOTIFY_DATA_RESYNC;
- **numbered once** (across all histories): one content, one position ``(epoch, seq)``.

A history that breaks a rule is written to a JSON file and the violations returned.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from migratory.client import ClientMessage, EventKind, MigratoryClient, StatusEvent

__all__ = ["History", "Recorder", "check", "content_of"]


def content_of(publisher: str, n: int) -> bytes:
    return f"{publisher}#{n}".encode()


def _parse(content: bytes) -> tuple[str, int] | None:
    publisher, sep, n = content.decode("utf-8", "replace").rpartition("#")
    return (publisher, int(n)) if sep and n.isdigit() else None


@dataclass
class History:
    """What one subscriber's application saw."""

    name: str
    messages: dict[str, list[tuple[str, int, int, bytes, float]]] = field(default_factory=dict)
    notices: list[tuple[str, str, float]] = field(default_factory=list)
    subscribed_at: float = 0.0

    def record(self, message: ClientMessage) -> None:
        self.messages.setdefault(message.subject, []).append(
            (message.type.name, message.epoch, message.seq, message.content, time.monotonic())
        )

    def notice(self, event: StatusEvent) -> None:
        self.notices.append((event.kind.value, event.subject or event.detail, time.monotonic()))

    def contents(self, subject: str, *, updates_only: bool = True) -> list[bytes]:
        return [c for kind, _, _, c, _ in self.messages.get(subject, []) if not updates_only or kind != "SNAPSHOT"]

    def resynced(self, subject: str) -> bool:
        return any(kind == EventKind.NOTIFY_DATA_RESYNC.value and what == subject for kind, what, _ in self.notices)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "notices": self.notices,
            "messages": {
                s: [(k, e, q, c.decode("utf-8", "replace"), t) for k, e, q, c, t in items]
                for s, items in self.messages.items()
            },
        }


class Recorder:
    """A client that records everything it is given into a :class:`History`."""

    def __init__(self, name: str, servers: list[str | tuple[str, float]], **kwargs: Any) -> None:
        self.history = History(name)
        self.client = MigratoryClient(
            servers, on_message=self.history.record, on_status=self._status, backoff_initial=0.05, **kwargs
        )
        self.server_changes: list[tuple[str, str, float]] = []

    def _status(self, event: StatusEvent) -> None:
        if event.kind in (EventKind.NOTIFY_SERVER_UP, EventKind.NOTIFY_SERVER_DOWN):
            self.server_changes.append((event.kind.value, event.detail, time.monotonic()))
        if event.kind in (
            EventKind.NOTIFY_DATA_SYNC,
            EventKind.NOTIFY_DATA_RESYNC,
            EventKind.NOTIFY_SERVER_UP,
            EventKind.NOTIFY_SERVER_DOWN,
        ):
            self.history.notice(event)

    async def start(self, subjects: list[str]) -> None:
        await self.client.connect()
        await self.client.subscribe(subjects)
        self.history.subscribed_at = time.monotonic()  # what is published from now on must reach it

    async def close(self) -> None:
        await self.client.close()


def check(
    histories: Iterable[History],
    acked: dict[str, list[tuple[bytes, float]]] | None = None,  # subject -> [(content, time it was sent)]
    *,
    guaranteed: bool = False,
    lossless: bool | None = None,
    keep: Path | None = None,
) -> list[str]:
    """Judge every history against the acknowledged publications (sent at the times given).

    ``lossless`` (default: ``guaranteed``) checks that nothing acknowledged was lost unless resynced.
    """
    lossless = guaranteed if lossless is None else lossless
    violations: list[str] = []
    bad: list[History] = []
    histories = list(histories)
    for history in histories:
        found = _check_one(history, acked or {}, guaranteed, lossless)
        if found:
            bad.append(history)
            violations.extend(f"{history.name}: {v}" for v in found)
    violations.extend(_numbered_twice(histories))
    if bad and keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        keep.write_text(json.dumps({"violations": violations, "histories": [h.as_json() for h in bad]}, indent=1))
    return violations


def _check_one(
    history: History, acked: dict[str, list[tuple[bytes, float]]], guaranteed: bool, lossless: bool
) -> list[str]:
    out: list[str] = []
    for subject, items in history.messages.items():
        updates = [(kind, seq, content) for kind, _, seq, content, _ in items if kind != "SNAPSHOT"]
        contents = [content for _, _, content in updates]
        duplicates = {c for c in contents if contents.count(c) > 1}
        if duplicates:
            out.append(f"{subject}: delivered twice: {sorted(d.decode(errors='replace') for d in duplicates)[:5]}")
        seqs = [seq for kind, _, seq, _, _ in items if kind != "SNAPSHOT"]
        if any(b <= a for a, b in itertools.pairwise(seqs)):
            out.append(f"{subject}: seq not increasing: {seqs[:50]}")
        timed = [(seq, t) for kind, _, seq, _, t in items if kind != "SNAPSHOT"]
        resyncs = [
            t for kind, what, t in history.notices if kind == EventKind.NOTIFY_DATA_RESYNC.value and what == subject
        ]
        for (a, ta), (b, tb) in itertools.pairwise(timed):
            if b > a + 1 and not any(ta <= t <= tb for t in resyncs):
                out.append(f"{subject}: silent gap: seq {a} then {b} with no NOTIFY_DATA_RESYNC between")
                break
        last: dict[str, int] = {}
        for content in contents:
            parsed = _parse(content)
            if parsed is None:
                continue
            publisher, n = parsed
            if n <= last.get(publisher, -1):
                out.append(f"{subject}: {publisher}'s #{n} after #{last[publisher]}")
                break
            last[publisher] = n
        if guaranteed and history.resynced(subject):
            first = min(
                t for kind, what, t in history.notices if kind == EventKind.NOTIFY_DATA_RESYNC.value and what == subject
            )
            away = any(kind == EventKind.NOTIFY_SERVER_DOWN.value and t <= first for kind, _, t in history.notices)
            out.append(
                f"{subject}: resynchronised (NOTIFY_DATA_RESYNC) instead of recovered"
                + ("" if away else ", by a member it never disconnected from")
            )
    for subject, published in acked.items() if lossless else ():
        got = set(history.contents(subject, updates_only=False))
        lost = [c for c, when in published if when >= history.subscribed_at and c not in got]
        if lost and not history.resynced(subject):
            out.append(f"{subject}: {len(lost)} acknowledged message(s) lost: {[c.decode() for c in lost[:5]]}")
    return out


def _numbered_twice(histories: list[History]) -> list[str]:
    """One publication at two positions (a retried publish id numbered again): no per-client check sees it."""
    positions: dict[tuple[str, bytes], set[tuple[int, int]]] = {}
    for history in histories:
        for subject, items in history.messages.items():
            for kind, epoch, seq, content, _ in items:
                if kind != "SNAPSHOT" and _parse(content) is not None:
                    positions.setdefault((subject, content), set()).add((epoch, seq))
    return [
        f"{subject}: {content.decode(errors='replace')} numbered twice: {sorted(at)}"
        for (subject, content), at in positions.items()
        if len(at) > 1
    ][:20]
