"""CPU of the lean TLS record layer's own paths, per record, in-process: before and after a refactoring.

Runs under any version of the layer (the module ``migratory/server/transport/tls.py`` before issue
52's split, the package ``tls/`` after), so two checkouts can be measured side by side by running
this file with each one's interpreter, in turns:

    for i in 1 2 3; do for tree in /tmp/old /work/main; do
        (cd $tree && .venv/bin/python /work/main/tools/tls_paths_bench.py --label $tree); done; done

What it measures, on ``--connections`` lean connections (their own keys, one shared frame, as at
fan-out): ``write-c``, ``TLSTransport.write`` of a 64-byte frame sealed by the C sealer;
``write-python``, the same sealed with ``cryptography``; ``read``, ``data_received`` of one 64-byte
record. The TCP transport is an in-memory one, so the figures are the layer's CPU without the
socket's: the fastest of ``--rounds`` rounds, microseconds per record (the least disturbed by
whatever else the machine runs: compare the fastest of several runs of each tree).
``idle-bytes``: what one idle lean connection holds in Python's heap (tracemalloc: the transport,
its secrets, keys and IVs once the sweep dropped its cipher objects, and this harness's in-memory
TCP transport and application object), the slope between ``--connections`` and twice as many.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import time
from typing import Any, cast

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from migratory.server.transport import tls

try:  # the package (after the split)
    from migratory.server.transport.tls.base import _RECORDS, Listener
    from migratory.server.transport.tls.keys import SUITES
    from migratory.server.transport.tls.selftest import _CLOCK, _Recorder, _Wire

    def _listener() -> Any:
        return Listener(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), _Recorder, 10.0, _CLOCK, lean=False)

    LAYOUT = "package"
except ImportError:  # the single module (before it)
    _RECORDS = getattr(tls, "_RECORDS")  # noqa: B009
    SUITES = getattr(tls, "SUITES")  # noqa: B009
    _CLOCK, _Recorder, _Wire = (getattr(tls, name) for name in ("_CLOCK", "_Recorder", "_Wire"))  # type: ignore[misc]

    def _listener() -> Any:
        return tls.TLSServer(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), _Recorder, 10.0, _CLOCK, lean=False)

    LAYOUT = "module"


def _connections(count: int, use_c: bool) -> tuple[Any, list[Any], list[Any]]:
    server = _listener()
    server.sealer = tls.c_sealer() if use_c else None
    suite = SUITES["TLS_AES_128_GCM_SHA256"]
    transports, wires = [], []
    for _ in range(count):
        transport = tls.TLSTransport(server, _Recorder())
        wire = _Wire()
        transport._tcp = cast(asyncio.Transport, wire)
        transport._suite = suite
        transport._state = _RECORDS
        transport._made = True
        secret = bytearray(os.urandom(32))
        transport._wsecret, transport._rsecret = secret, bytearray(secret)
        key, iv = suite.keys(secret)
        transport._wkey, transport._wiv = bytearray(key), iv
        transport._rkey, transport._riv = bytearray(key), iv
        transport._c = use_c
        transports.append(transport)
        wires.append(wire)
    return server, transports, wires


def _write(count: int, rounds: int, use_c: bool) -> float:
    _, transports, wires = _connections(count, use_c)
    frame = os.urandom(64)
    samples = []
    for _ in range(rounds):
        started = time.process_time()
        for transport in transports:
            transport.write(frame)
        samples.append((time.process_time() - started) / count)
        for wire in wires:
            wire.out.clear()
    return min(samples) * 1e6


def _read(count: int, rounds: int) -> float:
    _, transports, _ = _connections(count, False)
    records = []
    for transport in transports:  # each connection's next records, sealed under its read key
        aead = AESGCM(bytes(transport._rkey))
        inner = os.urandom(64) + b"\x17"
        header = bytes((23, 3, 3)) + (len(inner) + 16).to_bytes(2, "big")
        records.append(
            [header + aead.encrypt((transport._riv ^ seq).to_bytes(12, "big"), inner, header) for seq in range(rounds)]
        )
    samples = []
    for n in range(rounds):
        started = time.process_time()
        for transport, sealed in zip(transports, records, strict=True):
            transport.data_received(sealed[n])
        samples.append((time.process_time() - started) / count)
    return min(samples) * 1e6


def _idle_bytes(count: int) -> float:
    """Heap bytes per idle lean connection: the slope between ``count`` and ``2 * count`` of them."""
    import gc
    import tracemalloc

    def held(n: int) -> int:
        gc.collect()
        tracemalloc.start()
        _, transports, wires = _connections(n, True)
        for transport in transports:
            transport.write(b"wakes it up")
            transport._release()  # what the sweep does to an idle one
        gc.collect()
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        del transports, wires
        return size

    return (held(2 * count) - held(count)) / count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--label", default="")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    figures = {
        "write-c": _write(args.connections, args.rounds, True),
        "write-python": _write(args.connections, args.rounds, False),
        "read": _read(args.connections, args.rounds),
        "idle-bytes": _idle_bytes(args.connections),
    }
    line = {"label": args.label, "layout": LAYOUT, "load": os.getloadavg()[0], **figures}
    print(json.dumps(line))
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
