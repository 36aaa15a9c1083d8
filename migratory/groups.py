"""Subject groups across cluster members: who coordinates which group, and epochs.

Subjects fall into :data:`GROUPS` groups by a hash of their name. Each group has one
coordinator member, which numbers the group's messages. The coordinator is named by
the group's *epoch*: epochs are ``k * members + owner`` (``owner`` being the
coordinator's index in ``ClusterMembers``), so an epoch says who numbered a message,
two members never issue the same epoch, and a takeover always picks a ``k`` larger
than any it has seen, so epochs only grow.

Which live member should coordinate a group is decided by rendezvous hashing
(highest random weight): every member computes the same answer from the same set of
live members, and a member joining or leaving moves only the groups it wins or held.
In Standard mode each member applies this to its own view of who is alive; in
Guaranteed mode the seed members' consensus applies it once and records the result
in a :class:`Table`.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["GROUPS", "Table", "assign", "epoch_for", "group_of", "owner_of", "rendezvous"]

GROUPS = 64
"""Subject groups of a cluster: the unit of coordination and of failover."""


def group_of(subject: str) -> int:
    """The group of ``subject`` (stable on every member and across restarts)."""
    return zlib.crc32(subject.encode("utf-8")) % GROUPS


@functools.cache  # GROUPS x members entries; a Standard agent asks for all of them at every tick
def _weight(group: int, member: int) -> int:
    digest = hashlib.blake2b(f"{group}/{member}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(group: int, members: Iterable[int]) -> int:
    """The member that should coordinate ``group`` among ``members`` (-1 when none)."""
    best, best_weight = -1, -1
    for member in members:
        weight = _weight(group, member)
        if weight > best_weight:
            best, best_weight = member, weight
    return best


def owner_of(epoch: int, members: int) -> int:
    """The member that issued ``epoch`` (-1 for 0, "no coordinator yet")."""
    return epoch % members if epoch else -1


def epoch_for(owner: int, members: int, above: int) -> int:
    """The smallest epoch of ``owner`` greater than ``above``."""
    k = above // members + 1
    return k * members + owner


@dataclass(frozen=True, slots=True)
class Table:
    """Guaranteed mode's agreed state: live members and every group's epoch (hence coordinator).

    ``version`` grows with every change; members adopt the highest version they hear of.
    """

    version: int = 0
    members: tuple[int, ...] = ()
    epochs: tuple[int, ...] = (0,) * GROUPS
    admitted: tuple[int, ...] = ()  # per member (same order): the version that last added it
    incarnations: tuple[int, ...] = ()  # per member (same order): the agent process the table admitted

    def incarnation_of(self, member: int) -> int | None:
        """The incarnation (agent process) of ``member`` this table admitted; None without a record."""
        if member not in self.members or len(self.incarnations) != len(self.members):
            return None
        return self.incarnations[self.members.index(member)]

    def owner(self, group: int, size: int) -> int:
        return owner_of(self.epochs[group], size)

    def admitted_at(self, member: int) -> int:
        """The version that last added ``member`` (0: not a member, or a table without the record).

        A member holding an older table than that was left out and taken back in between,
        whether or not it saw the table that left it out (members adopt only the newest).
        """
        if member not in self.members or len(self.admitted) != len(self.members):
            return 0
        return self.admitted[self.members.index(member)]


def assign(table: Table, live: Sequence[int], size: int, incarnations: Mapping[int, int] | None = None) -> Table:
    """The next table for ``live`` members: groups whose owner should change get new epochs.

    A group keeps its coordinator while that member is live and still the rendezvous
    choice; otherwise it moves, with an epoch above every epoch in the table. A member
    whose agent restarted (``incarnations`` names another process than the table admitted)
    is admitted anew, and its groups get new epochs: the new process must not be taken for
    the old one, nor continue numbering under the old one's epochs.
    """
    serving = tuple(sorted(set(live)))
    if not serving:
        return table
    members = serving
    known = incarnations or {}
    restarted = {m for m in serving if table.incarnation_of(m) not in (None, known.get(m, table.incarnation_of(m)))}
    top = max(table.epochs)
    epochs = list(table.epochs)
    for group in range(GROUPS):
        wanted = rendezvous(group, serving)
        if owner_of(epochs[group], size) != wanted or wanted in restarted:
            epochs[group] = epoch_for(wanted, size, top)
    kept = tuple(known.get(m, table.incarnation_of(m) or 0) for m in members) if known else table.incarnations
    if members == table.members and tuple(epochs) == table.epochs and kept == table.incarnations:
        return table
    version = table.version + 1
    admitted = tuple(
        table.admitted_at(m) or version if m in table.members and m not in restarted else version for m in members
    )
    return Table(version, members, tuple(epochs), admitted, kept)
