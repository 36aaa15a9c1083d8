"""The member agent: one process per cluster member that speaks for it to the other members.

The supervisor forks it beside the workers when ``ClusterMembers`` is set. It is the
hub of the node's bus (every worker links to it and to nothing else) and holds the
member's links to the other members' agents (migratory/server/cluster/links.py). All its
decisions are made by the sans-I/O :class:`~migratory.member.Member`; this module
only moves frames and time to it and from it, and, in Guaranteed mode, runs the seed
members' consensus (migratory/server/cluster/consensus.py) on a seed.

Workers learn from it whether the member is ready (``ClusterInfo``) and its view of
the cluster, which they serve on ``/health`` and the monitor's ``/cluster``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from migratory import bus as b
from migratory.config import Config, DeliveryMode
from migratory.member import Member, MemberSettings
from migratory.server.cluster.links import MemberLinks
from migratory.server.node import heap
from migratory.server.node.bus import Bus
from migratory.server.node.counters import SharedCounters

__all__ = ["serve_agent"]

log = logging.getLogger("migratory.cluster")

INFO_INTERVAL = 1.0
UNHEALTHY_WARNING = 30.0  # s a member may stay unready (joining, linking, no quorum) before it says so


def _floor_path(config: Config) -> Path:
    return Path(config.state_folder) / "member-epoch"


def _read_floor(config: Config) -> int:
    """The highest epoch this member has seen, persisted so that a restart never reissues one."""
    try:
        return int(_floor_path(config).read_text().strip() or "0")
    except (OSError, ValueError):
        return 0


def _write_floor(config: Config, value: int) -> None:
    path = _floor_path(config)
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{value}\n")
        os.replace(tmp, path)
    except OSError as exc:
        log.error("cannot record the member's epoch in %s: %s", path, exc)


class _Wire:
    """The member's outputs, onto the worker bus and the member links."""

    def __init__(self, bus: Bus, links: MemberLinks) -> None:
        self.bus = bus
        self.links = links

    def to_peer(self, member: int, frame: b.BusFrame) -> None:
        self.links.send(member, frame)

    def stream_to_peer(self, member: int, frames: Iterator[b.BusFrame]) -> None:
        self.links.send_stream(member, frames)

    def to_workers(self, frame: b.BusFrame) -> None:
        self.bus.broadcast(frame)

    def to_worker(self, worker: int, frame: b.BusFrame) -> None:
        if worker in self.bus.peers:
            self.bus.send(worker, frame)

    def stream_to_worker(self, worker: int, frames: Iterator[b.BusFrame]) -> None:
        if worker in self.bus.peers:
            self.bus.send_stream(worker, map(b.encode, frames))

    def stream_to_workers(self, workers: Iterable[int], frames: Iterator[b.BusFrame]) -> None:
        self.bus.send_stream_to(workers, map(b.encode, frames))

    def drop_peer(self, member: int, reason: str) -> None:
        self.links.drop(member, reason)


class _Watch:
    """Logs what an operator must know, once and as what it is: a Raft election (INFO), a quorum lost for longer
    than an election takes (WARNING) and regained, and a node that stays unready."""

    def __init__(self, now: float) -> None:
        self.quorum: bool | None = None
        self.lost_at: float | None = None  # when the quorum went (an election, or a lost majority: not told yet)
        self.warned_lost = False
        self.ready: bool | None = None
        self.healthy: tuple[bool, str] = (False, "starting")
        self.since = now
        self.warned = -1e9

    def _quorum(self, machine: Member, now: float) -> None:
        """An election ends within an eighth to a quarter of the heartbeat timeout (consensus.py): a quorum back
        within the timeout was one, and is logged so; only a quorum gone for longer is a lost majority."""
        quorum = machine.quorum
        if quorum != self.quorum:
            if not quorum and self.quorum is not None:  # not at start, before the first leader
                self.lost_at = now
            elif self.quorum is not None or self.lost_at is not None:
                if self.warned_lost:
                    log.info("member %d: quorum regained (leader: %s)", machine.me, machine.leader_index())
                elif self.lost_at is not None:
                    log.info(
                        "member %d: Raft election: member %s leads (term %d), after %.1f s without a leader",
                        machine.me,
                        machine.leader_index(),
                        machine.term,
                        now - self.lost_at,
                    )
                self.lost_at = None
                self.warned_lost = False
            self.quorum = quorum
        if self.lost_at is not None and not self.warned_lost and now - self.lost_at >= machine.s.heartbeat_timeout:
            self.warned_lost = True
            log.warning(
                "member %d: quorum lost: no leader with a majority of the seed members for %.1f s "
                "(Guaranteed publications are refused)",
                machine.me,
                now - self.lost_at,
            )

    def step(self, machine: Member, now: float) -> bool:
        """True when the node's readiness or health changed since the last step."""
        if machine.s.guaranteed:
            self._quorum(machine, now)
        ready = machine.readiness()[0]
        healthy = machine.health()
        changed = healthy != self.healthy or ready != self.ready
        self.ready = ready
        if healthy[0] != self.healthy[0]:
            self.since = now
            if healthy[0]:
                log.info("member %d healthy: /health answers 200", machine.me)
        self.healthy = healthy
        if not healthy[0] and now - self.since >= UNHEALTHY_WARNING and now - self.warned >= 60.0:
            self.warned = now
            log.warning(
                "member %d not ready for %.0f s: %s (/health answers 503)", machine.me, now - self.since, healthy[1]
            )
        return changed


