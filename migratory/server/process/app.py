"""Run the server: bind listeners, start the worker processes, serve, shut down cleanly.

With one worker and no cluster the server is a single process. Otherwise this
process is a supervisor in the manner of nginx and gunicorn: it binds every listener
once (``SO_REUSEPORT``, one socket per worker so the kernel spreads connections),
forks the workers (and, in a cluster, the member agent, migratory/server/cluster/agent.py),
restarts any child that dies, forwards SIGTERM/SIGINT (clean shutdown) and SIGHUP,
and never touches client traffic itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import resource
import secrets
import signal
import socket
import ssl
import sys
import time
from collections.abc import Callable
from pathlib import Path

from migratory import preflight, reload
from migratory.certs import CertError
from migratory.config import Config, ConfigError, Endpoint
from migratory.logs import JsonLineHandler, JsonLineWriter
from migratory.privileges import PrivilegeError, drop_privileges
from migratory.server.cluster.agent import serve_agent
from migratory.server.engine.core import Engine
from migratory.server.node import heap, pauses, priority
from migratory.server.node.bus import Bus
from migratory.server.node.counters import SharedCounters
from migratory.server.process.monitor import Monitor, MonitorConnection
from migratory.server.sessions.connection import Connection
from migratory.server.sessions.mqtt import mqtt_connection
from migratory.server.sessions.mqttstore import SessionStore
from migratory.server.transport import raw as rawtransport
from migratory.server.transport.context import build_context, reload_context

__all__ = ["Listener", "bind_socket", "next_epoch", "run", "serve"]

log = logging.getLogger("migratory.server")

Listener = tuple[Endpoint, socket.socket, str]

BACKLOG = 4096
"""Pending-connection queue per listener. asyncio re-listens with its own default
(100) unless told: at 100, a connection storm overflows it and clients wait for a
SYN retransmit (1 s)."""


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
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _setup_logging(config: Config) -> None:
    root = logging.getLogger("migratory")
    root.setLevel(config.log_level.value)
    root.handlers.clear()
    writer = JsonLineWriter(config.log_folder, "server.log", config.log_max_file_size, config.log_max_files)
    root.addHandler(JsonLineHandler(writer))
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(process)d] %(message)s"))
    root.addHandler(console)


def listener_names(config: Config) -> tuple[str, ...]:
    """The client listeners, as the access log and the monitor name them."""
    return tuple(
        str(e) for e in (*config.listen, *config.listen_encrypted, *config.listen_mqtt, *config.listen_mqtt_encrypted)
    )


def _factory(engine: Engine, listener: str, scheme: str) -> Callable[[], asyncio.Protocol]:
    if scheme in ("mqtt", "mqtts"):
        return lambda: mqtt_connection(engine, listener, scheme)
    return lambda: Connection(engine, listener, scheme)


async def serve(
    config: Config,
    sockets: list[Listener],
    stop: asyncio.Event,
    *,
    epoch: int | None = None,
    worker: int = 0,
    workers: int = 1,
    namespace: str = "",
    counters: SharedCounters | None = None,
    incarnation: int = 0,
    tls: ssl.SSLContext | None = None,
    secret: bytes = b"",
    reload_from: str = "",
) -> None:
    """Serve on already-bound sockets until ``stop`` is set (one worker's life).

    With ``reload_from`` (the configuration file), SIGHUP applies its live keys (migratory/reload.py).
    """
    loop = asyncio.get_running_loop()
    if epoch is None:
        epoch = next_epoch(config.state_folder)
    access = message = None
    if config.access_log:
        access = JsonLineWriter(config.log_folder, "access.log", config.log_max_file_size, config.log_max_files)
    if config.message_log:
        message = JsonLineWriter(config.log_folder, "message.log", config.log_max_file_size, config.log_max_files)
    engine = Engine(config, epoch, loop, access, message, worker=worker, workers=workers, incarnation=incarnation)
    SessionStore.of(engine)  # from the start: every worker keeps what stored MQTT sessions want, and hears takeovers
    if reload_from:
        running = [config]

        def on_hangup() -> None:
            running[0] = _reload(reload_from, running[0], engine, tls, announce=worker == 0)

        loop.add_signal_handler(signal.SIGHUP, on_hangup)
    if config.clustered:  # a star around the member agent, which coordinates every subject
        engine.bus = Bus(
            worker,
            [workers],
            namespace,
            secret,
            engine.on_bus_frame,
            engine.on_link_up,
            engine.on_link_down,
            batching=config.bus_batching_time / 1000.0,
        )
        await engine.bus.start()
    elif workers > 1:
        engine.bus = Bus(
            worker,
            range(workers),
            namespace,
            secret,
            engine.on_bus_frame,
            engine.on_link_up,
            batching=config.bus_batching_time / 1000.0,
        )
        await engine.bus.start()
        # accept clients only once every peer is linked, so none of their broadcasts is missed
        ready = asyncio.ensure_future(engine.bus.wait_ready(10.0))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not ready.done():
            ready.cancel()
        elif not ready.result():
            log.warning("worker %d: not every peer worker answered; serving anyway", worker)
    monitor = Monitor(engine, counters or SharedCounters(workers, listener_names(config), config.state_folder))
    engine.on_tick.append(monitor.tick)
    engine.start()
    servers: list[asyncio.Server | rawtransport.RawServer] = []
    poller: rawtransport.Poller | None = None  # plain listeners' connections (LeanTransport)
    for endpoint, sock, scheme in sockets:
        listener = str(endpoint)
        if scheme in ("wss", "mqtts"):
            # wss:// and https://: OpenSSL for the handshake, then the lean record layer (bench/tls.md)
            from migratory.server.transport.tls import TLSServer

            assert tls is not None
            tls_server = TLSServer(
                tls,
                _factory(engine, listener, scheme),
                config.handshake_timeout / 1000.0,
                loop,
                lean=config.tls_lean_transport,
                max_pending=engine.max_pending,
            )
            if config.lean_transport and rawtransport.available():
                # the records ride on the worker's epoll set like plain connections: no loop transport
                # (about 1.2 KB) under each TLS connection
                if poller is None:
                    poller = rawtransport.Poller(loop)
                servers.append(rawtransport.RawServer(loop, sock, tls_server, poller, BACKLOG))
            else:
                servers.append(await loop.create_server(tls_server, sock=sock, backlog=BACKLOG))
        elif scheme == "monitor":
            servers.append(await loop.create_server(lambda: MonitorConnection(monitor), sock=sock, backlog=BACKLOG))
        elif scheme == "monitor-tls":
            servers.append(
                await loop.create_server(
                    lambda: MonitorConnection(monitor),
                    sock=sock,
                    backlog=BACKLOG,
                    ssl=tls,
                    ssl_handshake_timeout=config.handshake_timeout / 1000.0,
                )
            )
        elif config.lean_transport and rawtransport.available():
            if poller is None:
                poller = rawtransport.Poller(loop)
            servers.append(rawtransport.RawServer(loop, sock, _factory(engine, listener, scheme), poller, BACKLOG))
        else:
            servers.append(await loop.create_server(_factory(engine, listener, scheme), sock=sock, backlog=BACKLOG))
    heap.serving()
    log.info(
        "worker %d/%d serving %s, epoch %d",
        worker,
        workers,
        ", ".join(str(e) for e, _, _ in sockets),
        epoch,
        extra={"data": {"worker": worker, "epoch": epoch}},
    )
    await stop.wait()
    if config.drain_time:
        # lame duck: no new client, /health 503 (the monitor listeners stay open to say it), the clients moved
        # away a few at a time; then the rest as without a drain
        for (_, _, scheme), server in zip(sockets, servers, strict=True):
            if scheme not in ("monitor", "monitor-tls"):
                server.close()
        await engine.drain(config.drain_time / 1000.0)
    for server in servers:
        server.close()
    monitor.close()
    await engine.shutdown()
    if poller is not None:
        poller.close()
    if engine.bus is not None:
        await engine.bus.close()
    for server in servers:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)
    log.info("worker %d stopped", worker)


def _run_loop(main: Callable[[], asyncio.Future[None] | object]) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(main())  # type: ignore[arg-type]
        return
    uvloop.run(main())  # type: ignore[arg-type]


def _reload(path: str, current: Config, engine: Engine, tls: ssl.SSLContext | None, *, announce: bool) -> Config:
    """SIGHUP in a worker: the file's live keys apply to requests from now on, without dropping a connection;
    a change that needs a restart is refused with one line naming its key (worker 0 says it for the node)."""
    try:
        new = Config.from_file(path)
    except ConfigError as exc:
        if announce:
            log.error("SIGHUP: %s not reloaded, the running configuration stays: %s", path, "; ".join(exc.errors))
        return current
    except OSError as exc:
        if announce:
            log.error("SIGHUP: %s not reloaded, the running configuration stays: %s", path, exc.strerror or exc)
        return current
    config, applied, refused = reload.merged(current, new)
    if announce:
        for change in refused:
            log.warning(
                "SIGHUP: %s: %s changed, but a running node cannot change it: the old value stays until a restart",
                path,
                change.key,
            )
    if applied:
        engine.reconfigure(config)
        logging.getLogger().setLevel(config.log_level.value)
    if announce:
        keys = ", ".join(c.key for c in applied) or "no key that applies live changed"
        log.info("SIGHUP: configuration reloaded from %s: %s", path, keys)
    if tls is not None:
        _reload_certificate(tls, config)
    return config


def _reload_certificate(context: ssl.SSLContext, config: Config) -> None:
    """SIGHUP: serve the certificate now on disk to new connections; keep the old on error."""
    try:
        log.info("TLS certificate reloaded: %s", reload_context(context, config))
    except CertError as exc:
        log.error("TLS certificate not reloaded, the previous one stays in service: %s", exc)


def _worker_main(config: Config, sockets: list[Listener], **kwargs: object) -> None:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tls = kwargs.get("tls")
        if kwargs.get("reload_from"):
            pass  # serve() reloads the configuration file on SIGHUP, certificate included
        elif isinstance(tls, ssl.SSLContext):
            loop.add_signal_handler(signal.SIGHUP, _reload_certificate, tls, config)
        else:  # `systemctl reload` without TLS: nothing to reload, and SIGHUP's default would kill the worker
            loop.add_signal_handler(signal.SIGHUP, log.info, "SIGHUP: no TLS listener, nothing to reload")
        pauses.watch(loop, f"worker {kwargs.get('worker', 0)}")
        await serve(config, sockets, stop, **kwargs)  # type: ignore[arg-type]

    _run_loop(main)


def raise_open_files_limit() -> int:
    """Raise this process's open-files soft limit to its hard limit; return the limit.

    Every connection is a file descriptor, and the soft limit is often 1024 while
    the hard limit allows far more; each worker inherits the raised limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return int(soft)


def _agent_main(config: Config, **kwargs: object) -> None:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, log.info, "SIGHUP: the member agent has nothing to reload")
        pauses.watch(loop, "member agent")
        nice = priority.precede("member agent")
        if nice is not None and nice < 0:
            priority.own_group("member agent", nice)
        await serve_agent(config, stop, **kwargs)  # type: ignore[arg-type]

    _run_loop(main)


