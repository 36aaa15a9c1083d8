"""A Guaranteed seed's consensus (Raft) port binds the seed's own address, and collisions on it are named.

Issue 30 item 6: PySyncObj binds 0.0.0.0 unless told otherwise, so seeds sharing one port set on
127.0.0.1/.2/.3 could not all bind "cluster port + 1" and the cluster stayed "synchronising" forever,
with nothing in the log saying why.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from migratory.bench.cluster import LocalCluster, free_ports
from migratory.config import Config, ConfigError
from migratory.preflight import check, check_file
from migratory.server.cluster import consensus
from migratory.server.cluster.consensus import ConsensusBindError, SeedConsensus, consensus_bind_address
from tests.test_cluster import free_ports_ok

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "migratory_cli.main"]
HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
PASSWORD = "cluster-test-password"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "cli")]), COLUMNS="200")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=env)


def shared_ports() -> tuple[int, int, int]:
    """(client, cluster, monitor), each port and the next one free on every host of HOSTS."""
    for _ in range(50):
        ports = free_ports(HOSTS[0], 3, consecutive=2)
        if all(free_ports_ok(host, tuple(p + extra for p in ports for extra in (0, 1))) for host in HOSTS):
            client, cluster, monitor = ports
            return client, cluster, monitor
    raise RuntimeError("no port set free on 127.0.0.1, .2 and .3")


def listening(pid: int, port: int) -> set[str]:
    """The addresses process ``pid`` listens on at TCP ``port`` (IPv4 and IPv6), from /proc/net/tcp{,6}."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            address, _, hex_port = fields[1].partition(":")
            if fields[3] != "0A" or int(hex_port, 16) != port or fields[9] not in inodes:
                continue  # 0A: LISTEN
            # the kernel prints each 32-bit word of the address in host byte order
            raw = b"".join(struct.pack("=I", int(address[i : i + 8], 16)) for i in range(0, 2 * width, 8))
            found.add(str(ipaddress.ip_address(raw)))  # not socket.inet_ntop: importing PySyncObj breaks it
    return found


@pytest.mark.slow
def test_seeds_sharing_one_port_set_on_several_addresses_become_ready(tmp_path: Path) -> None:
    """(a) Three seeds, one port set, three addresses: each binds its own consensus address, all get ready.

    (b) The consensus socket listens on the member's address only, not on every interface.
    """
    client, cluster_port, monitor = shared_ports()
    with LocalCluster(tmp_path, 3, mode="Guaranteed", ports=(client, cluster_port, monitor)) as cluster:
        cluster.start_all(ready_timeout=30)
        for index, host in enumerate(HOSTS):
            agent = cluster.processes(index)["migratory-agent"]
            assert listening(agent, cluster_port + 1) == {host}, cluster.server_log(index)


# --- a seed that cannot bind its consensus port says so, and does not start ----------------------------------


