"""Shared fixtures: a real server process on 127.0.0.1 and a free port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}: {proc.stderr.read().decode() if proc.stderr else ''}"
            )
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port}")


def wait_for_http(host: str, port: int, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until a worker answers HTTP on the port, not just until the kernel accepts.

    The supervisor binds and listens before a worker opens its logs and starts serving, so a
    connect alone can succeed while the server may still fail to start (a test that then moves
    the log folder away raced exactly that)."""
    wait_for_port(host, port, timeout, proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}: {proc.stderr.read().decode() if proc.stderr else ''}"
            )
        try:
            with socket.create_connection((host, port), timeout=2) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if sock.recv(16).startswith(b"HTTP/1.1 "):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no HTTP answer on {host}:{port}")


@dataclass
class ServerProcess:
    """A `migratory serve` subprocess with its config, folders and URLs."""

    proc: subprocess.Popen[bytes]
    host: str
    port: int
    folder: Path
    conf: Path
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def ws_url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_folder(self) -> Path:
        return self.folder / "logs"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # nothing of this server may outlive the test
        return self.proc.returncode


def write_conf(folder: Path, host: str, port: int, extra: dict[str, str] | None = None) -> Path:
    lines = [
        f"Listen = {host}:{port}",
        f"LogFolder = {folder / 'logs'}",
        f"StateFolder = {folder / 'state'}",
    ]
    extra = dict(extra or {})
    extra.setdefault("Workers", "1")  # multi-worker behaviour has its own tests (test_workers.py)
    lines += [f"{k} = {v}" for k, v in extra.items()]
    conf = folder / "migratorydata.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def start_server(
    folder: Path, extra: dict[str, str] | None = None, host: str = "127.0.0.1", port: int = 0
) -> ServerProcess:
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    conf = write_conf(folder, host, port, extra)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "migratory_cli.main", "serve", "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,  # teardown can kill the supervisor and all its workers at once
    )
    wait_for_http(host, port, proc=proc)
    return ServerProcess(proc, host, port, folder, conf, dict(extra or {}))


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def factory(extra: dict[str, str] | None = None, name: str = "srv", **kwargs: object) -> ServerProcess:
        server = start_server(tmp_path / f"{name}{len(started)}", extra, **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop(signal.SIGKILL if server.proc.poll() is None else signal.SIGTERM)
        if server.proc.stderr:
            server.proc.stderr.close()


@pytest.fixture
def server(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    return server_factory()


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local SparkSession for every Spark test (a JVM start costs seconds)."""
    from migratory_spark.session import build_session

    session = build_session("local[2]", app_name="migratory-tests", conf={"spark.sql.shuffle.partitions": "4"})
    yield session
    session.stop()
