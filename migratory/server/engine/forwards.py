"""Publications waiting for their coordinator's answer, and the publishers held meanwhile.

A publication numbered elsewhere (another worker of the node, or in a cluster the member
agent) leaves a reply here until a ``ForwardStatus`` comes back. Backpressure lives beside it:
a publisher is not read while it has :data:`MAX_INFLIGHT_PER_CONNECTION` publications
unanswered, or while this worker waits for :data:`WORKER_FORWARD_BUDGET` answers; TCP then
slows it down, and nothing is answered FAILED for being many.
"""

from __future__ import annotations

from typing import Any

from migratory.protocol import Status
from migratory.server.engine.types import Publisher, PublishResult, Reply

__all__ = [
    "FORWARD_GIVE_UP",
    "FORWARD_TIMEOUT",
    "MAX_INFLIGHT_PER_CONNECTION",
    "WORKER_FORWARD_BUDGET",
    "Forwards",
]

FORWARD_TIMEOUT = 8.0  # the member agent answers within 6 s, the client library waits 10 s
FORWARD_GIVE_UP = 30.0  # s a live agent's late answer is waited for (it answers within 6 s of reading)
MAX_INFLIGHT_PER_CONNECTION = 256  # publications one connection may have unanswered before it is not read
WORKER_FORWARD_BUDGET = 2000  # publications unanswered by coordinators, per worker, before publishers are held


class Forwards:
    """Replies by request number, with their deadlines; publishers' in-flight counts and holds."""

    __slots__ = ("_next", "held", "inflight", "waiting")

    def __init__(self) -> None:
        self.waiting: dict[int, tuple[Reply, float, float]] = {}  # request -> reply, deadline, give up at
        self.inflight: dict[Publisher, int] = {}
        self.held: dict[Publisher, list[Any]] = {}  # publishers not read, with what they sent that waits
        self._next = 0

    def next_id(self) -> int:
        """A number unique in this process (requests, and the tail of server-given publish ids)."""
        self._next += 1
        return self._next

    def add(self, request: int, reply: Reply, now: float) -> None:
        self.waiting[request] = (reply, now + FORWARD_TIMEOUT, now + FORWARD_GIVE_UP)

    def answer(self, request: int, result: PublishResult) -> None:
        waiting = self.waiting.pop(request, None)
        if waiting is not None:
            waiting[0](result)

    def fail_all(self, reason: str) -> None:
        """The coordinator behind every forward is gone: its publishers hear it now and retry."""
        waiting, self.waiting = self.waiting, {}
        for reply, _, _ in waiting.values():
            reply(PublishResult(Status.FAILED, reason))

    def expire(self, now: float, coordinator_alive: bool) -> None:
        """Fail what waited past its deadline, unless a live coordinator may still answer it."""
        for request, (reply, deadline, give_up) in list(self.waiting.items()):
            if deadline <= now:
                if coordinator_alive and now < give_up:
                    # a live agent answers everything it read, within 6 s of reading it: a late answer is
                    # queueing between us, and failing it would report FAILED for what gets numbered
                    self.waiting[request] = (reply, now + FORWARD_TIMEOUT, give_up)
                    continue
                del self.waiting[request]
                reply(PublishResult(Status.FAILED, "no answer from the coordinator"))

    def started(self, publisher: Publisher) -> None:
        """A client's publication enters: past its connection's or this worker's budget, stop reading it."""
        count = self.inflight[publisher] = self.inflight.get(publisher, 0) + 1
        if publisher not in self.held and (
            count >= MAX_INFLIGHT_PER_CONNECTION or len(self.waiting) >= WORKER_FORWARD_BUDGET
        ):
            self.held[publisher] = []
            publisher.hold_input()

    def done(self, publisher: Publisher) -> None:
        """A publication was answered: read the held publishers again once the budgets are half free."""
        count = self.inflight.get(publisher, 0) - 1
        if count > 0:
            self.inflight[publisher] = count
        else:
            self.inflight.pop(publisher, None)
        if self.held and len(self.waiting) <= WORKER_FORWARD_BUDGET // 2:
            for held in [p for p in self.held if self.inflight.get(p, 0) <= MAX_INFLIGHT_PER_CONNECTION // 2]:
                held.release_input(self.held.pop(held))

    def forget(self, publisher: Publisher) -> None:
        self.inflight.pop(publisher, None)
        self.held.pop(publisher, None)
