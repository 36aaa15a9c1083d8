"""Guaranteed delivery on real processes: recovery after failover, quorum, and the fault-injection suite.

Each fault of migratory/bench/failover.py runs here a few times on 3 members and once on
5; `migratory bench failover --rounds 50` runs the same rounds many more times.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from migratory.bench import failover
from migratory.bench.cluster import LocalCluster
from migratory.bench.netns import available
from migratory.client import EventKind, MigratoryClient, Publication, StatusEvent
from migratory.config import Config, ConfigError
from migratory.message import MessageType
from migratory.protocol import Status

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("MIGRATORY_FAULT_ROUNDS", "2"))


def run(coro: object, timeout: float = 240) -> object:
    return asyncio.run(asyncio.wait_for(coro, timeout))  # type: ignore[arg-type]


@contextlib.contextmanager
def _guaranteed_three(tmp_path: Path) -> Iterator[LocalCluster]:
    """A 3-member Guaranteed cluster, every member seeing the other two."""
    with LocalCluster(tmp_path, 3, mode="Guaranteed") as cluster:
        cluster.start_all()
        for index in range(3):
            cluster.wait_view(index, {0, 1, 2})
        yield cluster


async def _connected_to(servers: list[str], **options: Any) -> MigratoryClient:
    """A client of the list ``servers`` that drew the first of them (drawn again until it does)."""
    while True:
        client = MigratoryClient(servers, **options)
        await client.connect()
        if client.server == servers[0]:
            return client
        await client.close()


def test_guaranteed_needs_three_members_and_valid_seeds() -> None:
    two = "ClusterMembers = 10.0.0.1:9100, 10.0.0.2:9100\nClusterMemberListen = 10.0.0.1:9100\n"
    with pytest.raises(ConfigError) as info:
        Config.from_text(two + "ClusterPassword = long-enough-pw\nClusterDeliveryMode = Guaranteed\n", "g.conf")
    assert "g.conf:4: ClusterDeliveryMode: Guaranteed needs at least 3 members" in info.value.errors[0]
    four = "ClusterMembers = " + ", ".join(f"10.0.0.{i}:9100" for i in range(1, 5)) + "\n"
    base = (
        four
        + "ClusterMemberListen = 10.0.0.1:9100\nClusterPassword = long-enough-pw\nClusterDeliveryMode = Guaranteed\n"
    )
    with pytest.raises(ConfigError) as info:
        Config.from_text(base + "ClusterSeedMemberCount = 5\n", "s.conf")
    assert "ClusterSeedMemberCount: 5 seed members but ClusterMembers lists 4" in info.value.errors[0]
    assert Config.from_text(base, "ok.conf").seed_count == 3
    twelve = "ClusterMembers = " + ", ".join(f"10.0.0.{i}:9100" for i in range(1, 13)) + "\n"
    config = Config.from_text(twelve + base.split("\n", 1)[1], "12.conf")
    assert config.seed_count == 5


def test_a_subscriber_cut_off_gets_exactly_the_missed_messages(tmp_path: Path) -> None:
    """The issue's example: cut off while m2 and m3 are published, it gets m2 and m3, then m4 live."""
    with _guaranteed_three(tmp_path) as cluster:

        async def scenario() -> None:
            events: list[StatusEvent] = []
            # start on member 3, the one we cut
            servers = [cluster[2].ws_url, cluster[1].ws_url]
            subscriber = await _connected_to(servers, on_status=events.append, backoff_initial=1.5)
            await subscriber.subscribe(["/Stocks/IBM"])
            async with MigratoryClient([cluster[0].ws_url]) as publisher:
                assert await publisher.publish("/Stocks/IBM", b"m1", guaranteed=True) is Status.OK
                assert (await subscriber.next_message(10)).content == b"m1"
                await asyncio.get_running_loop().run_in_executor(None, cluster.kill, 2)
                for content in (b"m2", b"m3"):  # while the subscriber reconnects: maybe no subscriber anywhere
                    status = await publisher.publish("/Stocks/IBM", content, guaranteed=True, retries=5)
                    assert status in (Status.OK, Status.NO_SUBSCRIBER)
                got = [await subscriber.next_message(15) for _ in range(2)]
                assert [(m.content, m.type) for m in got] == [(b"m2", MessageType.RECOVERED)] * 1 + [
                    (b"m3", MessageType.RECOVERED)
                ]
                assert subscriber.server == cluster[1].ws_url
                # delivered either way; the count can lag: member 1 tells 0 of its new subscriber on its next tick
                # a loaded machine may still be moving member 3's groups: FAILED is retryable (by publish id)
                status = await publisher.publish("/Stocks/IBM", b"m4", guaranteed=True, retries=5)
                assert status in (Status.OK, Status.NO_SUBSCRIBER)
                m4 = await subscriber.next_message(10)
                assert (m4.content, m4.type) == (b"m4", MessageType.UPDATE)
            kinds = [e.kind for e in events]
            assert EventKind.NOTIFY_DATA_SYNC in kinds and EventKind.NOTIFY_DATA_RESYNC not in kinds
            assert [e.subject for e in events if e.kind is EventKind.NOTIFY_DATA_SYNC] == ["/Stocks/IBM"]
            await subscriber.close()

        run(scenario())


