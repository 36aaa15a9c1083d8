"""Guaranteed mode: the seed members' majority decides the table, through Raft (PySyncObj).

Only what needs agreement goes through consensus: which members are in the cluster
and the epoch (hence the coordinator) of every subject group, as one small
:class:`~migratory.groups.Table`. Messages never do. The seed members (the first 3
or 5 of ``ClusterMembers``) each run one PySyncObj node, embedded in their member
agent, on their cluster port + 1; the Raft leader proposes a new table when the set
of members it sees ready changes, and every seed adopts a table once a majority has
committed it. Non-seed members learn tables from the seeds over the member links.

PySyncObj (https://github.com/bakwc/PySyncObj) is a small, maintained Raft library
used in production (for example by Patroni). It serialises commands with pickle, so
its links are always encrypted and authenticated with ``ClusterPassword`` (its
``password`` option); its journal lives in ``StateFolder`` so a restarted seed
remembers its term and vote, as Raft requires.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pysyncobj import SyncObj, SyncObjConf, replicated  # type: ignore[import-untyped]

from migratory.config import Config
from migratory.groups import GROUPS, Table, assign
from migratory.member import Member

__all__ = ["SeedConsensus", "consensus_address"]

log = logging.getLogger("migratory.cluster")
logging.getLogger("pysyncobj").setLevel(logging.WARNING)


def consensus_address(config: Config, index: int) -> str:
    member = config.cluster_members[index]
    return f"{member.host}:{member.port + 1}"


class _TableStore(SyncObj):  # type: ignore[misc]
    """The replicated state: one table, replaced only by its successor (compare-and-set on version)."""

    def __init__(self, self_address: str, partners: list[str], conf: SyncObjConf) -> None:
        super().__init__(self_address, partners, conf)
        self._table: tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]] = (0, (), (0,) * GROUPS, ())

    @replicated  # type: ignore[untyped-decorator]
    def put(
        self, version: int, members: tuple[int, ...], epochs: tuple[int, ...], admitted: tuple[int, ...] = ()
    ) -> bool:
        if version != self._table[0] + 1:
            return False  # proposed on an outdated table: the leader will propose again
        self._table = (version, tuple(members), tuple(epochs), tuple(admitted))
        return True

    def table(self) -> Table:
        version, members, epochs, admitted = self._table
        return Table(version, members, epochs, admitted)


class SeedConsensus:
    """This seed's Raft node, stepped from the agent's loop."""

    def __init__(self, config: Config) -> None:
        me = config.member_index
        timeout = config.cluster_heartbeat_timeout / 1000.0
        folder = Path(config.state_folder)
        folder.mkdir(parents=True, exist_ok=True)
        election = max(0.3, timeout / 4)
        conf = SyncObjConf(
            password=config.cluster_password,
            autoTick=True,
            appendEntriesPeriod=election / 4,
            raftMinTimeout=election,
            raftMaxTimeout=election * 2,
            connectionTimeout=election * 2,
            connectionRetryTime=0.3,
            leaderFallbackTimeout=max(election, timeout / 2),
            journalFile=str(folder / f"consensus-{me}.journal"),
            fullDumpFile=str(folder / f"consensus-{me}.dump"),
            useFork=False,
            tcp_keepalive=None,
        )
        partners = [consensus_address(config, i) for i in range(config.seed_count) if i != me]
        self.size = len(config.cluster_members)
        self.store = _TableStore(consensus_address(config, me), partners, conf)
        self._proposing = False
        log.info("seed member %d: consensus on %s with %s", me, consensus_address(config, me), ", ".join(partners))

    def step(self, member: Member, now: float) -> None:
        """Bring the member up to date with Raft, and propose a new table when leading."""
        leader = bool(self.store._isLeader())
        quorum = bool(self.store.hasQuorum)
        member.leader = leader
        member.leader_quorum = leader and quorum
        table = self.store.table()
        if table.version > member.table.version:
            member.set_table(table, now)
        if not (leader and quorum) or self._proposing:
            return
        proposal = assign(member.table, member.live_members(), self.size)
        if proposal.version != member.table.version:
            self._proposing = True
            self.store.put(
                proposal.version, proposal.members, proposal.epochs, proposal.admitted, callback=self._proposed
            )

    def _proposed(self, result: Any, error: Any) -> None:
        """Called on PySyncObj's thread; the next step proposes again if this one lost."""
        self._proposing = False

    def close(self) -> None:
        self.store.destroy()
