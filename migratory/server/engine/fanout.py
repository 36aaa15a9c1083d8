"""The fan-out: one message encoded once and queued on every local subscriber, written once per
event-loop turn (or per ``BatchingTime``), and the conflated subscribers' per-period aggregates.

A client's ``send`` puts it on :attr:`FanOut.dirty` itself (inlined there: it runs once per
delivery), and :meth:`FanOut.flush_dirty` writes every dirty client with one syscall each at
the end of the turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from migratory.conflation import ConflationBuffer, next_boundary
from migratory.protocol import NotifyCode, encode_delivery, encode_notify
from migratory.replica import Entry
from migratory.server.engine.types import PRIVATE_PREFIX, Client, Stats
from migratory.subscriptions import PatternIndex, SubscriptionIndex
from migratory.websocket import OP_BINARY, build_frame

__all__ = ["FanOut"]


class FanOut:
    """Subscribers by subject, and what is queued for them until the flush."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        stats: Stats,
        snapshot_frame: Callable[[str], bytes | None],
        batching_time: float,
    ) -> None:
        self.loop = loop
        self.stats = stats
        self.snapshot_frame = snapshot_frame
        self.batching_time = batching_time
        self.index: SubscriptionIndex[Client] = SubscriptionIndex()
        self.patterns: PatternIndex[Client] = PatternIndex()  # MQTT wildcard subscriptions
        self.dirty: list[Client] = []  # clients with output pending, written by flush_dirty
        self.armed = False  # flush_dirty is scheduled for the end of this turn
        self._batch_dirty: list[Client] = []
        self._batch_armed = False
        self._conflation: dict[int, ConflationBuffer] = {}
        self._conflation_armed: set[int] = set()
        # runs before any client's output is written: what a reply promises (a subscription's interest, known to
        # the other workers) leaves on the bus first (Engine._flush_interest)
        self.before_flush: Callable[[], None] | None = None

    # --- output scheduling ----------------------------------------------------------

    def mark_batch(self, client: Client) -> None:
        """With BatchingTime: the client's output waits for the shared batching timer."""
        self._batch_dirty.append(client)
        if not self._batch_armed:
            self._batch_armed = True
            self.loop.call_later(self.batching_time, self._flush_batches)

    def flush_dirty(self) -> None:
        self.armed = False
        if self.before_flush is not None:
            self.before_flush()
        dirty, self.dirty = self.dirty, []
        for client in dirty:
            client.flush()

    def _flush_batches(self) -> None:
        self._batch_armed = False
        if self.before_flush is not None:
            self.before_flush()
        batch, self._batch_dirty = self._batch_dirty, []
        for client in batch:
            client.flush()

    # --- delivery ---------------------------------------------------------------------

    def deliver(self, subject: str, entry: Entry, guaranteed: bool) -> tuple[int, int]:
        """Queue one message for every local subscriber; return (recipients, frame size)."""
        index = self.index.get(subject)
        matched = self.patterns.match(subject) if self.patterns and not subject.startswith(PRIVATE_PREFIX) else None
        if index is None and not matched:
            return 0, 0
        recipients = 0
        frame_size = 0
        if (index is not None and index.plain) or matched:
            frame = build_frame(
                OP_BINARY,
                encode_delivery(
                    subject,
                    entry.content,
                    entry.fields,
                    entry.seq,
                    entry.epoch,
                    retained=entry.retained,
                    guaranteed=guaranteed,
                ),
            )
            if index is not None:
                for client in index.plain:
                    client.send(frame)  # kept a method call: the queueing rules live in one place
                recipients = len(index.plain)
                if matched:
                    matched.difference_update(index.plain)  # a client matched twice gets it once
            if matched:
                for client in matched:
                    client.send(frame)
                recipients += len(matched)
            frame_size = len(frame)
            self.stats.bytes_out += recipients * frame_size
        if index is not None:
            for period, members in index.conflated.items():
                buffer = self._conflation.get(period)
                if buffer is None:
                    buffer = self._conflation[period] = ConflationBuffer(period)
                buffer.add(subject, entry.content, entry.fields, entry.seq, entry.epoch, entry.retained)
                if period not in self._conflation_armed:
                    self._arm_conflation(period)
                recipients += len(members)
        self.stats.messages_out += recipients
        return recipients, frame_size

    def resync(self, subject: str) -> None:
        """The subject's history was replaced: its subscribers get the snapshot, flagged as a resync."""
        index = self.index.get(subject)
        matched = self.patterns.match(subject) if self.patterns and not subject.startswith(PRIVATE_PREFIX) else set()
        if index is None and not matched:
            return
        self.stats.resyncs += 1
        snapshot = self.snapshot_frame(subject)
        notify = build_frame(OP_BINARY, encode_notify(NotifyCode.DATA_RESYNC, subject))
        clients = set(matched)
        if index is not None:
            clients.update(index.plain, *index.conflated.values())
        for client in clients:
            if client.version >= 2:
                client.send(notify)
            if snapshot is not None:
                client.send(snapshot)

    # --- conflation -------------------------------------------------------------------

    def _arm_conflation(self, period: int) -> None:
        self._conflation_armed.add(period)
        now_ms = int(time.time() * 1000)
        delay = (next_boundary(now_ms, period) - now_ms) / 1000.0
        self.loop.call_later(delay, self._drain_conflation, period)

    def _drain_conflation(self, period: int) -> None:
        self._conflation_armed.discard(period)
        buffer = self._conflation.get(period)
        if buffer is None:
            return
        for item in buffer.drain():
            entry = self.index.get(item.subject)
            members = entry.conflated.get(period) if entry is not None else None
            if not members:
                continue
            frame = build_frame(
                OP_BINARY,
                encode_delivery(
                    item.subject,
                    item.content,
                    item.fields,
                    item.seq,
                    item.epoch,
                    retained=item.retained,
                ),
            )
            for client in members:
                client.send(frame)
            self.stats.bytes_out += len(frame) * len(members)
