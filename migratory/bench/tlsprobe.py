"""Where the memory of an idle TLS connection goes: one small server, several TLS transports.

``python -m migratory.bench.tlsprobe --clients 4000,8000`` starts, for each mode, a
minimal server (a slotted ``asyncio.Protocol`` that answers a WebSocket upgrade and
then stays idle, as :class:`migratory.server.sessions.connection.Connection` does), connects
the first number of TLS 1.3 clients (the kit's loaders, several processes and source
addresses), measures the server's PSS, connects more up to the second number,
measures again, and prints the PSS slope between the two (bytes per connection) and
the server's CPU per handshake. Modes:

``plain``
    no TLS (the floor: the TCP transport and the protocol object);
``uvloop``
    ``loop.create_server(ssl=...)`` on uvloop (what ``wss://`` used before issue 19);
``asyncio``
    the same on the standard library's event loop;
``uvloop-keep-buffers``
    ``uvloop`` with ``SSL_MODE_RELEASE_BUFFERS`` cleared (CPython sets it on every context);
``memorybio``
    :mod:`migratory.server.transport.tls` keeping OpenSSL's ``SSLObject`` for the records;
``lean``
    :mod:`migratory.server.transport.tls` as the server runs it (OpenSSL for the handshake only).

``python -m migratory.bench.tlsprobe --heap`` measures the heap (``mallinfo2``) of the
pieces in-process instead: an ``SSLObject`` with its two ``MemoryBIO`` before and after
a handshake, with and without released buffers, the AEAD objects of ``cryptography`` and
the C record sealer. ``--seal`` measures the CPU of sealing one fan-out record, in Python and in C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import multiprocessing
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection as Pipe
from pathlib import Path
from typing import Any, cast

__all__ = ["MODES", "heap_report", "main", "probe"]

MODES = ("plain", "uvloop", "asyncio", "uvloop-keep-buffers", "memorybio", "lean")

SSL_CTRL_MODE = 33
SSL_CTRL_CLEAR_MODE = 78
SSL_MODE_RELEASE_BUFFERS = 0x10


class _Idle(asyncio.Protocol):
    """Answers the first request with a 101 and then holds the connection, like an idle subscriber."""

    __slots__ = ("transport", "up")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.up = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.up and b"\r\n\r\n" in data and self.transport is not None:
            self.up = True
            self.transport.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Accept: x\r\n\r\n"
            )


def _set_release_buffers(context: ssl.SSLContext, on: bool) -> int:
    """Set or clear SSL_MODE_RELEASE_BUFFERS on the context's SSL_CTX; return the mode after."""
    from migratory.server.transport.tls.libssl import _libssl, ssl_ctx_pointer

    lib = _libssl()
    pointer = ssl_ctx_pointer(context, lib) if lib is not None else None
    if lib is None or pointer is None:
        raise RuntimeError("cannot reach the context's SSL_CTX")
    lib.SSL_CTX_ctrl.restype = ctypes.c_long
    lib.SSL_CTX_ctrl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    lib.SSL_CTX_ctrl(pointer, SSL_CTRL_MODE if on else SSL_CTRL_CLEAR_MODE, SSL_MODE_RELEASE_BUFFERS, None)
    return int(lib.SSL_CTX_ctrl(pointer, SSL_CTRL_MODE, 0, None))


def server_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_COMPRESSION
    context.set_alpn_protocols(["http/1.1"])
    context.load_cert_chain(cert, key)
    return context


async def _serve(mode: str, host: str, port: int, cert: str, key: str) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    context = server_context(cert, key)
    if mode == "uvloop-keep-buffers":
        _set_release_buffers(context, False)
    if mode in ("memorybio", "lean"):
        from migratory.server.transport.tls import TLSServer

        tls_server = TLSServer(context, _Idle, 10.0, loop)
        tls_server.lean = mode == "lean"
        server = await loop.create_server(tls_server, host, port, backlog=4096)
    elif mode == "plain":
        server = await loop.create_server(_Idle, host, port, backlog=4096)
    else:
        server = await loop.create_server(_Idle, host, port, backlog=4096, ssl=context, ssl_handshake_timeout=10.0)
    await stop.wait()
    server.close()


def _serve_main(mode: str, host: str, port: int, cert: str, key: str) -> None:
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if mode == "asyncio":
        asyncio.run(_serve(mode, host, port, cert, key))
    else:
        import uvloop

        uvloop.run(_serve(mode, host, port, cert, key))


