"""Give the member agent precedence over the workers for the CPU.

Every worker of a clustered node depends on its member agent: publications are numbered
through it, subscriber counts reach the other members through it, and its heartbeats keep
the member links up. On a saturated host the kernel shares the cores evenly among runnable
processes, so with 50 busy workers the agent gets a fiftieth of a core and falls seconds
behind while clients subscribe en masse; its peers then hear no heartbeat and drop the
link. Twenty nice levels below the workers (nice -20 from 0), the agent weighs as much as
about 87 of them (the kernel's weights grow 1.25x a level), which only matters when the cores
are saturated: an idle agent takes nothing from anyone. Ten levels (nine workers' weight) held
the links while a million clients subscribed, but not while they all disconnected at once,
with about 110 processes runnable (bench/million.md).

Lowering a nice value needs CAP_SYS_NICE or an RLIMIT_NICE that allows it (systemd:
``LimitNICE=``; the package's unit sets it). Without either the agent runs at the
workers' priority and says so once.
"""

from __future__ import annotations

import logging
import os

__all__ = ["AGENT_PRECEDENCE", "precede"]

log = logging.getLogger("migratory.server")

AGENT_PRECEDENCE = 20  # nice levels below the rest of the server (clamped at -20)


def precede(name: str, levels: int = AGENT_PRECEDENCE) -> int | None:
    """Lower this process's nice value by ``levels`` (not under -20); return the new value, None if refused."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    wanted = max(-20, current - levels)
    if wanted == current:
        return current
    try:
        os.setpriority(os.PRIO_PROCESS, 0, wanted)
    except OSError as exc:  # EACCES/EPERM: neither CAP_SYS_NICE nor RLIMIT_NICE allows it
        log.info(
            "%s runs at the workers' priority (nice %d), not ahead of them: %s; grant CAP_SYS_NICE or "
            "raise RLIMIT_NICE (systemd: LimitNICE=%d) to let it keep its cluster links on a saturated host",
            name,
            current,
            exc.strerror or exc,
            wanted,
        )
        return None
    log.info("%s runs at nice %d, %d levels ahead of the workers", name, wanted, current - wanted)
    return wanted
