"""The faults operators cause every day, after sustained traffic: restarts of a member, a worker, the agent.

Each test first fills the caches (hundreds of messages on many subjects, 2.9 MB in all: well past the
4 KB that a peer may send before it has authenticated, and past what a member link writes in one turn),
then restarts something, then checks what the restarted member can actually do (its subscribers
receive, its publishers are answered, its snapshots are current), not only what its ``/health`` says.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from migratory.bench.cluster import LocalCluster
from migratory.client import MigratoryClient
from migratory.protocol import Status

pytestmark = pytest.mark.slow

SUBJECTS = [f"/traffic/s{i}" for i in range(40)]
PAYLOAD = b"x" * 1200  # 2.9 MB of cache: a member link sends a state over HIGH_WATER in several turns


def run(coro: object, timeout: float = 240) -> object:
    return asyncio.run(asyncio.wait_for(coro, timeout))  # type: ignore[arg-type]


async def _traffic(url: str, rounds: int, guaranteed: bool, tag: str) -> None:
    """``rounds`` messages on every subject (1,200 bytes each: 40 subjects x 60 rounds is 72 KB a subject)."""
    async with MigratoryClient([url]) as publisher:
        for r in range(rounds):
            results = await asyncio.gather(
                *(
                    publisher.publish(s, PAYLOAD + f"{tag}{r}".encode(), guaranteed=guaranteed, retries=3)
                    for s in SUBJECTS
                )
            )
            assert all(st in (Status.OK, Status.NO_SUBSCRIBER) for st in results), results


async def _serves(cluster: LocalCluster, index: int, other: int, guaranteed: bool) -> None:
    """Member ``index`` delivers what is published on ``other`` and has its own publications answered."""
    async with MigratoryClient([cluster[index].ws_url]) as subscriber:
        await subscriber.subscribe(SUBJECTS[:3])
        deadline = time.monotonic() + 10
        async with MigratoryClient([cluster[other].ws_url]) as publisher:
            for n in range(3):
                status = await publisher.publish(SUBJECTS[0], f"after-{n}".encode(), guaranteed=guaranteed)
                if status is Status.OK:
                    break
                assert status is Status.NO_SUBSCRIBER and time.monotonic() < deadline  # interest on its way
                await asyncio.sleep(0.5)
            got = [await subscriber.next_message(10)]
            while got[-1].content != f"after-{n}".encode():
                got.append(await subscriber.next_message(10))
        async with MigratoryClient([cluster[index].ws_url]) as own:
            assert await own.publish(SUBJECTS[1], b"from-restarted", guaranteed=guaranteed) is Status.OK
        while (await subscriber.next_message(10)).content != b"from-restarted":
            pass


def _no_refusals(cluster: LocalCluster, index: int) -> None:
    text = cluster.server_log(index)
    assert "refused a peer" not in text and "bus frame of" not in text, text[-3000:]


def _snapshot_current(cluster: LocalCluster, index: int, tag: str) -> None:
    deadline = time.monotonic() + 10
    while True:
        snapshot = cluster.snapshot(index, SUBJECTS[-1])
        if snapshot is not None and snapshot["content"].endswith(tag):
            return
        assert time.monotonic() < deadline, snapshot
        time.sleep(0.2)


def _agent_apart_where_autogroup(cluster: LocalCluster, index: int, agent: int) -> None:
    """With the kernel's autogroup on (this machine, CI's), the agent has a session, and a group, of its own."""
    from migratory.server.node.priority import AUTOGROUP_SWITCH

    if os.geteuid() != 0 or not AUTOGROUP_SWITCH.exists() or AUTOGROUP_SWITCH.read_text().strip() != "1":
        return  # nothing to check here: the agent stays in the node's session
    proc = cluster[index].proc
    assert proc is not None
    assert os.getsid(agent) == agent != os.getsid(proc.pid)
    nice = os.getpriority(os.PRIO_PROCESS, agent)
    assert nice < 0 and Path(f"/proc/{agent}/autogroup").read_text().rstrip().endswith(f" nice {nice}")


def _state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` ("T" stopped, "Z" a zombie), "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _stopped(pid: int) -> str:
    """``pid``'s state once SIGSTOP took it ("T"), or whatever it is after 5 s."""
    deadline = time.monotonic() + 5
    while (state := _state(pid)) != "T" and time.monotonic() < deadline:
        time.sleep(0.02)  # a signal is delivered when the process next runs
    return state


def _alive(pid: int) -> bool:
    return _state(pid) not in ("", "Z")


def _all_gone(pids: Iterable[int]) -> None:
    """A member's SIGKILL reaches each of its processes, the agent in its own session too."""
    deadline = time.monotonic() + 10
    for pid in pids:
        while _alive(pid):
            assert time.monotonic() < deadline, f"process {pid} outlived its member's SIGKILL"
            time.sleep(0.05)


