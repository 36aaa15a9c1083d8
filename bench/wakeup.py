"""What one wake-up of a sleeping process costs on this machine (bench/million.md, "Where the CPU went").

At a million clients each receiving a message a minute, a worker or load generator wakes for a
few messages at a time; the cost of the wake-up itself then decides the CPU. This measures the
CPU of a loop that only sleeps and wakes, at a given rate: an event loop (uvloop, as the server
and the load generators run) and a bare ``time.sleep``.

    .venv/bin/python bench/wakeup.py            # 133 and 1,000 wake-ups a second, 5 s each
"""

from __future__ import annotations

import asyncio
import resource
import sys
import time

import uvloop


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


async def _event_loop(rate: float, seconds: float) -> tuple[int, float, float]:
    user0, sys0 = _cpu()
    started = time.monotonic()
    wakes = 0
    while time.monotonic() - started < seconds:
        await asyncio.sleep(1 / rate)
        wakes += 1
    user1, sys1 = _cpu()
    return wakes, user1 - user0, sys1 - sys0


def _sleep_loop(rate: float, seconds: float) -> tuple[int, float, float]:
    user0, sys0 = _cpu()
    started = time.monotonic()
    wakes = 0
    while time.monotonic() - started < seconds:
        time.sleep(1 / rate)
        wakes += 1
    user1, sys1 = _cpu()
    return wakes, user1 - user0, sys1 - sys0


def main(rates: list[float], seconds: float = 5.0) -> None:
    for rate in rates:
        for name, (wakes, user, system) in (
            ("uvloop", uvloop.run(_event_loop(rate, seconds))),
            ("time.sleep", _sleep_loop(rate, seconds)),
        ):
            print(
                f"{name:>10} at {rate:6.0f}/s: {wakes} wake-ups, {(user + system) / wakes * 1e6:6.1f} us of CPU each "
                f"({user / wakes * 1e6:.1f} user, {system / wakes * 1e6:.1f} system)"
            )


if __name__ == "__main__":
    main([float(arg) for arg in sys.argv[1:]] or [133.0, 1000.0])