def _pss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _connect(
    host: str, port: int, ca: str, count: int, processes: int, sources: list[str], first: int
) -> list[tuple[multiprocessing.process.BaseProcess, Pipe]]:
    """Start loaders for ``count`` more clients and wait until they are all connected."""
    from migratory.bench.loader import LoaderSpec, loader_main

    context = multiprocessing.get_context("fork")
    loaders: list[tuple[multiprocessing.process.BaseProcess, Pipe]] = []
    per = [count // processes + (1 if i < count % processes else 0) for i in range(processes)]
    for index, n in enumerate(per):
        if not n:
            continue
        parent, child = context.Pipe()
        source = sources[(first + index) % len(sources)]
        spec = LoaderSpec("ws-broadcast", host, port, source, [[] for _ in range(n)], ca=ca)
        proc = context.Process(target=loader_main, args=(spec, child), daemon=True)
        proc.start()
        loaders.append((proc, parent))
    for _, pipe in loaders:
        message = pipe.recv()
        if message[0] != "connected" or message[2]:
            raise RuntimeError(f"a loader could not connect everyone: {message[:3]}")
    return loaders


def probe(
    mode: str, sizes: list[int], *, processes: int = 2, sources: list[str] | None = None, idle: float = 5.0
) -> dict[str, Any]:
    """One mode: PSS after each size, the slope between the first and the last, CPU per handshake."""
    from migratory.bench.servers import make_test_pki

    sources = sources or ["127.0.0.1"]
    host = "127.0.0.1"
    folder = Path(tempfile.mkdtemp(prefix="migratory-tlsprobe-"))
    ca, cert, key = make_test_pki(folder, host)
    with socket.socket() as sock:
        sock.bind((host, 0))
        port = int(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "migratory.bench.tlsprobe", "serve", mode, host, str(port), str(cert), str(key)]
    server = subprocess.Popen(cmd)
    loaders: list[tuple[multiprocessing.process.BaseProcess, Pipe]] = []
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection((host, port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"probe server ({mode}) did not start") from None
                time.sleep(0.1)
        time.sleep(1.0)
        points = [(0, _pss(server.pid))]
        cpu = []
        connected = 0
        for size in sizes:
            before = _cpu(server.pid)
            loaders += _connect(
                host, port, str(ca) if mode != "plain" else "", size - connected, processes, sources, len(loaders)
            )
            cpu.append((_cpu(server.pid) - before) / max(1, size - connected))
            connected = size
            time.sleep(idle)
            points.append((size, _pss(server.pid)))
        (n0, p0), (n1, p1) = points[1], points[-1]
        slope = (p1 - p0) / (n1 - n0) if n1 > n0 else (p1 - points[0][1]) / max(1, n1)
        return {
            "mode": mode,
            "pss_bytes": [{"connections": n, "pss": p} for n, p in points],
            "bytes_per_connection_slope": round(slope, 1),
            "bytes_per_connection_from_zero": round((p1 - points[0][1]) / max(1, n1), 1),
            "server_cpu_ms_per_handshake": round(1000 * sum(cpu) / len(cpu), 3),
            "load_average": [round(v, 2) for v in os.getloadavg()],
        }
    finally:
        for _, pipe in loaders:
            pipe.send("stop")
        for proc, _ in loaders:
            proc.join(30)
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


# --- in-process: the heap of each piece -------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _heap_in_use() -> int:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    s = server.wrap_bio(s_in, s_out, server_side=True)
    c = client.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    for _ in range(6):
        for obj in (c, s):
            with contextlib.suppress(ssl.SSLWantReadError):
                obj.do_handshake()
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    c.write(b"GET / HTTP/1.1\r\n\r\n")
    s_in.write(c_out.read())
    s.read(65536)
    s.write(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")
    c_in.write(s_out.read())
    c.read(65536)
    return s, c


def heap_report(count: int = 2000) -> dict[str, float]:
    """Heap bytes per object of each piece (mallinfo2 before and after making ``count`` of them)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

    from migratory.bench.servers import make_test_pki

    folder = Path(tempfile.mkdtemp(prefix="migratory-tlsheap-"))
    ca, cert, key = make_test_pki(folder, "127.0.0.1")
    server = server_context(str(cert), str(key))
    client = ssl.create_default_context(cafile=str(ca))
    out: dict[str, float] = {}

    def measure(name: str, make: Any) -> None:
        make()
        gc.collect()
        before = _heap_in_use()
        kept = [make() for _ in range(count)]
        gc.collect()
        out[name] = round((_heap_in_use() - before) / count, 1)
        del kept
        gc.collect()

    out["SSL_CTX mode (CPython's default)"] = _set_release_buffers(server, True)
    measure(
        "SSLObject + 2 MemoryBIO, before the handshake",
        lambda: server.wrap_bio(ssl.MemoryBIO(), ssl.MemoryBIO(), server_side=True),
    )
    measure("SSLObject + 2 MemoryBIO, TLS 1.3 established, buffers released", lambda: _handshake(server, client)[0])
    _set_release_buffers(server, False)
    measure("SSLObject + 2 MemoryBIO, TLS 1.3 established, buffers kept", lambda: _handshake(server, client)[0])
    _set_release_buffers(server, True)
    measure("cryptography AESGCM (128-bit key)", lambda: AESGCM(os.urandom(16)))
    measure("cryptography ChaCha20Poly1305", lambda: ChaCha20Poly1305(os.urandom(32)))
    from migratory.server.transport.tls import TLSServer, TLSTransport, c_sealer

    sealer = c_sealer()
    if sealer is not None:
        measure("C record sealer, AES-128-GCM (_tlsseal.Sealer)", lambda: sealer(os.urandom(16), os.urandom(12)))

    idle = TLSTransport(cast(TLSServer, None), _Idle())
    out["TLSTransport object (sys.getsizeof, Python's allocator)"] = sys.getsizeof(idle)
    out["a SHA-384 traffic secret (sys.getsizeof)"] = sys.getsizeof(os.urandom(48))
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    return out


def seal_report(connections: int = 4000, rounds: int = 7, passes: int = 10) -> dict[str, float]:
    """CPU microseconds to seal one 64-byte message's record, ``connections`` keys taking turns.

    As at fan-out: every connection has its own key, the record plaintext and header are shared.
    ``python``: the transport's sealing without the extension (``cryptography``'s AESGCM, the nonce,
    the header); ``c``: ``Sealer.seal``. The median of ``rounds`` alternating rounds.
    """
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from migratory.server.transport.tls import c_sealer

    sealer = c_sealer()
    keys = [os.urandom(16) for _ in range(connections)]
    ivs = [os.urandom(12) for _ in range(connections)]
    inner = os.urandom(64 + 6) + b"\x17"  # the frame (header and payload) and the content type
    header = bytes((23, 3, 3)) + (len(inner) + 16).to_bytes(2, "big")
    aeads = [(AESGCM(key), int.from_bytes(iv, "big")) for key, iv in zip(keys, ivs, strict=True)]
    sealers = [sealer(key, iv) for key, iv in zip(keys, ivs, strict=True)] if sealer is not None else []

    def python(seq: int) -> None:
        for aead, iv in aeads:
            _ = header + aead.encrypt((iv ^ seq).to_bytes(12, "big"), inner, header)

    def c(seq: int) -> None:
        for one in sealers:
            one.seal(seq, inner, header)

    timings: dict[str, list[float]] = {"python": [], "c": []} if sealers else {"python": []}
    for _ in range(rounds):
        for name in timings:
            run = python if name == "python" else c
            start = time.process_time()
            for seq in range(passes):
                run(seq)
            timings[name].append((time.process_time() - start) / (passes * connections) * 1e6)
    return {f"{name} us per record": round(sorted(values)[len(values) // 2], 3) for name, values in timings.items()}


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve"]:
        mode, host, port, cert, key = args[1:6]
        _serve_main(mode, host, int(port), cert, key)
        return
    parser = argparse.ArgumentParser(prog="python -m migratory.bench.tlsprobe", description=__doc__)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--clients", default="4000,8000", help="two sizes: the slope is measured between them")
    parser.add_argument("--processes", type=int, default=2, help="loader processes per step")
    parser.add_argument("--sources", default="127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5")
    parser.add_argument("--idle", type=float, default=5.0, help="seconds idle before each measurement")
    parser.add_argument("--heap", action="store_true", help="the in-process heap report instead")
    parser.add_argument("--seal", action="store_true", help="the in-process cost of sealing a record instead")
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args(args)
    if options.heap or options.seal:
        result: Any = heap_report() if options.heap else seal_report()
        for name, value in result.items():
            print(f"{name:70} {value:>10}")
    else:
        sizes = [int(n) for n in options.clients.split(",")]
        sources = [s.strip() for s in options.sources.split(",") if s.strip()]
        result = []
        for mode in options.modes.split(","):
            row = probe(mode, sizes, processes=options.processes, sources=sources, idle=options.idle)
            result.append(row)
            points = ", ".join(f"{p['connections']}: {p['pss'] / 2**20:.1f} MB" for p in row["pss_bytes"])
            print(
                f"{mode:20} slope {row['bytes_per_connection_slope']:>9,.0f} B/conn   "
                f"from zero {row['bytes_per_connection_from_zero']:>9,.0f} B/conn   "
                f"CPU/handshake {row['server_cpu_ms_per_handshake']:.3f} ms   PSS {points}   "
                f"load {row['load_average']}",
                flush=True,
            )
    if options.json is not None:
        options.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
