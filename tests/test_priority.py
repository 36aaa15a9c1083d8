"""The member agent's precedence over the workers: taken where allowed, said when refused.

(The package's unit allows it through RLIMIT_NICE, `LimitNICE=-20`; raising that hard limit needs
CAP_SYS_RESOURCE, which this machine's root lacks, so the allowed case is CAP_SYS_NICE here.)
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from migratory.server.node import priority

PR_CAPBSET_DROP = 24  # <linux/prctl.h>
CAP_SYS_NICE = 23  # <linux/capability.h>
PROBE = (
    "import logging, os, sys\n"
    "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
    "from migratory.server.node.priority import precede\n"
    "print('result', precede('member agent'), os.getpriority(os.PRIO_PROCESS, 0))\n"
)

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CAP_SYS_NICE, and CAP_SETPCAP to drop it)")


def _without_cap_sys_nice() -> None:
    """Root without CAP_SYS_NICE (dropped from the bounding set, so the exec'd interpreter lacks it) and
    without an RLIMIT_NICE that allows going below nice 0: what an unprivileged service user is."""
    if resource.getrlimit(resource.RLIMIT_NICE)[1] > 20:
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_SYS_NICE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _probe(preexec: Callable[[], None] | None, code: str = PROBE) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=preexec,
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=True,
    )
    return done.stdout.splitlines()


@as_root
def test_an_agent_allowed_to_runs_twenty_levels_ahead() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the suite may itself run under `nice`
    wanted = max(-20, base - 20)
    lines = _probe(None)
    assert lines[-1] == f"result {wanted} {wanted}", lines
    assert f"member agent runs at nice {wanted}, {base - wanted} levels ahead of the workers" in lines


@as_root
def test_without_the_limit_the_agent_says_it_is_not_ahead_and_keeps_running() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if base <= -20:
        pytest.skip("already at the top priority: nothing to refuse")
    lines = _probe(_without_cap_sys_nice)
    assert lines[-1] == f"result None {base}", lines
    assert any("not ahead of them" in line and f"LimitNICE={max(-20, base - 20)}" in line for line in lines), lines


def test_never_asks_for_more_than_the_kernel_range(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(os, "getpriority", lambda which, who: -15)
    monkeypatch.setattr(os, "setpriority", lambda which, who, value: asked.append(value))
    assert priority.precede("member agent") == -20
    assert asked == [-20]
    monkeypatch.setattr(os, "getpriority", lambda which, who: -20)
    assert priority.precede("member agent") == -20
    assert asked == [-20]  # already at the top: nothing asked


GROUP_PROBE = (
    "import logging, os, sys\n"
    "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
    "from migratory.server.node.priority import own_group, precede\n"
    "parent = os.getsid(0)\n"
    "nice = precede('member agent')\n"
    "print('result', own_group('member agent', nice), os.getsid(0) != parent, os.getpid() == os.getsid(0))\n"
    "print('group', open('/proc/self/autogroup').read().strip())\n"
)


@as_root
def test_where_the_kernel_groups_by_session_the_agent_has_a_group_of_its_own() -> None:
    """Autogroup (on here and in CI): nice values weigh only inside a session's group, so the agent's
    precedence needs a session, and a group at its nice value, of its own."""
    if not priority._autogroup_applies():
        pytest.skip("the kernel's autogroup is off, or this process has a CPU cgroup: the agent keeps its session")
    lines = _probe(None, GROUP_PROBE)
    wanted = max(-20, os.getpriority(os.PRIO_PROCESS, 0) - 20)
    assert "result True True True" in lines, lines
    assert any(line.startswith("group /autogroup-") and line.endswith(f" nice {wanted}") for line in lines), lines
    assert any("scheduling group of its own" in line for line in lines), lines


def test_without_autogroup_nothing_changes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    switch = tmp_path / "sched_autogroup_enabled"
    switch.write_text("0\n")
    monkeypatch.setattr(priority, "AUTOGROUP_SWITCH", switch)
    monkeypatch.setattr(os, "setsid", lambda: pytest.fail("setsid without autogroup"))
    assert priority.own_group("member agent", -20) is False
    monkeypatch.setattr(priority, "AUTOGROUP_SWITCH", tmp_path / "absent")
    assert priority.own_group("member agent", -20) is False