def write_conf(path: Path, lines: dict[str, str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{k} = {v}\n" for k, v in lines.items()))
    return path


def guaranteed(folder: Path, me: int, port: int, members: list[str] | None = None) -> dict[str, str]:
    """The keys of member ``me`` of a Guaranteed cluster whose members are ``members`` (HOSTS on ``port``)."""
    listed = members or [f"{host}:{port}" for host in HOSTS]
    host, _, cluster_port = listed[me].rpartition(":")
    return {
        "Listen": f"{host}:{int(cluster_port) - 2}",
        "Workers": "1",
        "LogFolder": str(folder / f"member-{me + 1}" / "logs"),
        "StateFolder": str(folder / f"member-{me + 1}" / "state"),
        "ClusterMembers": ", ".join(listed),
        "ClusterMemberListen": listed[me],
        "ClusterPassword": PASSWORD,
        "ClusterDeliveryMode": "Guaranteed",
    }


@pytest.fixture
def held() -> Iterator[int]:
    """A cluster port (listeners free around it on HOSTS) whose port + 1 another process holds on 127.0.0.1."""
    for _ in range(50):
        port = free_ports(HOSTS[0], 1, consecutive=4)[0] + 2
        if all(free_ports_ok(host, tuple(range(port - 2, port + 2))) for host in HOSTS):
            break
    else:
        raise RuntimeError("no free ports on 127.0.0.1, .2 and .3")
    with socket.socket() as busy:
        busy.bind((HOSTS[0], port + 1))
        busy.listen()
        yield port


def test_the_consensus_bind_error_names_the_address_and_the_cause(tmp_path: Path, held: int) -> None:
    config = Config.from_file(write_conf(tmp_path / "m1.conf", guaranteed(tmp_path, 0, held)))
    with pytest.raises(ConsensusBindError) as info:
        SeedConsensus(config)
    assert info.value.errno == errno.EADDRINUSE
    assert str(info.value) == (
        f"cannot listen on 127.0.0.1:{held + 1} for the seed members' consensus "
        "(ClusterMemberListen's port + 1): Address already in use"
    )
    # the same port on another address of this host is free for the seed listed there
    other = Config.from_file(write_conf(tmp_path / "m2.conf", guaranteed(tmp_path, 1, held)))
    assert consensus_bind_address(other) == ("127.0.0.2", held + 1)
    SeedConsensus(other).close()


def test_a_port_taken_between_the_probe_and_pysyncobjs_bind_is_an_error_too(
    tmp_path: Path, held: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PySyncObj would retry it silently: it gets one attempt, then the seed says why it stops."""
    probes = iter([None])
    real = consensus._bind_problem
    monkeypatch.setattr(consensus, "_bind_problem", lambda host, port: next(probes, real(host, port)))
    config = Config.from_file(write_conf(tmp_path / "m1.conf", guaranteed(tmp_path, 0, held)))
    with pytest.raises(
        ConsensusBindError, match=rf"cannot listen on 127\.0\.0\.1:{held + 1} .*: Address already in use"
    ):
        SeedConsensus(config)


# run the server with the start-up check of the consensus port left out, to reach the member agent's own
AGENT_ONLY = """
import sys
from migratory import preflight
from migratory.config import Config
from migratory.server.process import app

checked = preflight.check

def without_consensus(*args, **kwargs):
    report = checked(*args, **kwargs)
    report.findings = [f for f in report.findings if "consensus" not in f.what]
    return report

preflight.check = without_consensus
sys.exit(app.run(Config.from_file(sys.argv[1]), sys.argv[1]))
"""


def test_the_member_agent_logs_one_error_and_the_server_stops(tmp_path: Path, held: int) -> None:
    """Before: PySyncObj retried the bind silently, the member stayed "synchronising" forever."""
    conf = write_conf(tmp_path / "m1.conf", guaranteed(tmp_path, 0, held))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "cli")]))
    done = subprocess.run(
        [sys.executable, "-c", AGENT_ONLY, str(conf)], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2, done.stderr
    address = f"127.0.0.1:{held + 1}"
    entries = [json.loads(line) for line in (tmp_path / "member-1" / "logs" / "server.log").read_text().splitlines()]
    errors = [e for e in entries if e.get("level") == "ERROR" and address in json.dumps(e)]
    assert len(errors) == 1, entries
    assert "cannot listen on 127.0.0.1:" in json.dumps(errors[0]) and "Address already in use" in json.dumps(errors[0])
    assert f"cannot listen on {address} for the seed members' consensus" in done.stderr


def test_serve_and_config_check_refuse_a_consensus_port_in_use(tmp_path: Path, held: int) -> None:
    conf = write_conf(tmp_path / "m1.conf", guaranteed(tmp_path, 0, held))
    line = f"{conf}:6: ClusterMemberListen: port {held + 1} of 127.0.0.1 is in use now"
    named = " (the seed members' consensus port: ClusterMemberListen's port + 1)"
    # the start-up check: the server binds its listeners right after, the consensus port only later
    assert check(Config.from_file(conf), conf, in_use="skip").errors == [line + named]
    served = cli("serve", "-c", str(conf))
    assert served.returncode == 2 and line + named in served.stderr, served.stderr
    # config check: perhaps the running server holds it (a warning), which serve then refuses
    checked = cli("config", "check", str(conf))
    assert checked.returncode == 0 and f"{conf}:6: ClusterMemberListen: warning: port {held + 1}" in checked.stderr
    # a member that is not a seed has no consensus port
    listed = [f"127.0.0.{i}:{held + 10}" for i in range(2, 5)] + [f"127.0.0.1:{held}"]
    fourth = write_conf(tmp_path / "m4.conf", guaranteed(tmp_path, 3, held, listed))
    assert check(Config.from_file(fourth), fourth, in_use="skip").errors == []


# --- collisions: the consensus port is another port of the member, or another member's ------------------------


def problems(lines: dict[str, str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        Config.from_text("".join(f"{k} = {v}\n" for k, v in lines.items()), "m.conf")
    return info.value.errors


@pytest.mark.parametrize(
    ("key", "extra"),
    [
        ("Listen", {}),
        ("ListenEncrypted", {"TLSCertificate": "c.pem", "TLSKey": "k.pem"}),
        ("MonitorHTTP.Listen", {}),
        ("MonitorHTTP.ListenEncrypted", {"TLSCertificate": "c.pem", "TLSKey": "k.pem"}),
    ],
)
def test_the_consensus_port_may_not_be_another_listener_of_the_seed(
    tmp_path: Path, key: str, extra: dict[str, str]
) -> None:
    lines = {**guaranteed(tmp_path, 0, 9100), key: "127.0.0.1:9101", **extra}
    found = problems(lines)
    line = list(lines).index("ClusterMemberListen") + 1
    assert f"m.conf:{line}: ClusterMemberListen: port 9101 is also the client or monitor listener 127.0.0.1:9101" in (
        found
    ), found


def test_the_consensus_port_may_not_be_another_members_cluster_port_on_its_host(tmp_path: Path) -> None:
    listed = ["127.0.0.1:9100", "127.0.0.1:9101", "127.0.0.2:9100"]
    expected = (
        "m.conf:5: ClusterMembers: seed member 127.0.0.1:9100 needs port 9101 too, for the seed members' "
        "consensus (its port + 1), but member 127.0.0.1:9101 listens there: leave a free port after each seed's "
        "cluster port"
    )
    for me in range(3):  # every member's file says so: they list the same members
        assert expected in problems(guaranteed(tmp_path, me, 9100, listed))
    # other hosts, or Standard mode (no consensus): no collision
    Config.from_text("".join(f"{k} = {v}\n" for k, v in guaranteed(tmp_path, 0, 9100).items()))
    standard = {**guaranteed(tmp_path, 0, 9100, listed), "ClusterDeliveryMode": "Standard"}
    Config.from_text("".join(f"{k} = {v}\n" for k, v in standard.items()))
    # and config check reports it as file:line: key: what, exit 2
    conf = write_conf(tmp_path / "m.conf", guaranteed(tmp_path, 0, 9100, listed))
    assert any("ClusterMembers: seed member 127.0.0.1:9100 needs port 9101" in e for e in check_file(conf).errors)
    done = cli("config", "check", str(conf))
    assert done.returncode == 2 and f"{conf}:5: ClusterMembers: seed member 127.0.0.1:9100" in done.stderr


def test_cluster_check_names_a_seeds_consensus_port_that_another_members_file_listens_on(tmp_path: Path) -> None:
    listed = ["127.0.0.1:9100", "127.0.0.1:9110", "127.0.0.1:9120"]
    files = [write_conf(tmp_path / f"m{i + 1}.conf", guaranteed(tmp_path, i, 9100, listed)) for i in range(3)]
    agree = cli("cluster", "check", *map(str, files))
    assert agree.returncode == 0 and "agree" in agree.stdout, agree.stderr
    # member 2's monitor on seed 1's consensus port: each file alone is fine, side by side they collide
    files[1].write_text(files[1].read_text() + "MonitorHTTP.Listen = 127.0.0.1:9101\n")
    assert cli("config", "check", str(files[1])).returncode == 0
    collide = cli("cluster", "check", *map(str, files))
    assert collide.returncode == 2, collide.stderr
    assert collide.stderr.splitlines() == [
        f"{files[0]}:6: ClusterMemberListen: port 9101 of 127.0.0.1 (the seed members' consensus port: "
        f"ClusterMemberListen's port + 1) is also MonitorHTTP.Listen 127.0.0.1:9101 in {files[1]}"
    ]
    # one port set on 127.0.0.1, .2 and .3: no collision; a wildcard on the same machine (loopback) is one
    listed = ["127.0.0.1:9100", "127.0.0.2:9110", "127.0.0.3:9120"]
    shared = [write_conf(tmp_path / f"s{i + 1}.conf", guaranteed(tmp_path, i, 9100)) for i in range(3)]
    assert cli("cluster", "check", *map(str, shared)).returncode == 0
    spread = [write_conf(tmp_path / f"w{i + 1}.conf", guaranteed(tmp_path, i, 9100, listed)) for i in range(3)]
    spread[1].write_text(spread[1].read_text() + "MonitorHTTP.Listen = *:9101\n")
    wildcard = cli("cluster", "check", *map(str, spread))
    assert wildcard.returncode == 2 and "is also MonitorHTTP.Listen *:9101 in" in wildcard.stderr, wildcard.stderr
