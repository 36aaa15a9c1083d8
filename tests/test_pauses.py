"""A process that stops running says so in its log: event-loop stalls and long garbage collections."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Iterator

import pytest

from migratory.server.node import pauses


@pytest.fixture(autouse=True)
def _gc_callbacks() -> Iterator[None]:
    """watch() adds a garbage-collector callback for the life of the process; a test's ends with it."""
    callbacks = list(gc.callbacks)
    yield
    gc.callbacks[:] = callbacks


def test_a_stalled_loop_and_a_long_collection_are_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pauses, "LONG_GC", 0.0)  # every collection counts as long here

    async def scenario() -> None:
        pauses.watch(asyncio.get_running_loop(), "worker 3")
        await asyncio.sleep(0.1)
        time.sleep(pauses.CHECK_EVERY + pauses.STALL + 0.3)  # the loop cannot run its timer meanwhile
        await asyncio.sleep(0.1)
        gc.collect()

    with caplog.at_level(logging.WARNING, logger="migratory.server"):
        asyncio.run(scenario())
    messages = [r.getMessage() for r in caplog.records]
    stalls = [
        m
        for m in messages
        if m.startswith("worker 3: event loop stalled for ")
        and float(m.split(" for ")[1].split(" s")[0]) >= pauses.STALL
    ]
    assert len(stalls) == 1 and stalls[0].endswith("on the CPU (waiting for a core, or blocked)"), messages
    assert any(m.startswith("worker 3: garbage collection of generation 2 held the process") for m in messages)


def test_a_stall_on_the_cpu_is_told_from_a_process_that_waited(caplog: pytest.LogCaptureFixture) -> None:
    """A long task burns the CPU through the stall; a process starved of cores (or blocked) does not."""

    async def scenario() -> None:
        pauses.watch(asyncio.get_running_loop(), "member agent")
        await asyncio.sleep(0.1)
        end = time.perf_counter() + pauses.CHECK_EVERY + pauses.STALL + 0.3
        while time.perf_counter() < end:  # a long task: busy, the loop cannot turn
            pass
        await asyncio.sleep(0.1)

    with caplog.at_level(logging.WARNING, logger="migratory.server"):
        asyncio.run(scenario())
    stalls = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stalls) == 1 and stalls[0].endswith("on the CPU (a long task)"), stalls


def test_a_loop_that_keeps_up_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        pauses.watch(asyncio.get_running_loop(), "member agent")
        for _ in range(15):
            await asyncio.sleep(0.1)

    with caplog.at_level(logging.WARNING, logger="migratory.server"):
        asyncio.run(scenario())
    assert not [r for r in caplog.records if "stalled" in r.getMessage()]
