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

    def check() -> None:
        now, used = loop.time(), time.process_time()
        late, busy = now - due[0], used - cpu[0]  # busy: this process's CPU since the last check
        if late >= STALL:
            # the CPU it had says which: a long task runs even on shared cores, a starved process waits
            cause = "a long task" if busy >= late / 4 else "waiting for a core, or blocked"
            log.warning("%s: event loop stalled for %.1f s, %.1f s of it on the CPU (%s)", name, late, busy, cause)
        due[0], cpu[0] = now + CHECK_EVERY, used
        loop.call_at(due[0], check)

    loop.call_at(due[0], check)