def test_a_retried_publish_id_is_numbered_once(tmp_path: Path) -> None:
    with _guaranteed_three(tmp_path) as cluster:

        async def scenario() -> None:
            async with MigratoryClient([cluster[1].ws_url]) as subscriber:
                await subscriber.subscribe(["/s/once"])
                for via in (0, 1, 2, 0):  # the same publication, sent four times through three members
                    async with MigratoryClient([cluster[via].ws_url]) as publisher:
                        status = await publisher.publish("/s/once", b"x", guaranteed=True, publish_id="order-42")
                        assert status is Status.OK, via
                async with MigratoryClient([cluster[2].ws_url]) as publisher:
                    assert await publisher.publish("/s/once", b"y", guaranteed=True) is Status.OK
                first, second = await subscriber.next_message(10), await subscriber.next_message(10)
                assert [(first.content, first.seq), (second.content, second.seq)] == [(b"x", 1), (b"y", 2)]

        run(scenario())


def test_a_pipelined_publisher_through_its_members_death_loses_and_doubles_nothing(tmp_path: Path) -> None:
    """publish_all with a window of 32 on the member that is SIGKILLed mid-stream: the FAILED ones go again,
    same publish id, through the next member; every acknowledged one reaches the subscriber exactly once."""
    subjects = [f"/pipe/s{i}" for i in range(40)]
    total = 3000
    with _guaranteed_three(tmp_path) as cluster:

        async def scenario() -> None:
            async with MigratoryClient([cluster[2].ws_url]) as subscriber:
                assert set((await subscriber.subscribe(subjects)).values()) == {Status.OK}
                # start on member 0, the one killed
                publisher = await _connected_to([cluster[0].ws_url, cluster[1].ws_url], backoff_initial=0.2)
                loop = asyncio.get_running_loop()

                def items() -> Iterator[Publication]:
                    for i in range(total):
                        if i == total // 3:
                            loop.run_in_executor(None, cluster.kill, 0)
                        yield Publication(subjects[i % len(subjects)], str(i), guaranteed=True)

                results = [r async for r in publisher.publish_all(items(), window=32, rate=1000, retries=10)]
                await publisher.close()
                acked = {int(r.publication.content) for r in results if r.ok}
                assert len(results) == total
                assert any(r.attempts > 1 for r in results)  # the kill did cut publications in flight
                assert len(acked) >= total - 5, sorted(set(range(total)) - acked)[:20]
                got: list[int] = []
                seen: dict[str, int] = {}
                deadline = loop.time() + 60
                while not acked <= set(got) and loop.time() < deadline:
                    message = await subscriber.next_message(30)
                    assert message.seq > seen.get(message.subject, 0)
                    seen[message.subject] = message.seq
                    got.append(int(message.content))
                assert acked <= set(got), sorted(acked - set(got))[:20]
                assert len(got) == len(set(got)), "a publication delivered twice"

        run(scenario(), 300)


