"""Report when a server process stops running for long: its event loop stalled, or a garbage collection.

A member agent that does not run for three seconds loses its cluster links (the peers stop hearing
its heartbeats), and a worker that does not run delays every delivery it holds. Under a saturated
host either can happen; the log then says which process stalled, for how long, and whether the
garbage collector was the cause, instead of leaving only the consequence (a dropped link).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

__all__ = ["watch"]

log = logging.getLogger("migratory.server")

CHECK_EVERY = 0.5  # seconds between the loop's own timer turns
STALL = 0.5  # a turn this much later than asked is reported (half the maximum latency a run may show)
LONG_GC = 0.25  # a collection that held the process this long is reported


def watch(loop: asyncio.AbstractEventLoop, name: str) -> None:
    """Log (WARNING) each stall of ``loop`` over STALL seconds and each garbage collection over LONG_GC."""
    started: dict[int, float] = {}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        generation = int(info.get("generation", -1))
        if phase == "start":
            started[generation] = time.perf_counter()
            return
        began = started.pop(generation, None)
        if began is not None and time.perf_counter() - began >= LONG_GC:
            log.warning(
                "%s: garbage collection of generation %d held the process for %.2f s (%d objects collected)",
                name,
                generation,
                time.perf_counter() - began,
                int(info.get("collected", 0)),
            )

    gc.callbacks.append(on_gc)
    due = [loop.time() + CHECK_EVERY]
    cpu = [time.process_time()]
    queued = [_run_queue_wait()]

    def check() -> None:
        now, used, waited = loop.time(), time.process_time(), _run_queue_wait()
        late, busy = now - due[0], used - cpu[0]  # busy: this process's CPU since the last check
        if late >= STALL:
            log.warning("%s: event loop stalled for %.1f s, %s", name, late, _account(late, busy, queued[0], waited))
        due[0], cpu[0], queued[0] = now + CHECK_EVERY, used, waited
        loop.call_at(due[0], check)

    loop.call_at(due[0], check)


def _run_queue_wait() -> float | None:
    """Seconds this thread has spent runnable but not running (the kernel's schedstat; None if it has none)."""
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            ran, waited = (int(field) for field in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return waited / 1e9 if ran else None  # a running thread with no time on the CPU: the kernel keeps none


def _account(late: float, busy: float, before: float | None, after: float | None) -> str:
    """Where a stall went: on the CPU (a long task: a collection, a big batch), on the run queue (the cores
    were busy with others: the fix is fewer busy processes or a higher priority), or neither (blocked in
    the kernel: a page fault, a lock, a full pipe). "Waiting for a core, or blocked" could not tell a
    nice -20 agent's starvation from a lock held by a preempted worker. The run-queue time is over the
    interval since the last check, which also holds up to CHECK_EVERY of ordinary waiting."""
    if before is None or after is None:
        cause = "a long task" if busy >= late / 4 else "waiting for a core, or blocked"
        return f"{busy:.1f} s of it on the CPU ({cause})"
    waited = max(0.0, after - before)
    blocked = late + CHECK_EVERY - busy - waited  # both counts cover the whole interval since the last check
    cause = "a long task" if busy >= late / 4 else "waiting for a core" if waited >= blocked else "blocked"
    return f"{busy:.1f} s of it on the CPU, {waited:.1f} s waiting for a core ({cause})"