async def serve_agent(
    config: Config,
    stop: asyncio.Event,
    *,
    workers: int,
    namespace: str,
    secret: bytes,
    epoch: int,
    counters: SharedCounters | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Run the member agent until ``stop`` is set."""
    loop = asyncio.get_running_loop()
    guaranteed = config.cluster_delivery_mode is DeliveryMode.GUARANTEED
    size = len(config.cluster_members)
    floor = max(epoch * size, _read_floor(config))
    incarnation = secrets.randbits(62)  # this agent process: a restart is admitted anew, never taken for the last
    settings = MemberSettings(
        index=config.member_index,
        incarnation=incarnation,
        size=size,
        guaranteed=guaranteed,
        seeds=config.seed_count,
        cache_size=config.max_cached_messages_per_subject,
        cache_ttl=float(config.cache_expire_time),
        heartbeat_interval=config.cluster_heartbeat_interval / 1000.0,
        heartbeat_timeout=config.cluster_heartbeat_timeout / 1000.0,
        epoch_floor=floor,
    )
    holder: dict[str, Member] = {}

    def member() -> Member:
        return holder["m"]

    bus = Bus(
        workers,
        range(workers),
        namespace,
        secret,
        on_frame=lambda frame, worker: worker_frame(worker, frame),
        on_link_up=lambda worker: member().worker_up(worker),
        on_link_down=lambda worker: member().worker_down(worker),
        batching=config.bus_batching_time / 1000.0,
    )
    links = MemberLinks(
        config,
        incarnation,
        on_up=lambda j, incarnation: member().peer_up(j, incarnation, loop.time()),
        on_down=lambda j: member().peer_down(j, loop.time()),
        on_frame=lambda j, frame: member().on_peer_frame(j, frame, loop.time()),
    )
    machine = holder["m"] = Member(settings, _Wire(bus, links), loop.time())
    flush_armed = False

    def flush_interest() -> None:
        nonlocal flush_armed
        flush_armed = False
        member().flush_interest()

    def worker_frame(worker: int, frame: b.BusFrame) -> None:
        """Subscriber counts reach the other members once per loop turn, however many changed in it."""
        nonlocal flush_armed
        member().on_worker_frame(worker, frame, loop.time())
        if not flush_armed and member().interest_pending:
            flush_armed = True
            loop.call_soon(flush_interest)

    def status() -> Mapping[str, Any]:
        totals = counters.totals() if counters is not None else {}
        return {
            "clients": totals.get("connections", 0),
            "subjects": machine.replica.subject_count(),
            "snapshots": len(machine.replica),
            "groups": len(machine.coordinated()),
            "ready": machine.ready,
            # the node's seven indicators now: every member's dashboard shows the whole cluster
            "indicators": {k: round(v, 1) for k, v in counters.stats.current().items()} if counters is not None else {},
        }

    machine.status = status

    def links_problem() -> str:
        unlinked = [w for w in range(workers) if not bus.linked(w)]
        return ("worker(s) " + ", ".join(map(str, unlinked)) + " not linked to the member agent") if unlinked else ""

    machine.links_problem = links_problem
    consensus = None
    if guaranteed and config.member_index < config.seed_count:
        from migratory.server.cluster.consensus import SeedConsensus

        consensus = SeedConsensus(config)
    await bus.start()
    await links.start(sock)
    heap.serving()
    log.info(
        "member %d of %d (%s, %s delivery) started; looking for the other members",
        config.member_index,
        size,
        config.cluster_member_listen,
        config.cluster_delivery_mode.value,
    )
    tick = min(0.1, settings.heartbeat_interval / 2)
    last_info = 0.0
    was_ready = False
    watch = _Watch(loop.time())
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), tick)
            now = loop.time()
            if consensus is not None:
                consensus.step(machine, now)
            machine.tick(now)
            top = max(machine.epochs)
            if top > floor:
                floor = top
                _write_floor(config, top)
            if machine.ready != was_ready:
                was_ready = machine.ready
                log.info("member %d %s", config.member_index, "ready" if was_ready else "synchronising")
            if watch.step(machine, now):
                last_info = 0.0  # the node's readiness changed: tell the workers now
            if now - last_info >= INFO_INTERVAL:
                last_info = now
                bus.broadcast(machine.info())
    finally:
        if stop.is_set():  # a planned stop (SIGTERM, after the workers drained): the peers log it as one
            await links.announce_leaving(config.member_index, "stopping (SIGTERM)")
        if consensus is not None:
            consensus.close()
        await links.close()
        await bus.close()
        log.info("member agent stopped")
