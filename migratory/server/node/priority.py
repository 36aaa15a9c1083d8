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

On a kernel that groups processes by session for the scheduler (``autogroup``: on when the process
is in the root CPU cgroup, as outside systemd), nice values weigh only inside their session's group,
and the groups share the cores evenly: a node started from a shell, or by `migratory bench`, beside a
session of load generators got half the cores for all its processes, and its agent a third of a core
when it needed a whole one (0.9 s of work took 2.5 s, and the peers dropped its links; bench/million.md).
So the agent also leaves the node's session for one of its own and gives that group its nice value
(:func:`own_group`). A process in a CPU cgroup of its own (a systemd service with CPU accounting, a
container) is not grouped by session, and the agent then stays in the node's session.

Lowering a nice value needs CAP_SYS_NICE or an RLIMIT_NICE that allows it (systemd:
``LimitNICE=``; the package's unit sets it). Without either the agent runs at the
workers' priority and says so once.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

__all__ = ["AGENT_PRECEDENCE", "own_group", "precede"]

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


AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")
AUTOGROUP_TRIES = 5  # the kernel takes one autogroup nice change per 100 ms from a process without CAP_SYS_ADMIN


def _autogroup_applies() -> bool:
    """Whether the kernel schedules this process by session group: autogroup on, and the process in the
    root CPU cgroup (a CPU cgroup of its own, as systemd's services and containers have, bypasses it)."""
    try:
        if AUTOGROUP_SWITCH.read_text().strip() != "1":
            return False
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):  # cgroup v1
            return path == "/"
    for line in lines:
        if line.startswith("0::"):  # cgroup v2: a CPU group below the root needs the root to hand it on
            if line[3:] == "/":
                return True
            try:
                return "cpu" not in Path("/sys/fs/cgroup/cgroup.subtree_control").read_text().split()
            except OSError:
                return True
    return True


def own_group(name: str, nice: int) -> bool:
    """Where the kernel groups by session, put this process in a session (and so a group) of its own
    weighing ``nice``; True when done. Its process group changes with it: whoever signals the node's
    process group signals this process apart (migratory/bench/cluster.py does; the supervisor signals
    its children by pid, and the agent ends when the supervisor dies)."""
    if not _autogroup_applies():
        return False
    try:
        os.setsid()
    except OSError as exc:
        log.info("%s shares the node's scheduling group: %s", name, exc.strerror or exc)
        return False
    for attempt in range(AUTOGROUP_TRIES):
        try:
            Path("/proc/self/autogroup").write_text(f"{nice}\n")
            break
        except OSError as exc:
            if exc.errno == errno.EAGAIN and attempt + 1 < AUTOGROUP_TRIES:
                time.sleep(0.15)  # another process changed a group's nice in the last 100 ms
                continue
            log.warning(
                "%s has a session of its own, but its scheduling group stays at nice 0: %s",
                name,
                exc.strerror or exc,
            )
            return False
    log.info("%s has a scheduling group of its own at nice %d (the kernel's autogroup is on)", name, nice)
    return True
