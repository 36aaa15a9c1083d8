"""Paced full collections (migratory/server/node/heap.py): none starts by itself, one a period at the slot's offset."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest

from migratory.server.node import heap


@pytest.fixture
def thresholds() -> Iterator[None]:
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def _full_collections(seconds: float, slot: int, slots: int, every: float) -> list[float]:
    """The times (from pace) at which full collections started while a loop ran for ``seconds``."""
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and info.get("generation") == 2:
            started.append(time.monotonic())

    async def main() -> float:
        heap.pace(asyncio.get_running_loop(), slot, slots, every)
        t0 = time.monotonic()
        end = t0 + seconds
        while time.monotonic() < end:
            _ = [[i] for i in range(2000)]  # young garbage: young collections, never a full one by itself
            await asyncio.sleep(0.01)
        return t0

    gc.callbacks.append(on_gc)
    try:
        t0 = asyncio.run(main())
    finally:
        gc.callbacks.remove(on_gc)
    return [t - t0 for t in started]


def test_no_full_collection_starts_by_itself_and_the_timer_runs_one_a_period(thresholds: None) -> None:
    times = _full_collections(2.6, slot=1, slots=3, every=1.0)
    assert gc.get_threshold()[2] >= 2**30
    # slot 1 of 3 first collects at half a period, then once a period: about 0.5, 1.5, 2.5 s
    assert len(times) == 3, times
    assert all(abs(at - want) < 0.3 for at, want in zip(times, (0.5, 1.5, 2.5), strict=True)), times


def test_different_slots_never_collect_together(thresholds: None) -> None:
    first = _full_collections(1.0, slot=0, slots=4, every=1.0)
    last = _full_collections(1.0, slot=3, slots=4, every=1.0)
    assert len(first) == 1 and len(last) == 1, (first, last)
    assert abs(first[0] - 0.2) < 0.15 and abs(last[0] - 0.8) < 0.15, (first, last)
