"""Named workloads of ``migratory bench run --preset``.

``seed-10m`` is the shape of the seeds' headline benchmark (10 million concurrent users
on one 1U server, each receiving a 512-byte message a minute): every client subscribes
to one subject out of many (100 subscribers a subject), every subject gets one message
a minute, so N clients receive N/60 messages a second in total, held for 10 minutes.
Its server and load-generator processes follow from the client count: one process holds
at most ``PER_PROCESS`` connections, under this machine's 20,000 open files a process
(a few hundred stay free for the worker bus, listeners and logs), and each load
generator gets four source addresses of its own (connect() slows down sharply past
about 14,000 ports of one address under the default ``ip_local_port_range``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["PER_PROCESS", "PRESETS", "preset"]

PER_PROCESS = 18_000
SUBSCRIBERS_PER_SUBJECT = 100
HOLD_SECONDS = 600.0
SOURCES_PER_PROCESS = 4  # about 4,500 connections per source address (see LoaderSpec.sources)
# The load generators read their sockets every 30 ms (LoaderSpec.poll): a client that slept in epoll
# would make every loopback delivery wake a process, which a server's remote clients never cost it.
# The latency reported includes the wait (15 ms on average).
LOADER_POLL = 0.03


def _addresses(count: int) -> str:
    """``count`` loopback source addresses from 127.0.1.1 on, as ``migratory bench run --sources`` takes them."""
    out = []
    for n in range(count):
        third, fourth = divmod(n, 254)
        out.append(f"127.0.{1 + third}.{1 + fourth}")
    return ",".join(out)


def _seed(clients: int) -> dict[str, Any]:
    subjects = max(1, clients // SUBSCRIBERS_PER_SUBJECT)
    rate = subjects / 60.0  # each subject, hence each client, gets one message a minute
    processes = max(1, math.ceil(clients / PER_PROCESS))
    return {
        "clients": clients,
        "subjects": subjects,
        "subjects_per_client": 1,
        "size": 512,
        "rate": rate,
        "messages": max(1, round(rate * HOLD_SECONDS)),
        "processes": processes,
        "workers": processes,
        "sources": _addresses(processes * SOURCES_PER_PROCESS),
        "loader_poll": LOADER_POLL,
    }


FAILOVER_KILL_AFTER = 120.0
FAILOVER_RESTART_AFTER = 300.0
FAILOVER_HOLD = 480.0


def _seed_failover(clients: int) -> dict[str, Any]:
    """``seed-10m`` through a member's death: 2 members of a Guaranteed cluster share the clients (a third,
    with one worker, holds the publisher and the third seed's vote); member 1 is SIGKILLed two minutes into
    publishing (every client has had two messages), its clients reconnect to member 2 with their positions;
    member 1 restarts three minutes later and rejoins under the load. Each serving member has workers for
    all the clients (one holds them all after the kill)."""
    options = _seed(clients)
    rate = options["rate"]
    options.update(
        messages=max(1, round(rate * FAILOVER_HOLD)),
        kill_after=FAILOVER_KILL_AFTER,
        restart_after=FAILOVER_RESTART_AFTER,
        members=3,
        mode="Guaranteed",
    )
    return options


PRESETS = {"seed-10m": (1_000_000, _seed), "seed-10m-failover": (1_000_000, _seed_failover)}


def preset(name: str, clients: int | None = None) -> dict[str, Any]:
    """The options of preset ``name`` (for ``clients`` clients, or the preset's own count)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    default_clients, make = PRESETS[name]
    return make(clients or default_clients)
