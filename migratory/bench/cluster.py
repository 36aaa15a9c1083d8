"""A cluster of real `migratory serve` processes on this machine, for tests and benchmarks.

Member ``i`` listens on its own loopback address (127.0.0.<base+i>) with free ports,
so a member's client, monitor and cluster ports never collide with another's and a
test can reach each one separately. Members are separate process groups: a test can
SIGKILL or SIGSTOP one member (its supervisor, agent and workers) as a whole.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LocalCluster", "MemberProcess", "free_ports"]


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(host: str, count: int, consecutive: int = 1) -> list[int]:
    """``count`` ports free on ``host``, each followed by ``consecutive - 1`` free ones.

    Chosen below the kernel's ephemeral range: a port from that range, free when probed,
    can be taken by any outgoing connection before the member binds it (a busy machine's
    load generators took a seed's consensus port that way).
    """
    floor = _ephemeral_floor()
    low = max(1024, floor - 12288)
    out: list[int] = []
    rng = random.Random()
    for _ in range(100_000):
        if len(out) == count:
            return out
        port = rng.randrange(low, floor - consecutive)
        if any(abs(port - taken) < consecutive for taken in out):
            continue
        holders = []
        try:
            for extra in range(consecutive):
                held = socket.socket()
                holders.append(held)
                held.bind((host, port + extra))
        except OSError:
            continue
        finally:
            for held in holders:
                held.close()
        out.append(port)
    raise RuntimeError(f"no {count} free ports below {floor} on {host}")


@dataclass
class MemberProcess:
    index: int
    host: str
    client_port: int
    cluster_port: int
    monitor_port: int
    folder: Path
    conf: Path
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=Path)
    tls_port: int = 0  # ListenEncrypted, when the cluster serves wss:// too

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.client_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _group_of(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        return os.getpgid(pid)
    return None


def _end_with_harness() -> None:
    """In the member's process before exec: SIGTERM when the harness dies, even by SIGKILL (its own session
    would otherwise outlive it, and a later run on the same addresses would meet it)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalCluster:
    """``size`` members with one configuration each; start, kill, stop, stop and resume any of them."""

    def __init__(
        self,
        folder: Path,
        size: int,
        *,
        mode: str = "Standard",
        workers: int | Sequence[int] = 1,  # one count for all, or one per member
        heartbeat_interval: int = 200,
        heartbeat_timeout: int = 1000,
        extra: Mapping[str, str] | None = None,
        base: int = 1,
        hosts: list[str] | None = None,
        ports: tuple[int, int, int] | None = None,
        password: str = "cluster-test-password",
        wrap: Callable[[int], list[str]] | None = None,
        tls: tuple[Path, Path] | None = None,  # a certificate chain and key: every member also on ListenEncrypted
    ) -> None:
        self.folder = folder
        self.size = size
        self.mode = mode
        self.wrap = wrap
        self.members: list[MemberProcess] = []
        if tls is not None and ports is not None:
            raise ValueError("a cluster with given ports has no port for ListenEncrypted: tls needs free ports")
        hosts = hosts or [f"127.0.0.{base + i}" for i in range(size)]
        for i, host in enumerate(hosts):
            # in network namespaces each member has its own ports: the given ones are free there
            client, cluster, monitor, *rest = ports or free_ports(host, 4 if tls else 3, consecutive=2)
            member_folder = folder / f"member-{i + 1}"
            member_folder.mkdir(parents=True, exist_ok=True)
            member = MemberProcess(
                i, host, client, cluster, monitor, member_folder, member_folder / "migratorydata.conf"
            )
            member.tls_port = rest[0] if tls and rest else 0
            self.members.append(member)
        members = ", ".join(f"{m.host}:{m.cluster_port}" for m in self.members)
        for m in self.members:
            lines = {
                "Listen": f"{m.host}:{m.client_port}",
                "MonitorHTTP.Listen": f"{m.host}:{m.monitor_port}",
                "LogFolder": str(m.folder / "logs"),
                "StateFolder": str(m.folder / "state"),
                "Workers": str(workers if isinstance(workers, int) else workers[m.index]),
                "ClusterMembers": members,
                "ClusterMemberListen": f"{m.host}:{m.cluster_port}",
                "ClusterPassword": password,
                "ClusterDeliveryMode": mode,
                "ClusterHeartbeatInterval": str(heartbeat_interval),
                "ClusterHeartbeatTimeout": str(heartbeat_timeout),
                **dict(extra or {}),
            }
            if tls is not None and m.tls_port:
                lines.update(
                    {"ListenEncrypted": f"{m.host}:{m.tls_port}", "TLSCertificate": str(tls[0]), "TLSKey": str(tls[1])}
                )
            m.conf.write_text("".join(f"{k} = {v}\n" for k, v in lines.items()))

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop_all()

    def __getitem__(self, index: int) -> MemberProcess:
        return self.members[index]

    # --- processes --------------------------------------------------------------------

    def start(self, index: int, conf: Path | None = None) -> MemberProcess:
        member = self.members[index]
        if member.alive:
            raise RuntimeError(f"member {index} is running")
        member.log = member.folder / f"stderr-{int(time.time() * 1000)}.log"
        prefix = self.wrap(index) if self.wrap is not None else []
        command = [*prefix, sys.executable, "-m", "migratory_cli.main", "serve", "-c", str(conf or member.conf)]
        with member.log.open("wb") as err:
            member.proc = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                start_new_session=True,
                # the kernel's parent-death signal follows the starting *thread*: only the main thread's lives as
                # long as the harness (a restart from an executor thread is stopped by the harness's own exit)
                preexec_fn=_end_with_harness if threading.current_thread() is threading.main_thread() else None,
            )
        return member

    def start_all(self, indices: Iterable[int] | None = None, ready_timeout: float = 30.0) -> None:
        chosen = list(range(self.size) if indices is None else indices)
        for index in chosen:
            self.start(index)
        self.wait_ready(chosen, ready_timeout)

    def signal(self, index: int, sig: int) -> None:
        """Send ``sig`` to every process of the member (supervisor, agent, workers). The agent may have a
        session of its own (priority.own_group), outside the member's process group: it is signalled by
        pid, found before the group is signalled (a supervisor killed first leaves it to init) and again
        after (an agent started meanwhile may have left the group since)."""
        member = self.members[index]
        if member.proc is None:
            return
        group = member.proc.pid
        apart = self._apart(index)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, sig)
        for pid in apart | self._apart(index):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _apart(self, index: int) -> set[int]:
        """The member's children outside its process group."""
        proc = self.members[index].proc
        group = proc.pid if proc is not None else -1
        return {pid for pid in self.processes(index).values() if _group_of(pid) not in (None, group)}

    def processes(self, index: int) -> dict[str, int]:
        """The member's children by name: ``migratory-agent``, ``migratory-w0``, ..."""
        member = self.members[index]
        if member.proc is None:
            return {}
        out = {}
        try:
            pids = Path(f"/proc/{member.proc.pid}/task/{member.proc.pid}/children").read_text().split()
        except OSError:
            return {}
        for pid in pids:
            with contextlib.suppress(OSError):
                out[Path(f"/proc/{pid}/comm").read_text().strip()] = int(pid)
        return out

    def kill(self, index: int) -> None:
        self.signal(index, signal.SIGKILL)
        member = self.members[index]
        if member.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                member.proc.wait(10)

    def stop(self, index: int, timeout: float = 30.0) -> int | None:
        member = self.members[index]
        if member.proc is None:
            return None
        self.signal(index, signal.SIGCONT)
        if member.proc.poll() is None:
            member.proc.send_signal(signal.SIGTERM)
            try:
                member.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(index, signal.SIGKILL)
                member.proc.wait(5)
        self.signal(index, signal.SIGKILL)  # nothing of it may outlive the test
        return member.proc.returncode

    def stop_all(self) -> None:
        for index in range(self.size):
            self.stop(index)

    # --- observing ----------------------------------------------------------------------

    def health(self, index: int, timeout: float = 2.0) -> dict[str, Any] | None:
        """The member's /health document (None while it does not answer)."""
        try:
            with urllib.request.urlopen(self.members[index].http_url + "/health", timeout=timeout) as answer:
                return dict(json.loads(answer.read()))
        except urllib.error.HTTPError as exc:
            with contextlib.suppress(ValueError):
                return dict(json.loads(exc.read()))
            return None
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def cluster(self, index: int, timeout: float = 2.0) -> dict[str, Any] | None:
        """The member's monitor /cluster document."""
        try:
            with urllib.request.urlopen(self.members[index].monitor_url + "/cluster", timeout=timeout) as answer:
                return dict(json.loads(answer.read()))
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def snapshot(self, index: int, subject: str) -> dict[str, Any] | None:
        url = f"{self.members[index].http_url}/snapshot?subject={urllib.parse.quote(subject)}"
        request = urllib.request.Request(url, headers={"Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return dict(json.loads(answer.read()))
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def ready(self, index: int) -> bool:
        document = self.health(index)
        return bool(document and document.get("ready"))

    def wait_ready(self, indices: Iterable[int], timeout: float = 30.0) -> None:
        chosen = list(indices)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index in chosen:
                member = self.members[index]
                if member.proc is not None and member.proc.poll() is not None:
                    raise RuntimeError(f"member {index} exited with {member.proc.returncode}: {self.stderr(index)}")
            if all(self.ready(i) for i in chosen):
                return
            time.sleep(0.1)
        raise TimeoutError(f"members {chosen} not ready after {timeout} s: {[self.health(i) for i in chosen]}")

    def wait_view(self, index: int, up: set[int], timeout: float = 30.0) -> dict[str, Any]:
        """Wait until member ``index`` sees exactly ``up`` (itself included) up and ready."""
        deadline = time.monotonic() + timeout
        document: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            document = self.cluster(index)
            if document is not None:
                seen = {
                    row["index"]
                    for row in document["members"]
                    if row["state"].startswith("this member, ready") or row["state"].startswith("up, ready")
                }
                if seen == up:
                    return document
            time.sleep(0.1)
        raise TimeoutError(f"member {index} does not see {sorted(up)} ready: {document}")

    def stderr(self, index: int) -> str:
        log = self.members[index].log
        try:
            return log.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def server_log(self, index: int) -> str:
        path = self.members[index].folder / "logs" / "server.log"
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""
