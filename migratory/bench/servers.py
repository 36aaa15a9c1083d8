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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["MultiMeter", "ProcessMeter", "SpawnedServer", "free_port", "peer_binary", "spawn", "wait_listening"]

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

    def processes(self) -> int:
        return len(process_tree(self.pid))

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

    def pss_bytes(self) -> int:
        """Proportional set size of the tree (/proc/PID/smaps_rollup): pages shared after fork count once."""
        total = 0
        for pid in process_tree(self.pid):
            try:
                for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
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

    def processes(self) -> int:
        return sum(m.processes() for m in self.meters)

    def rss_bytes(self) -> int:
        return sum(m.rss_bytes() for m in self.meters)

    def pss_bytes(self) -> int:
        return sum(m.pss_bytes() for m in self.meters)


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


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_listening(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """Until ``proc`` accepts connections on ``host:port``; RuntimeError if it exits first, TimeoutError."""
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


_BINARIES = {
    "nats": "nats-server",
    "nats-tls": "nats-server",
    "nats-mqtt": "nats-server",
    "mqtt": "mosquitto",
    "mqtt-tls": "mosquitto",
}


def peer_binary(kind: str) -> str | None:
    """The executable that serves target ``kind`` when it is another project's server, or None if missing.

    On the PATH, else in /usr/sbin (Debian's packages put nats-server and mosquitto there, outside
    a user's PATH). None as well for the kinds this project serves itself.
    """
    name = _BINARIES.get(kind)
    if name is None:
        return None
    found = shutil.which(name) or f"/usr/sbin/{name}"
    return found if os.access(found, os.X_OK) else None


def make_test_pki(folder: Path, host: str, *more: str) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate for ``host``, ``more`` hosts (a cluster's members) and localhost:
    (CA, certificate chain, key)."""
    from migratory.certs import create_ca, issue_server_cert

    ca_cert, ca_key = create_ca(folder / "ca", name="migratory bench test CA")
    names = list(dict.fromkeys([host, *more, "127.0.0.1", "localhost"]))
    cert, key = issue_server_cert(ca_cert, ca_key, names, folder / "srv")
    return ca_cert, cert, key


def spawn(
    kind: str,
    host: str = "127.0.0.1",
    workers: int = 1,
    max_pending: str = "64MB",
    settings: Mapping[str, str] | None = None,
) -> SpawnedServer:
    """Start a server of ``kind`` (a target of migratory/bench/wire.py) on a free port.

    The TLS kinds (``migratory-wss``, ``nats-tls``, ``mqtt-tls``) serve a certificate
    from a test CA made for the run (``extra["ca"]``: the file clients trust). The MQTT
    kinds of this server and nats-server (``migratory-mqtt``, ``nats-mqtt``) listen for
    MQTT on ``port`` (their other listener on a port of its own, unused by the kit).
    """
    port = free_port(host)
    folder = tempfile.mkdtemp(prefix="migratory-bench-")
    limits = _raise_nofile()
    extra: dict[str, str] = {}
    if kind.endswith(("-wss", "-tls")):
        ca, cert, key = make_test_pki(Path(folder) / "pki", host)
        extra["ca"] = str(ca)
    if kind in ("migratory", "migratory-wss", "migratory-stream", "migratory-mqtt"):
        conf = Path(folder) / "migratorydata.conf"
        listeners = f"Listen = {host}:{port}\n"
        if kind == "migratory-wss":
            listeners = (
                f"Listen = {host}:{free_port(host)}\nListenEncrypted = {host}:{port}\n"
                f"TLSCertificate = {cert}\nTLSKey = {key}\n"
            )
        elif kind == "migratory-mqtt":  # the clients reach ListenMqtt; the WebSocket listener idles
            listeners = f"Listen = {host}:{free_port(host)}\nListenMqtt = {host}:{port}\n"
        conf.write_text(
            f"{listeners}Workers = {workers}\nLogFolder = {folder}/logs\nStateFolder = {folder}/state\n"
            f"KeepAliveInterval = 3600000\nMessageLog = false\nAccessLog = false\nMaxPendingOutput = {max_pending}\n"
            + "".join(f"{key} = {value}\n" for key, value in (settings or {}).items())
        )
        cmd = [sys.executable, "-m", "migratory_cli.main", "serve", "-c", str(conf)]
    elif kind in ("nats", "nats-tls"):
        binary = peer_binary(kind) or "nats-server"
        conf = Path(folder) / "nats.conf"
        tls = ""
        if kind == "nats-tls":  # timeout: the TLS handshake's (0.5 s by default, too short for a connection storm)
            tls = f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n  timeout: 10\n}}\n'
        conf.write_text(
            f"listen: {host}:{port}\nmax_connections: 1000000\nmax_pending: 268435456\nwrite_deadline: 60s\n{tls}"
        )
        cmd = [binary, "-c", str(conf)]
    elif kind == "nats-mqtt":
        binary = peer_binary(kind) or "nats-server"
        conf = Path(folder) / "nats.conf"
        conf.write_text(_nats_mqtt_conf(host, free_port(host), port, Path(folder) / "jetstream"))
        cmd = [binary, "-c", str(conf)]
    elif kind in ("mqtt", "mqtt-tls"):
        binary = peer_binary(kind) or "mosquitto"
        conf = Path(folder) / "mosquitto.conf"
        tls = f"certfile {cert}\nkeyfile {key}\n" if kind == "mqtt-tls" else ""
        conf.write_text(
            f"listener {port} {host}\n{tls}allow_anonymous true\nmax_connections -1\nmax_queued_messages 100000\n"
            "persistence false\nlog_dest none\n"
        )
        if kind == "mqtt-tls" and os.geteuid() == 0:
            conf.write_text(conf.read_text() + "user root\n")  # it reads the key after dropping privileges
        cmd = [binary, "-c", str(conf)]
    elif kind in ("ws-broadcast", "websockets"):
        cmd = [sys.executable, "-m", "migratory.bench.peers", kind, host, str(port)]
    else:
        raise ValueError(f"cannot spawn {kind!r}")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=limits)
    try:
        wait_listening(host, port, proc)
    except Exception:
        proc.kill()
        raise
    return SpawnedServer(kind, host, port, proc, folder, extra)


def _nats_mqtt_conf(host: str, port: int, mqtt_port: int, store: Path) -> str:
    """nats-server with its MQTT listener on ``mqtt_port``, configured like the ``nats`` target otherwise.

    NATS (2.9) serves MQTT only with a ``server_name`` and JetStream enabled: it keeps its MQTT
    sessions, retained messages and QoS 1 deliveries in JetStream streams, under ``store``.
    """
    return (
        f"listen: {host}:{port}\nserver_name: migratory-bench\nmax_connections: 1000000\n"
        f"max_pending: 268435456\nwrite_deadline: 60s\n"
        f'jetstream {{\n  store_dir: "{store}"\n}}\n'
        f"mqtt {{\n  listen: {host}:{mqtt_port}\n}}\n"
    )


def _raise_nofile() -> Callable[[], None]:
    import resource

    def apply() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    return apply