def test_without_a_seed_majority_guaranteed_publishes_fail_cleanly(tmp_path: Path) -> None:
    with _guaranteed_three(tmp_path) as cluster:

        async def scenario() -> None:
            async with MigratoryClient([cluster[0].ws_url]) as publisher:
                assert await publisher.publish("/s/q", b"kept", guaranteed=True) is Status.NO_SUBSCRIBER
            loop = asyncio.get_running_loop()
            statuses: list[tuple[Status | None, str]] = []
            p = MigratoryClient(
                [cluster[0].ws_url], on_status=lambda e: statuses.append((e.status, e.detail)), reconnect=False
            )
            await p.connect()
            await loop.run_in_executor(None, cluster.kill, 1)
            await loop.run_in_executor(None, cluster.kill, 2)
            await asyncio.sleep(2.5)  # the lone seed's leader lease runs out
            started = time.monotonic()
            assert await p.publish("/s/q", b"refused", guaranteed=True) is Status.FAILED
            assert time.monotonic() - started < 8  # an answer, not silence
            # then it sends its clients away (close 1013: it is cut off from the seeds' majority) and refuses
            # new ones with a 503 that says why, until a majority is back (issue 48)
            deadline = time.monotonic() + 10
            while p.connected and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert not p.connected
            await p.close()
            assert any(reason and ("quorum" in reason or "1013" in reason) for _, reason in statuses), statuses
            with pytest.raises(ConnectionError, match="503"):
                async with MigratoryClient([cluster[0].ws_url], reconnect=False):
                    pass
            for index in (1, 2):
                await loop.run_in_executor(None, cluster.start, index)
            await loop.run_in_executor(None, cluster.wait_ready, [1, 2], 60.0)
            for index in range(3):
                await loop.run_in_executor(None, cluster.wait_view, index, {0, 1, 2}, 60.0)
            for index in range(3):  # the acknowledged message was never lost; the refused one never appears
                snapshot = await loop.run_in_executor(None, cluster.snapshot, index, "/s/q")
                assert snapshot is not None and snapshot["content"] == "kept" and snapshot["seq"] == 1

        run(scenario(), timeout=200)


@pytest.mark.parametrize(("seeds", "down_seeds", "down_others"), [(5, 2, 7), (3, 1, 9)])
def test_twelve_members_tolerate_the_seed_table(tmp_path: Path, seeds: int, down_seeds: int, down_others: int) -> None:
    """The seed's worked example: 12 members with 5 seeds tolerate 9 down; with 3 seeds, 10."""
    extra = {"ClusterSeedMemberCount": str(seeds), "MaxCachedMessagesPerSubject": "100"}
    with LocalCluster(
        tmp_path, 12, mode="Guaranteed", heartbeat_interval=300, heartbeat_timeout=1500, extra=extra
    ) as cluster:
        cluster.start_all(ready_timeout=120)
        for index in range(12):
            cluster.wait_view(index, set(range(12)), timeout=120)
        victims = list(range(seeds - down_seeds, seeds)) + list(range(12 - down_others, 12))
        survivors = [i for i in range(12) if i not in victims]

        async def scenario() -> None:
            loop = asyncio.get_running_loop()
            subjects = [f"/twelve/s{i}" for i in range(10)]
            async with MigratoryClient([cluster[survivors[-1]].ws_url]) as publisher:
                for subject in subjects:
                    assert await publisher.publish(subject, b"before", guaranteed=True) is Status.NO_SUBSCRIBER
            for index in victims:
                cluster.signal(index, signal.SIGKILL)
            for index in victims:
                await loop.run_in_executor(None, cluster.kill, index)
            await loop.run_in_executor(None, cluster.wait_view, survivors[0], set(survivors), 60.0)
            async with MigratoryClient([cluster[i].ws_url for i in survivors]) as publisher:
                for subject in subjects:
                    status = await publisher.publish(subject, b"after", guaranteed=True, retries=10)
                    assert status is Status.NO_SUBSCRIBER
            for index in survivors:
                snapshots = [await loop.run_in_executor(None, cluster.snapshot, index, s) for s in subjects]
                assert all(s is not None and s["content"] == "after" and s["seq"] == 2 for s in snapshots)
            # one more seed down: the majority is gone; the members left refuse guaranteed publications, then
            # (cut off from the seeds' majority) send their clients away and refuse new ones with a 503 (issue 48)
            async with MigratoryClient([cluster[survivors[-1]].ws_url], reconnect=False) as publisher:
                await loop.run_in_executor(None, cluster.kill, 0)
                await asyncio.sleep(1.6)  # the lone seeds' leader lease runs out (heartbeat timeout 1.5 s)
                assert await publisher.publish(subjects[0], b"refused", guaranteed=True) is Status.FAILED
            deadline = time.monotonic() + 20
            while True:
                try:
                    async with MigratoryClient([cluster[survivors[-1]].ws_url], reconnect=False):
                        pass
                except ConnectionError as refused:
                    assert "503" in str(refused)
                    break
                assert time.monotonic() < deadline, "a member without a seed majority still takes clients"
                await asyncio.sleep(0.2)

        run(scenario(), timeout=240)


