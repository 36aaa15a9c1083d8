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
"""

from __future__ import annotations

import gc

__all__ = ["before_fork", "serving"]


def before_fork() -> None:
    """In the supervisor, just before ``os.fork()``: the child inherits a heap its collector leaves alone."""
    gc.collect(1)  # the young garbage first (cheap): frozen, it would never be freed
    gc.freeze()


def serving() -> None:
    """In a worker or the agent, once its start-up is done: what start-up made is never traversed again."""
    gc.collect()  # start-up's own garbage goes first, so that freezing keeps only what lives on
    gc.freeze()
