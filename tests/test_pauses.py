"""A process that stops running says so in its log: event-loop stalls and long garbage collections."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
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
    collections = [float(m.split(" for ")[1].split(" s")[0]) for m in messages if "garbage collection" in m]
    # asleep in the kernel, neither running nor runnable: blocked, unless a saturated machine kept it waiting
    # for a core about as long once it woke (the run queue's share is the kernel's count); on such a machine
    # the test's own full collection (a pytest process late in the suite) can hold the loop too, and is told
    assert len(stalls) == 1 or (len(stalls) == 2 and max(collections, default=0.0) >= pauses.STALL), messages
    waited = float(stalls[0].rsplit(" s waiting for a core", 1)[0].rsplit(", ", 1)[1])
    assert stalls[0].endswith(" (blocked)") or waited >= 0.5, messages
    assert any(m.startswith("worker 3: garbage collection of generation 2 held the process") for m in messages)


def test_a_stall_on_the_cpu_is_told_from_a_process_that_waited(caplog: pytest.LogCaptureFixture) -> None:
    """A long task burns the CPU through the stall, and the line says how much; the cause follows the
    kernel's numbers (on a loaded machine part of a busy stall is spent waiting for a core)."""
    burn = pauses.CHECK_EVERY + pauses.STALL + 0.3

    async def scenario() -> None:
        pauses.watch(asyncio.get_running_loop(), "member agent")
        await asyncio.sleep(0.1)
        end = time.process_time() + burn
        while time.process_time() < end:  # a long task: busy, the loop cannot turn
            pass
        await asyncio.sleep(0.1)

    with caplog.at_level(logging.WARNING, logger="migratory.server"):
        asyncio.run(scenario())
    stalls = [r.getMessage() for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stalls) == 1, stalls
    found = re.search(
        r"stalled for ([\d.]+) s, ([\d.]+) s of it on the CPU, ([\d.]+) s waiting for a core \((.*)\)$", stalls[0]
    )
    assert found is not None, stalls
    late, busy = float(found[1]), float(found[2])
    assert busy >= burn - 0.15  # the CPU it burned, as the kernel counted it
    if busy >= late / 4:  # an idle machine: always; a saturated one may give the loop less than a quarter
        assert found[4] == "a long task", stalls


def test_a_loop_that_keeps_up_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        pauses.watch(asyncio.get_running_loop(), "member agent")
        for _ in range(15):
            await asyncio.sleep(0.1)

    with caplog.at_level(logging.WARNING, logger="migratory.server"):
        asyncio.run(scenario())
    assert not [r for r in caplog.records if "stalled" in r.getMessage()]


def test_the_stall_is_split_into_cpu_run_queue_and_blocked() -> None:
    """The cause follows the kernel's accounts: mostly on the run queue is starvation, mostly neither is a
    block; without the kernel's schedstat the old, undivided wording stays."""
    assert pauses._account(2.7, 0.2, 10.0, 12.3).endswith(
        "0.2 s of it on the CPU, 2.3 s waiting for a core (waiting for a core)"
    )
    assert pauses._account(2.7, 0.2, 10.0, 10.4).endswith("0.4 s waiting for a core (blocked)")
    assert pauses._account(2.7, 0.9, 10.0, 11.5).endswith("(a long task)")
    assert pauses._account(2.7, 0.2, None, None) == "0.2 s of it on the CPU (waiting for a core, or blocked)"
    waited = pauses._run_queue_wait()
    assert waited is not None and waited >= 0.0  # Linux with schedstat, as every machine this runs on


def test_the_bench_reads_every_wording_of_a_stall() -> None:
    """The report's pause table reads the three causes and the older wordings alike."""
    from migratory.bench.clusterbench import _PAUSE

    line = "member agent: event loop stalled for 2.7 s, 0.7 s of it on the CPU, 1.8 s waiting for a core (a long task)"
    found = _PAUSE.match(line)
    assert found is not None and (found["late"], found["busy"], found["queued"], found["cause"]) == (
        "2.7",
        "0.7",
        "1.8",
        "a long task",
    )
    old = _PAUSE.match(
        "worker 3: event loop stalled for 2.0 s, 0.0 s of it on the CPU (waiting for a core, or blocked)"
    )
    assert old is not None and old["queued"] is None and old["cause"] == "waiting for a core, or blocked"
