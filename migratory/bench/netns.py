"""Network namespaces for cluster members, so a partition can be made (and healed) with nftables.

Each member runs in its own namespace with one address on a bridge in the root
namespace; the benchmark's clients stay in the root namespace and reach every member
over the bridge. :meth:`Namespaces.partition` makes nftables in one member's namespace
drop everything to and from the other members (its clients still reach it), and
:meth:`Namespaces.heal` removes that rule. Needs root, iproute2 and nftables; every
name carries a per-run tag, and :meth:`Namespaces.close` removes everything.

Several harnesses may run side by side (two fault loops): each claims its /24 with a lock
file before using it, and checks that the root namespace routes it to its own bridge. Two
bridges with one subnet would send one harness's clients to the other's cluster.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess

__all__ = ["Namespaces", "available"]

SUBNET = "10.203"
LOCKS = "/run/migratory-netns"


def available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("nft") is not None


def _sh(*args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), input=stdin, capture_output=True, text=True, check=check, timeout=60)


_instances = itertools.count()


def _alive(lock: str) -> bool:
    """Whether the process that wrote ``lock`` still runs (a lock being written counts as held)."""
    try:
        with open(lock) as held:
            pid = int(held.read().strip() or "0")
    except (OSError, ValueError):
        return True
    return not pid or os.path.exists(f"/proc/{pid}")


class Namespaces:
    """``size`` namespaces ``mgc<tag>-<i>`` on bridge ``mgb<tag>`` (10.203.<net>.0/24)."""

    def __init__(self, size: int, tag: str | None = None) -> None:
        self.size = size
        # one tag per instance: a deleted namespace's veth peer goes away asynchronously in the kernel, and
        # the next round of the same process must not meet it under the same name ("File exists")
        self.tag = tag or f"{os.getpid() % 10000}{next(_instances) % 100:02d}"
        self.net = 0
        self._lock = ""
        self._claim(int(self.tag) % 250 + 1)
        self.bridge = f"mgb{self.tag}"
        self.names = [f"mgc{self.tag}-{i}" for i in range(size)]
        self.hosts = [f"{SUBNET}.{self.net}.{10 + i}" for i in range(size)]
        self._made: list[str] = []
        try:
            self._create()
        except Exception:
            self.close()
            raise

    def _claim(self, first: int) -> None:
        """Take a /24 no other harness holds (a lock file naming our pid; a dead holder's is taken over)."""
        os.makedirs(LOCKS, exist_ok=True)
        in_use = _sh("ip", "-o", "-4", "addr", "show", check=False).stdout
        for step in range(254):
            net = (first - 1 + step) % 254 + 1
            if f" {SUBNET}.{net}." in in_use:
                continue
            lock = os.path.join(LOCKS, f"{SUBNET}.{net}")
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                if _alive(lock):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
                try:
                    fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    continue
            with os.fdopen(fd, "w") as out:
                out.write(str(os.getpid()))
            self.net, self._lock = net, lock
            return
        raise RuntimeError(f"no free {SUBNET}.x.0/24 for the namespaces' bridge")

    def _create(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append("bridge")
        _sh("ip", "addr", "add", f"{SUBNET}.{self.net}.1/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        route = _sh("ip", "route", "get", self.hosts[0], check=False).stdout
        if f" dev {self.bridge} " not in route + " ":
            raise RuntimeError(f"{self.hosts[0]} is routed elsewhere, not to {self.bridge}: {route.strip()}")
        for i, (name, host) in enumerate(zip(self.names, self.hosts, strict=True)):
            _sh("ip", "netns", "add", name)
            self._made.append(name)
            outer, inner = f"mgv{self.tag}o{i}", f"mgv{self.tag}i{i}"
            _sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", name)
            _sh("ip", "link", "set", outer, "master", self.bridge)
            _sh("ip", "link", "set", outer, "up")
            _sh("ip", "-n", name, "addr", "add", f"{host}/24", "dev", inner)
            _sh("ip", "-n", name, "link", "set", inner, "up")
            _sh("ip", "-n", name, "link", "set", "lo", "up")
        # bridged frames must not be filtered by the host's own firewall (br_netfilter), if any
        with contextlib.suppress(OSError), open("/proc/sys/net/bridge/bridge-nf-call-iptables", "w") as knob:
            knob.write("0")

    def wrap(self, index: int) -> list[str]:
        """Command prefix that runs a program in member ``index``'s namespace."""
        return ["ip", "netns", "exec", self.names[index]]

    def partition(self, index: int) -> None:
        """Cut member ``index`` off from every other member (both directions)."""
        others = ", ".join(h for i, h in enumerate(self.hosts) if i != index)
        rules = f"""
        table inet mgpartition {{
          chain input {{ type filter hook input priority -10; policy accept; ip saddr {{ {others} }} drop; }}
          chain output {{ type filter hook output priority -10; policy accept; ip daddr {{ {others} }} drop; }}
        }}
        """
        _sh("ip", "netns", "exec", self.names[index], "nft", "-f", "-", stdin=rules)

    def heal(self, index: int) -> None:
        _sh("ip", "netns", "exec", self.names[index], "nft", "delete", "table", "inet", "mgpartition", check=False)

    def close(self) -> None:
        for name in self.names:
            if name in self._made:
                _sh("ip", "netns", "delete", name, check=False)
        if "bridge" in self._made:
            _sh("ip", "link", "delete", self.bridge, check=False)
        self._made.clear()
        if self._lock:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._lock)
            self._lock = ""

    def __enter__(self) -> Namespaces:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
