"""Start the server under test as a child process, and read its CPU and memory from /proc."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MultiMeter", "ProcessMeter", "SpawnedServer", "spawn"]

TICKS = os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (a supervisor and its workers)."""
    out = [pid]
    for child_pid in _children(pid):
        out.extend(process_tree(child_pid))
    return out


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@dataclass
class ProcessMeter:
    """CPU seconds (user+sys) and RSS of a process tree, from /proc."""

    pid: int

    def cpu_seconds(self) -> float:
        user, system = self.cpu_split()
        return user + system

    def cpu_split(self) -> tuple[float, float]:
        """(user, system) CPU seconds of the whole tree."""
        user = system = 0
        for pid in process_tree(self.pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            user += int(fields[11])  # utime
            system += int(fields[12])  # stime
        return user / TICKS, system / TICKS

    def rss_bytes(self) -> int:
        total = 0
        for pid in process_tree(self.pid):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                continue
        return total


@dataclass
class MultiMeter:
    """Several servers measured as one (the members of a cluster)."""

    meters: list[ProcessMeter]

    def cpu_seconds(self) -> float:
        return sum(m.cpu_seconds() for m in self.meters)

    def cpu_split(self) -> tuple[float, float]:
        splits = [m.cpu_split() for m in self.meters]
        return sum(u for u, _ in splits), sum(s for _, s in splits)

    def rss_bytes(self) -> int:
        return sum(m.rss_bytes() for m in self.meters)


@dataclass
class SpawnedServer:
    kind: str
    host: str
    port: int
    proc: subprocess.Popen[bytes]
    folder: str
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def meter(self) -> ProcessMeter:
        return ProcessMeter(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _wait(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"server did not listen on {host}:{port}")


def spawn(kind: str, host: str = "127.0.0.1", workers: int = 1, max_pending: str = "64MB") -> SpawnedServer:
    """Start a server of ``kind`` (migratory, nats, mqtt, ws-broadcast, websockets) on a free port."""
    port = _free_port(host)
    folder = tempfile.mkdtemp(prefix="migratory-bench-")
    limits = _raise_nofile()
    if kind == "migratory":
        conf = Path(folder) / "migratorydata.conf"
        conf.write_text(
            f"Listen = {host}:{port}\nWorkers = {workers}\nLogFolder = {folder}/logs\nStateFolder = {folder}/state\n"
            f"KeepAliveInterval = 3600000\nMessageLog = false\nAccessLog = false\nMaxPendingOutput = {max_pending}\n"
        )
        cmd = [sys.executable, "-m", "migratory_cli.main", "serve", "-c", str(conf)]
    elif kind == "nats":
        binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
        conf = Path(folder) / "nats.conf"
        conf.write_text(
            f"listen: {host}:{port}\nmax_connections: 1000000\nmax_pending: 268435456\nwrite_deadline: 60s\n"
        )
        cmd = [binary, "-c", str(conf)]
    elif kind == "mqtt":
        binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
        conf = Path(folder) / "mosquitto.conf"
        conf.write_text(
            f"listener {port} {host}\nallow_anonymous true\nmax_connections -1\nmax_queued_messages 100000\n"
            "persistence false\nlog_dest none\n"
        )
        cmd = [binary, "-c", str(conf)]
    elif kind in ("ws-broadcast", "websockets"):
        cmd = [sys.executable, "-m", "migratory.bench.peers", kind, host, str(port)]
    else:
        raise ValueError(f"cannot spawn {kind!r}")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=limits)
    try:
        _wait(host, port, proc)
    except Exception:
        proc.kill()
        raise
    return SpawnedServer(kind, host, port, proc, folder)


def _raise_nofile() -> Callable[[], None]:
    import resource

    def apply() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    return apply
