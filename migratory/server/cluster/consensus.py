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

The Raft listener binds the seed's own ``ClusterMemberListen`` address (PySyncObj's
``bindAddress``), never every interface: with PySyncObj's default, 0.0.0.0, seeds that
share one port on several addresses of a host could not all bind it, and PySyncObj
retries a failed bind silently forever. So the port is tried first, and a seed that
cannot have it stops with one error naming the address and the cause.
"""

from __future__ import annotations

import errno
import logging
import socket
from pathlib import Path
from typing import Any

from pysyncobj import SyncObj, SyncObjConf, SyncObjException, replicated  # type: ignore[import-untyped]

from migratory.config import Config, Endpoint
from migratory.groups import GROUPS, Table, assign
from migratory.member import Member

__all__ = ["ConsensusBindError", "SeedConsensus", "consensus_address", "consensus_bind_address"]

log = logging.getLogger("migratory.cluster")
logging.getLogger("pysyncobj").setLevel(logging.WARNING)


def consensus_address(config: Config, index: int) -> str:
    """Where the other seeds dial seed ``index``'s Raft node (its node id too): cluster address, port + 1."""
    member = config.cluster_members[index]
    return f"{member.host}:{member.port + 1}"


class ConsensusBindError(OSError):
    """This seed cannot listen on its consensus port: it would never take part in Raft, so it must not start."""

    def __str__(self) -> str:
        return str(self.strerror)


def consensus_bind_address(config: Config) -> tuple[str, int]:
    """The (IP, port) this seed's Raft node listens on: ClusterMemberListen's address, port + 1.

    Resolved here, preferring IPv4 as PySyncObj does, so that the probe and PySyncObj bind the same address.
    """
    listen = config.cluster_member_listen
    if listen is None:
        raise ValueError("a seed member needs ClusterMemberListen")
    port = listen.port + 1
    try:
        infos = socket.getaddrinfo(listen.host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise _bind_error(
            listen.host, port, exc.errno or errno.EADDRNOTAVAIL, f"does not resolve ({exc.strerror})"
        ) from None
    ipv4 = [info for info in infos if info[0] == socket.AF_INET]
    return str((ipv4 or infos)[0][4][0]), port


def _bind_error(host: str, port: int, code: int, cause: str) -> ConsensusBindError:
    where = Endpoint(host, port)
    return ConsensusBindError(
        code, f"cannot listen on {where} for the seed members' consensus (ClusterMemberListen's port + 1): {cause}"
    )


def _bind_problem(host: str, port: int) -> OSError | None:
    """Bind and listen as PySyncObj does (SO_REUSEADDR), then release; the error when that fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1)
    except OSError as exc:
        return exc
    return None


class _TableStore(SyncObj):  # type: ignore[misc]
    """The replicated state: one table, replaced only by its successor (compare-and-set on version)."""

    def __init__(self, self_address: str, partners: list[str], conf: SyncObjConf) -> None:
        super().__init__(self_address, partners, conf)
        self._table: tuple[Any, ...] = (0, (), (0,) * GROUPS, (), ())  # Table's fields, as pickled in the dump

    @replicated  # type: ignore[untyped-decorator]
    def put(
        self,
        version: int,
        members: tuple[int, ...],
        epochs: tuple[int, ...],
        admitted: tuple[int, ...] = (),
        incarnations: tuple[int, ...] = (),
    ) -> bool:
        if version != self._table[0] + 1:
            return False  # proposed on an outdated table: the leader will propose again
        self._table = (version, tuple(members), tuple(epochs), tuple(admitted), tuple(incarnations))
        return True

    def table(self) -> Table:
        """The committed table (a journal or dump written before incarnations were recorded has four fields)."""
        version, members, epochs, admitted, *rest = self._table
        incarnations = rest[0] if rest else ()
        return Table(version, members, epochs, admitted, incarnations)


class SeedConsensus:
    """This seed's Raft node, stepped from the agent's loop."""

    def __init__(self, config: Config) -> None:
        me = self.me = config.member_index
        timeout = config.cluster_heartbeat_timeout / 1000.0
        folder = Path(config.state_folder)
        folder.mkdir(parents=True, exist_ok=True)
        election = max(0.25, timeout / 8)
        host, port = consensus_bind_address(config)
        problem = _bind_problem(host, port)
        if problem is not None:  # PySyncObj would retry it silently forever
            raise _bind_error(host, port, problem.errno or errno.EADDRINUSE, problem.strerror or str(problem))
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
            bindAddress=f"{host}:{port}",  # this member's address only, not 0.0.0.0 (every interface)
            maxBindRetries=1,  # taken since the probe: fail (below) rather than retry silently
        )
        partners = [consensus_address(config, i) for i in range(config.seed_count) if i != me]
        self.size = len(config.cluster_members)
        self.store = _TableStore(consensus_address(config, me), partners, conf)
        try:
            self.store.waitBinded()
        except SyncObjException:
            self.store.destroy()
            again = _bind_problem(host, port)
            cause = (again.strerror or str(again)) if again is not None else "taken by another process meanwhile"
            raise _bind_error(host, port, errno.EADDRINUSE, cause) from None
        self._proposing = False
        self._was_leader = False
        log.info(
            "seed member %d: consensus on %s (listening on %s) with %s",
            me,
            consensus_address(config, me),
            Endpoint(host, port),
            ", ".join(partners),
        )

    def step(self, member: Member, now: float) -> None:
        """Bring the member up to date with Raft, and propose a new table when leading."""
        leader = bool(self.store._isLeader())
        quorum = bool(self.store.hasQuorum)
        member.leader = leader
        member.leader_quorum = leader and quorum
        term = int(self.store.raftCurrentTerm)
        if (term, leader) != (member.term, self._was_leader):
            log.info("seed member %d: Raft term %d, %s", self.me, term, "leader" if leader else "follower")
            self._was_leader = leader
        member.term = term
        table = self.store.table()
        if table.version > member.table.version:
            member.set_table(table, now)
        if not (leader and quorum) or self._proposing:
            return
        proposal = assign(member.table, member.live_members(), self.size, member.live_incarnations())
        if proposal.version != member.table.version:
            self._proposing = True
            self.store.put(
                proposal.version,
                proposal.members,
                proposal.epochs,
                proposal.admitted,
                proposal.incarnations,
                callback=self._proposed,
            )

    def _proposed(self, result: Any, error: Any) -> None:
        """Called on PySyncObj's thread; the next step proposes again if this one lost."""
        self._proposing = False

    def close(self) -> None:
        self.store.destroy()
