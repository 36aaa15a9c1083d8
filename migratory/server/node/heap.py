"""The garbage collector around fork: what the supervisor made before forking stays shared.

Workers and the member agent are forked from the supervisor and share its pages copy-on-write.
CPython's collector writes into the header of every object it traverses, so the first full
collection in each child used to copy every page holding the supervisor's objects (modules,
configuration, TLS context): about 1 MB a process at 18,000 clients over 8 workers (bench/million.md;
it does not explain the 1.2 GB a million-connection node gained once traffic started).
``gc.freeze()`` moves every object that exists into a permanent generation the collector never
traverses: done in the supervisor right before each fork, and in each child once it is serving (its
own start-up objects live as long as it does), it keeps those pages shared and every later full
collection shorter (fewer objects to walk). Objects made later are collected as before.

**Full collections are paced** (:func:`pace`). CPython starts one when the objects that
survived into the oldest generation have grown by a quarter; every worker of a node applies the
same publications, so they all cross that line together: at a million clients, 36 of 56 workers
ran one within the same two seconds a minute into publishing, each held 0.3-1.1 s on the shared
cores, and every delivery those workers held waited (bench/million.md). A worker's full collection
itself is short (66,600 tracked objects, 12 ms, at 18,000 connections: two objects a connection);
what hurts is all of them at once. So once serving, a process never starts a full collection by
itself: a timer runs one every :data:`FULL_EVERY` seconds, each process at its own offset, so no
two collect together. The young generations are collected as before; cyclic garbage that reached
the oldest one waits at most one period.
"""

from __future__ import annotations

import asyncio
import gc

__all__ = ["FULL_EVERY", "before_fork", "pace", "serving"]

FULL_EVERY = 60.0  # seconds between one process's paced full collections
_NEVER = 2**30  # gen-1 collections before an automatic full one: none


def before_fork() -> None:
    """In the supervisor, just before ``os.fork()``: the child inherits a heap its collector leaves alone."""
    gc.collect(1)  # the young garbage first (cheap): frozen, it would never be freed
    gc.freeze()


def serving() -> None:
    """In a worker or the agent, once its start-up is done: what start-up made is never traversed again."""
    gc.collect()  # start-up's own garbage goes first, so that freezing keeps only what lives on
    gc.freeze()


def pace(loop: asyncio.AbstractEventLoop, slot: int, slots: int, every: float = FULL_EVERY) -> None:
    """Replace automatic full collections by one every ``every`` seconds, at offset ``slot`` of ``slots``."""
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, _NEVER)
    first = loop.time() + every * (slot + 1) / (slots + 1)

    def collect(due: float) -> None:
        gc.collect()
        later = due + every
        now = loop.time()
        if later <= now:  # the process did not run for a whole period: keep the slot, skip what passed
            later += every * (1 + int((now - later) // every))
        loop.call_at(later, collect, later)

    loop.call_at(first, collect, first)