@pytest.mark.parametrize("mode", ["Guaranteed", "Standard"])
def test_a_member_killed_after_traffic_restarts_linked_to_its_own_workers(tmp_path: Path, mode: str) -> None:
    guaranteed = mode == "Guaranteed"
    with LocalCluster(tmp_path, 3, mode=mode, workers=2) as cluster:
        cluster.start_all()
        run(_traffic(cluster[0].ws_url, 60, guaranteed, "a"))
        processes = cluster.processes(1)
        _agent_apart_where_autogroup(cluster, 1, processes["migratory-agent"])
        cluster.signal(1, signal.SIGSTOP)  # the bench's stop-member: every process, the agent in its session too
        try:
            assert {pid: _stopped(pid) for pid in processes.values()} == dict.fromkeys(processes.values(), "T")
        finally:
            cluster.signal(1, signal.SIGCONT)
        cluster.kill(1)
        _all_gone(processes.values())
        run(_traffic(cluster[0].ws_url, 5, guaranteed, "b"))
        cluster.start(1)
        cluster.wait_ready([1], 30)
        run(_serves(cluster, 1, 2, guaranteed))
        _snapshot_current(cluster, 1, "b4")
        _no_refusals(cluster, 1)


def test_a_worker_and_the_agent_killed_after_traffic_come_back_linked(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, 3, mode="Guaranteed", workers=2) as cluster:
        cluster.start_all()
        run(_traffic(cluster[0].ws_url, 60, True, "a"))
        for name in ("migratory-w0", "migratory-agent"):
            pid = cluster.processes(2)[name]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while cluster.processes(2).get(name) in (None, pid):
                assert time.monotonic() < deadline, f"{name} was not restarted"
                time.sleep(0.1)
            cluster.wait_ready([2], 30)
            run(_serves(cluster, 2, 0, True))
        _no_refusals(cluster, 2)


@pytest.mark.parametrize("mode", ["Standard", "Guaranteed"])
def test_publications_without_an_id_through_two_fresh_members_are_both_published(tmp_path: Path, mode: str) -> None:
    """The server names an id-less publication for in-cluster retries; every fresh member's first HTTP
    session had the same name, so the second member's first publication was taken for a retry of the
    first's: answered OK, never published."""
    import urllib.request

    with LocalCluster(tmp_path, 3, mode=mode) as cluster:
        for index in range(3):
            cluster.start(index)
        for index in range(3):  # through the monitor: the client listeners have served no session yet
            cluster.wait_view(index, {0, 1, 2})
        for index, subject in ((0, "/fresh/a"), (1, "/fresh/b")):
            url = f"{cluster[index].http_url}/publish?subject={subject}"
            with urllib.request.urlopen(urllib.request.Request(url, data=b"v", method="POST"), timeout=10) as answer:
                assert answer.status == 200
        deadline = time.monotonic() + 10
        while not all(cluster.snapshot(2, s) for s in ("/fresh/a", "/fresh/b")):
            assert time.monotonic() < deadline, [cluster.snapshot(2, s) for s in ("/fresh/a", "/fresh/b")]
            time.sleep(0.2)


def test_publications_a_killed_agent_never_answered_fail_at_once(tmp_path: Path) -> None:
    """They waited for the worker's 8 s timer (the fault suite's kill-agent rounds: 8.3 s without an
    acknowledgement); the worker now answers them FAILED as soon as its link to the agent drops."""
    from migratory.client import PublishError

    with LocalCluster(tmp_path, 3, mode="Guaranteed") as cluster:
        cluster.start_all()
        agent = cluster.processes(0)["migratory-agent"]

        async def scenario() -> str:
            async with MigratoryClient([cluster[0].ws_url], request_timeout=20) as publisher:
                os.kill(agent, signal.SIGSTOP)  # it reads nothing more: the publication waits for it
                pending = asyncio.create_task(publisher.publish("/agent/x", b"v", guaranteed=True, raise_on_error=True))
                await asyncio.sleep(0.5)
                os.kill(agent, signal.SIGKILL)
                try:
                    await asyncio.wait_for(pending, 5.0)  # well before the 8 s timer
                except PublishError as exc:
                    return str(exc)
                return "answered OK"

        assert "the member agent restarted" in str(run(scenario()))


def test_a_resumed_member_says_ready_only_when_it_can_serve(tmp_path: Path) -> None:
    """A member SIGSTOPped for less than the workers' 3.5 s trust in their agent's word: after SIGCONT a
    worker answered /health 200 from what the agent said before the pause, while the agent, awake again,
    had no quorum and answered FAILED (the fast fault tier's stop-member round)."""
    from migratory.bench import failover

    with LocalCluster(tmp_path, 3, mode="Guaranteed", heartbeat_interval=200, heartbeat_timeout=1000) as cluster:
        cluster.start_all()
        for index in range(3):
            cluster.wait_view(index, {0, 1, 2})
        probes: list[str] = []
        for _ in range(3):
            cluster.signal(1, signal.SIGSTOP)
            time.sleep(2.5)
            cluster.signal(1, signal.SIGCONT)
            run(failover._probe_when_ready(cluster, 1, "Guaranteed", probes))
            for index in range(3):
                cluster.wait_view(index, {0, 1, 2})
        assert probes == []
