"""Dropping root for good: bind as root, then run as ``RunAsUser``/``RunAsGroup``.

The order matters and is the classic one: supplementary groups first, then the
group, then the user; afterwards getting root back must fail, and we check that
it does. The log and state folders are handed to the user first, so the server
can still rotate its logs and bump its epoch.
"""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

__all__ = ["PrivilegeError", "drop_privileges"]


class PrivilegeError(Exception):
    """The user or group does not exist, or root could not be left for good."""


def drop_privileges(user: str, group: str, folders: list[str]) -> tuple[int, int]:
    """Become ``user`` (and ``group``) permanently; returns (uid, gid)."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        raise PrivilegeError(f"RunAsUser: no such user {user!r}") from None
    try:
        gid = grp.getgrnam(group).gr_gid if group else entry.pw_gid
    except KeyError:
        raise PrivilegeError(f"RunAsGroup: no such group {group!r}") from None
    for folder in folders:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        for item in [path, *path.iterdir()]:
            os.chown(item, entry.pw_uid, gid)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(entry.pw_uid)
    try:
        os.setuid(0)
    except PermissionError:
        return entry.pw_uid, gid
    raise PrivilegeError("RunAsUser: root privileges could be regained; refusing to serve")