def run(config: Config, config_path: str = "") -> int:
    """Foreground entry point of ``migratory serve``; returns the exit code."""
    # What `migratory config check` checks (migratory/preflight.py): every problem at once, file:line: Key: what.
    checked = preflight.check(config, config_path, in_use="skip", import_classes=False)
    for line in checked.errors:
        print(line, file=sys.stderr)
    if not checked.ok:
        return 2
    where = preflight.KeyLines.of_file(config_path) if config_path else preflight.KeyLines()
    name = config_path or "<config>"
    try:
        _setup_logging(config)
        epoch = next_epoch(config.state_folder)
    except OSError as exc:  # the checks passed, then the folders changed
        print(
            f"{name}:{where.line('LogFolder', 'StateFolder')}: LogFolder: cannot write logs or state: {exc}",
            file=sys.stderr,
        )
        return 2
    for line in checked.warnings:
        log.warning("%s", line)
    tls: ssl.SSLContext | None = None
    if config.listen_encrypted or config.monitor_listen_encrypted or config.listen_mqtt_encrypted:
        try:
            tls = build_context(config)
        except CertError as exc:
            print(f"{name}:{where.line('TLSCertificate')}: TLSCertificate: {exc}", file=sys.stderr)
            return 2
    workers = config.worker_count
    per_worker: list[list[Listener]] = [[] for _ in range(workers)]
    schemes = (
        [(e, "ws") for e in config.listen]
        + [(e, "wss") for e in config.listen_encrypted]
        + [(e, "mqtt") for e in config.listen_mqtt]
        + [(e, "mqtts") for e in config.listen_mqtt_encrypted]
        + [(e, "monitor") for e in config.monitor_listen]
        + [(e, "monitor-tls") for e in config.monitor_listen_encrypted]
    )
    member_sock: socket.socket | None = None
    keys = {
        "ws": "Listen",
        "wss": "ListenEncrypted",
        "mqtt": "ListenMqtt",
        "mqtts": "ListenMqttEncrypted",
        "monitor": "MonitorHTTP.Listen",
        "monitor-tls": "MonitorHTTP.ListenEncrypted",
        "member": "ClusterMemberListen",
    }
    try:
        for endpoint, scheme in schemes:
            for index in range(workers):
                per_worker[index].append((endpoint, bind_socket(endpoint, reuse_port=workers > 1), scheme))
        if config.cluster_member_listen is not None:
            endpoint, scheme = config.cluster_member_listen, "member"
            member_sock = bind_socket(endpoint)
    except OSError as exc:
        key_name = keys[scheme]
        log.error("cannot listen on %s: %s", endpoint, exc.strerror or exc)
        print(
            f"{name}:{where.line(key_name)}: {key_name}: cannot listen on {endpoint}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    files = raise_open_files_limit()
    if config.run_as_user:
        if os.geteuid() == 0:
            try:
                uid, gid = drop_privileges(
                    config.run_as_user, config.run_as_group, [config.log_folder, config.state_folder]
                )
            except (PrivilegeError, OSError) as exc:
                message = str(exc) if str(exc).startswith(("RunAsUser:", "RunAsGroup:")) else f"RunAsUser: {exc}"
                print(f"{name}:{where.line(message.partition(':')[0], 'RunAsUser')}: {message}", file=sys.stderr)
                return 2
            log.info("listeners bound; now running as %s (uid %d, gid %d)", config.run_as_user, uid, gid)
        else:
            log.info("not started as root: RunAsUser %s not needed", config.run_as_user)
    log.info(
        "server starting: epoch %d, %d worker(s) of at most %d open files each, pid %d",
        epoch,
        workers,
        files,
        os.getpid(),
    )
    if workers == 1 and not config.clustered:
        try:
            _worker_main(config, per_worker[0], epoch=epoch, tls=tls, reload_from=config_path)
        except OSError as exc:  # a log that cannot be opened, ...
            print(f"{config_path}: cannot start: {exc}", file=sys.stderr)
            log.error("cannot start: %s", exc)
            return 2
        log.info("server stopped")
        return 0
    return _supervise(config, per_worker, epoch, tls, member_sock, config_path)


def _die_with_parent(parent: int, name: str = "") -> None:
    """Have the kernel send SIGTERM to this worker if the supervisor dies (even by SIGKILL).

    ``name`` becomes the process name that ps and /proc/PID/comm show (at most 15 bytes).
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if name:
            libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)


PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
EXIT_CANNOT_START = 2
QUICK_DEATH = 5.0  # seconds: a child that dies sooner than this after its start did not really start
MAX_QUICK_DEATHS = 5


def role_name(index: int, workers: int) -> str:
    return f"worker {index}" if index < workers else "member agent"


def _supervise(
    config: Config,
    per_worker: list[list[Listener]],
    epoch: int,
    tls: ssl.SSLContext | None,
    member_sock: socket.socket | None = None,
    config_path: str = "",
) -> int:
    workers = len(per_worker)
    namespace = f"{os.getpid()}-{secrets.token_hex(4)}"
    secret = secrets.token_bytes(32)  # proves, on the bus, that a process was forked by this supervisor
    counters = SharedCounters(workers, listener_names(config), config.state_folder)
    children_count = workers + (1 if config.clustered else 0)
    children: dict[int, int] = {}
    stopping = False
    started: dict[int, float] = {}

    handled = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    supervisor = os.getpid()

    def spawn(index: int, incarnation: int) -> None:
        if stopping:
            return
        # Block our signals across fork: the child must not run the supervisor's
        # handler, and the parent must know the child's pid before forwarding to it.
        signal.pthread_sigmask(signal.SIG_BLOCK, handled)
        heap.before_fork()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                for sig in handled:
                    signal.signal(sig, signal.SIG_DFL)
                _die_with_parent(supervisor, "migratory-agent" if index == workers else f"migratory-w{index}")
                signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)
                for other, listeners in enumerate(per_worker):
                    if other != index:
                        for _, sock, _ in listeners:
                            sock.close()
                if index == workers:
                    _agent_main(
                        config,
                        workers=workers,
                        namespace=namespace,
                        secret=secret,
                        epoch=epoch + incarnation,
                        counters=counters,
                        sock=member_sock,
                    )
                else:
                    if member_sock is not None:
                        member_sock.close()
                    _worker_main(
                        config,
                        per_worker[index],
                        epoch=epoch,
                        worker=index,
                        workers=workers,
                        namespace=namespace,
                        counters=counters,
                        tls=tls,
                        incarnation=incarnation,
                        secret=secret,
                        reload_from=config_path,
                    )
            except OSError as exc:  # cannot open a log, bind, ...: the same at every restart
                print(f"{role_name(index, workers)} cannot start: {exc}", file=sys.stderr)
                log.error("%s cannot start: %s", role_name(index, workers), exc)
                code = EXIT_CANNOT_START
            except BaseException:
                log.exception("%s failed", role_name(index, workers))
                code = 1
            finally:
                logging.shutdown()
                os._exit(code)
        children[pid] = index
        started[index] = time.monotonic()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, handled)

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping, config
        if signum in (signal.SIGTERM, signal.SIGINT):
            stopping = True
        elif signum == signal.SIGHUP:
            # so that a worker started later serves the live keys and certificate its siblings took
            if config_path:
                with contextlib.suppress(ConfigError, OSError):
                    config = reload.merged(config, Config.from_file(config_path))[0]
            if tls is not None:
                _reload_certificate(tls, config)
        for pid, index in list(children.items()):
            if signum != signal.SIGHUP and index >= workers and config.drain_time:
                continue  # the member agent stops after the workers drained: the cluster serves their clients
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM if signum != signal.SIGHUP else signal.SIGHUP)

    def stop_agent_after_workers() -> None:
        if all(index >= workers for index in children.values()):
            for pid in list(children):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)

    def stop_all(reason: str, code: int) -> int:
        nonlocal stopping
        stopping = True
        print(reason, file=sys.stderr)
        log.error("%s", reason)
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        while children:
            try:
                pid, _ = os.wait()
            except ChildProcessError:
                break
            children.pop(pid, None)
        return code

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    incarnations = [0] * children_count
    quick_deaths = [0] * children_count
    for index in range(children_count):
        spawn(index, 0)
    while children:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        index = children.pop(pid, -1)
        if stopping:
            stop_agent_after_workers()
            continue
        if index < 0:
            continue
        code = os.waitstatus_to_exitcode(status)
        role = role_name(index, workers)
        if code == EXIT_CANNOT_START:  # it said why on stderr: restarting would fail the same way
            return stop_all(f"{config_path or 'the server'}: {role} cannot start; stopping (see above)", 2)
        how = f"signal {-code}" if os.WIFSIGNALED(status) else f"code {code}"
        lived = time.monotonic() - started.get(index, 0.0)
        quick_deaths[index] = quick_deaths[index] + 1 if lived < QUICK_DEATH else 0
        if quick_deaths[index] >= MAX_QUICK_DEATHS:
            return stop_all(
                f"{config_path or 'the server'}: {role} died {MAX_QUICK_DEATHS} times in a row within "
                f"{QUICK_DEATH:.0f} s of starting (last: {how}); stopping",
                1,
            )
        log.warning("%s (pid %d) died with %s; restarting it", role, pid, how)
        if lived < 1.0:
            time.sleep(1.0)  # do not spin on a worker that dies at start
        incarnations[index] += 1
        counters.count_restart()
        if not stopping:
            spawn(index, incarnations[index])
    log.info("server stopped")
    return 0