# the fast tier: 1 s heartbeat timeout, a fresh cluster; the faults of everyday operation run below on the defaults
EVERYDAY = ("kill-worker", "kill-leader", "stop-leader", "rolling-restart", "kill-rejoined")
# the faults that found issue 48 (a cut-off leader, long pauses, a fault while another member rejoins): below
ISOLATING = ("partition-leader", "partition-follower", "pause-long", "pause-during-rejoin", "partition-during-rejoin")
FAULTS = [f for f in failover.FAULTS if (f not in failover.PARTITIONS or available()) and f not in EVERYDAY + ISOLATING]


@pytest.mark.parametrize("round_", range(ROUNDS))
@pytest.mark.parametrize("fault", FAULTS)
def test_fault_injection_three_members(tmp_path: Path, fault: str, round_: int) -> None:
    result = run(failover.run_round(tmp_path, fault, size=3, seed=round_), timeout=280)
    assert isinstance(result, failover.RoundResult)
    assert result.ok, f"{result.violations[:10]} (history kept in {result.history})"
    assert result.acked > 50 and result.gaps


@pytest.mark.parametrize("fault", [f for f in ISOLATING if f not in failover.PARTITIONS or available()])
def test_a_cut_off_or_hung_member_sends_its_clients_to_the_majority(tmp_path: Path, fault: str) -> None:
    """Guaranteed, on the default member configuration after traffic: a member cut off from the seeds'
    majority sends its clients away (close 1013), and the clients of a hung one (SIGSTOP, agent included,
    for three heartbeat timeouts) hear nothing of its keep-alive and leave; either way each of them is
    served by another member before the fault ends, loses nothing and is never resynced (issue 48)."""
    result = run(
        failover.run_round(tmp_path, fault, size=3, seed=5, prefill=(50, 20), **failover.DEFAULTS),
        timeout=280,
    )
    assert isinstance(result, failover.RoundResult)
    assert result.ok, f"{result.violations[:10]} (history kept in {result.history})"
    assert result.acked > 50 and result.victim_clients
    assert result.victim_moved == result.victim_clients, (
        f"{result.victim_clients - result.victim_moved} of the faulted member's {result.victim_clients} clients "
        f"waited out the fault (longest unserved: {max(result.victim_gaps, default=0):.1f} s)"
    )


@pytest.mark.parametrize(
    "fault", ["kill-coordinator", "lose-seed-majority"] + (["partition-member"] if available() else [])
)
def test_fault_injection_five_members(tmp_path: Path, fault: str) -> None:
    result = run(failover.run_round(tmp_path, fault, size=5, seed=7), timeout=280)
    assert isinstance(result, failover.RoundResult)
    assert result.ok, f"{result.violations[:10]} (history kept in {result.history})"


@pytest.mark.parametrize(
    ("mode", "fault"),
    [
        ("Guaranteed", "kill-member"),
        ("Guaranteed", "kill-worker"),
        ("Guaranteed", "kill-leader"),
        ("Guaranteed", "rolling-restart"),
        ("Standard", "kill-member"),
        ("Standard", "kill-rejoined"),
    ],
)
def test_everyday_faults_after_traffic_on_the_default_configuration(tmp_path: Path, mode: str, fault: str) -> None:
    """The operator's faults on the default member configuration (3 s heartbeat timeout, two workers), after
    sustained traffic: 100 subjects whose caches hold 40 messages of 120 bytes (the 4 KB a peer may send
    before authenticating, passed), and /health checked against what each restarted member can do.
    `migratory bench failover --defaults --prefill 200x60` runs every kind many times (bench/failover.md)."""
    result = run(
        failover.run_round(tmp_path, fault, size=3, mode=mode, seed=11, prefill=(100, 40), **failover.DEFAULTS),
        timeout=280,
    )
    assert isinstance(result, failover.RoundResult)
    assert result.ok, f"{result.violations[:10]} (history kept in {result.history})"
    assert result.acked > 50 and result.gaps and result.ack_gaps


@pytest.mark.skipif(not available(), reason="needs root, iproute2 and nftables")
def test_two_harnesses_side_by_side_never_share_a_subnet() -> None:
    """Round 403: two fault loops' namespaces on one /24 sent one harness's clients to the other's cluster
    (both bridges carried 10.203.x.1/24). Two instances whose tags start at the same /24 get two."""
    from migratory.bench.netns import Namespaces

    first = Namespaces(1, tag="1")
    try:
        second = Namespaces(1, tag="251")  # the same starting /24 as "1"
        try:
            assert first.net != second.net
            assert first.hosts[0] != second.hosts[0]
        finally:
            second.close()
    finally:
        first.close()
