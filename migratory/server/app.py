"""Run one server process: bind listeners, serve until SIGTERM/SIGINT, shut down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.handlers
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from migratory.config import Config, Endpoint
from migratory.logs import JsonFormatter, JsonLineWriter
from migratory.server.connection import Connection
from migratory.server.engine import Engine

__all__ = ["bind_socket", "next_epoch", "run", "serve"]

log = logging.getLogger("migratory.server")


def next_epoch(state_folder: str) -> int:
    """Increment and return the epoch counter kept in ``StateFolder/epoch``.

    A new epoch per start means a (epoch, seq) pair never names two messages, and
    keeps the number small (it travels in every delivered message).
    """
    folder = Path(state_folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "epoch"
    try:
        current = int(path.read_text().strip() or "0")
    except FileNotFoundError:
        current = 0
    except ValueError:
        raise OSError(f"{path} does not hold an epoch number") from None
    epoch = current + 1
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{epoch}\n")
    os.replace(tmp, path)
    return epoch


def bind_socket(endpoint: Endpoint, *, reuse_port: bool = False) -> socket.socket:
    """Create a listening TCP socket; ``*`` binds every IPv4 and IPv6 interface."""
    host = endpoint.bind_host
    if host is None:
        if socket.has_ipv6:
            try:
                sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                return _finish_bind(sock, ("::", endpoint.port), reuse_port)
            except OSError:
                pass
        host = "0.0.0.0"
    infos = socket.getaddrinfo(host, endpoint.port, type=socket.SOCK_STREAM)
    family, _, _, _, address = infos[0]
    return _finish_bind(socket.socket(family, socket.SOCK_STREAM), address, reuse_port)


def _finish_bind(sock: socket.socket, address: tuple[object, ...], reuse_port: bool) -> socket.socket:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
        sock.listen(4096)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _setup_logging(config: Config) -> None:
    root = logging.getLogger("migratory")
    root.setLevel(config.log_level.value)
    root.handlers.clear()
    folder = Path(config.log_folder)
    folder.mkdir(parents=True, exist_ok=True)
    file_handler = logging.handlers.RotatingFileHandler(
        folder / "server.log", maxBytes=config.log_max_file_size, backupCount=config.log_max_files
    )
    file_handler.setFormatter(JsonFormatter())
    root.addHandler(file_handler)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root.addHandler(console)


def _factory(engine: Engine, listener: str, scheme: str) -> Callable[[], Connection]:
    return lambda: Connection(engine, listener, scheme)


async def serve(config: Config, sockets: list[tuple[Endpoint, socket.socket, str]], stop: asyncio.Event) -> None:
    """Serve on already-bound sockets until ``stop`` is set."""
    loop = asyncio.get_running_loop()
    epoch = next_epoch(config.state_folder)
    writers = []
    access = message = None
    if config.access_log:
        access = JsonLineWriter(config.log_folder, "access.log", config.log_max_file_size, config.log_max_files)
        writers.append(access)
    if config.message_log:
        message = JsonLineWriter(config.log_folder, "message.log", config.log_max_file_size, config.log_max_files)
        writers.append(message)
    engine = Engine(config, epoch, loop, access, message)
    engine.start()
    servers = []
    for endpoint, sock, scheme in sockets:
        listener = str(endpoint)
        server = await loop.create_server(_factory(engine, listener, scheme), sock=sock)
        servers.append(server)
        log.info("listening on %s (%s)", listener, scheme, extra={"data": {"listener": listener}})
    log.info("server started, epoch %d, pid %d", epoch, os.getpid())
    await stop.wait()
    log.info("shutting down")
    for server in servers:
        server.close()
    await engine.shutdown()
    for server in servers:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)
    log.info("stopped")


def run(config: Config, config_path: str = "") -> int:
    """Foreground entry point of ``migratory serve``; returns the exit code."""
    try:
        _setup_logging(config)
    except OSError as exc:
        print(f"{config_path}: LogFolder: cannot write logs: {exc}", file=sys.stderr)
        return 2
    sockets: list[tuple[Endpoint, socket.socket, str]] = []
    try:
        for endpoint in config.listen:
            sockets.append((endpoint, bind_socket(endpoint), "ws"))
    except OSError as exc:
        log.error("cannot listen on %s: %s", endpoint, exc.strerror or exc)
        for _, sock, _ in sockets:
            sock.close()
        return 1
    try:
        import uvloop

        use_uvloop = True
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        use_uvloop = False

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, sockets, stop)

    try:
        if use_uvloop:
            uvloop.run(main())
        else:  # pragma: no cover
            asyncio.run(main())
    except OSError as exc:
        log.error("%s", exc)
        return 1
    return 0
