"""The dual-firewall DMZ deployment, built for real with network namespaces and nftables.

Three namespaces stand for the Internet side (``pub``), the DMZ host running the
server (``dmz``) and the backend LAN (``lan``). The server listens for public
clients with TLS on the public address (443), for publishers on a LAN address
(8800), and for monitoring on a third address; nftables on the DMZ host lets the
public side reach only 443 and the LAN side only the publisher and monitoring
ports; only LAN addresses may publish. Addresses live only inside these
namespaces, which the test creates and removes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from migratory.certs import create_ca, issue_server_cert

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("nft") is None, reason="needs root and nftables (.ci/deps.sh)"
    ),
]

PUBLIC, LAN, MONITOR = "10.201.0.2", "10.202.0.2", "10.202.0.3"
ROOT = Path(__file__).resolve().parent.parent


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=60)


@pytest.fixture
def namespaces() -> Iterator[dict[str, str]]:
    tag = f"{os.getpid() % 10000}"
    ns = {"pub": f"mgpub{tag}", "dmz": f"mgdmz{tag}", "lan": f"mglan{tag}"}
    for name in ns.values():
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
    try:
        for side, prefix, peer_ip, dmz_ips in (
            ("pub", "10.201.0", ".1", [PUBLIC]),
            ("lan", "10.202.0", ".1", [LAN, MONITOR]),
        ):
            outer, inner = f"v{side}{tag}o", f"v{side}{tag}i"
            sh("ip", "link", "add", outer, "netns", ns[side], "type", "veth", "peer", "name", inner, "netns", ns["dmz"])
            sh("ip", "-n", ns[side], "addr", "add", f"{prefix}{peer_ip}/24", "dev", outer)
            for address in dmz_ips:
                sh("ip", "-n", ns["dmz"], "addr", "add", f"{address}/24", "dev", inner)
            sh("ip", "-n", ns[side], "link", "set", outer, "up")
            sh("ip", "-n", ns["dmz"], "link", "set", inner, "up")
            sh("ip", "-n", ns[side], "route", "add", "default", "via", dmz_ips[0])
            ns[f"{side}_if"] = inner
        rules = textwrap.dedent(
            f"""
            table inet dmz {{
              chain input {{
                type filter hook input priority 0; policy drop;
                ct state established,related accept
                iif "lo" accept
                iif "{ns["pub_if"]}" tcp dport 443 accept
                iif "{ns["lan_if"]}" tcp dport {{ 8800, 9900 }} accept
              }}
            }}
            """
        )
        subprocess.run(["ip", "netns", "exec", ns["dmz"], "nft", "-f", "-"], input=rules, text=True, check=True)
        yield ns
    finally:
        for name in ns.values():
            if name.startswith("mg"):
                sh("ip", "netns", "del", name, check=False)


def in_ns(
    name: str, *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", name, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


CLIENT = textwrap.dedent(
    """
    import asyncio, ssl, sys
    from migratory.client import MigratoryClient

    async def main(url, ca, mode):
        context = ssl.create_default_context(cafile=ca) if url.startswith("wss") else None
        async with MigratoryClient([url], ssl=context, reconnect=False) as client:
            if mode == "subscribe":
                print("SUBSCRIBE", (await client.subscribe(["/dmz/news"]))["/dmz/news"].name, flush=True)
                message = await client.next_message(30)
                print("GOT", message.content.decode(), flush=True)
            else:
                print("PUBLISH", (await client.publish("/dmz/news", b"from-" + mode.encode())).name, flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
    """
)


def tcp_open(ns: str, host: str, port: int) -> bool:
    probe = f"import socket; socket.create_connection(('{host}', {port}), timeout=2); print('open')"
    return "open" in in_ns(ns, sys.executable, "-c", probe, timeout=30).stdout


def test_dual_firewall_dmz(namespaces: dict[str, str], tmp_path: Path) -> None:
    ca, ca_key = create_ca(tmp_path / "ca")
    cert, key = issue_server_cert(ca, ca_key, ["push.example.com", PUBLIC], tmp_path / "tls")
    conf = tmp_path / "dmz.conf"
    conf.write_text(
        f"ListenEncrypted = {PUBLIC}:443\nListen = {LAN}:8800\nMonitorHTTP.Listen = {MONITOR}:9900\n"
        f"TLSCertificate = {cert}\nTLSKey = {key}\nPublishAllowFromAddressList = 10.202.0.0/24\nWorkers = 2\n"
        f"LogFolder = {tmp_path}/logs\nStateFolder = {tmp_path}/state\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            namespaces["dmz"],
            sys.executable,
            "-m",
            "migratory_cli.main",
            "serve",
            "-c",
            str(conf),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    subscriber = None
    try:
        for _ in range(100):
            if tcp_open(namespaces["lan"], LAN, 8800):
                break
            time.sleep(0.2)
        # the firewall: public side reaches only 443; LAN side only the publisher and monitoring ports
        assert tcp_open(namespaces["pub"], PUBLIC, 443)
        assert not tcp_open(namespaces["pub"], LAN, 8800)
        assert not tcp_open(namespaces["pub"], MONITOR, 9900)
        assert not tcp_open(namespaces["lan"], PUBLIC, 443)
        assert tcp_open(namespaces["lan"], MONITOR, 9900)
        # a public subscriber over wss:// receives what a LAN publisher publishes over ws://
        subscriber = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                namespaces["pub"],
                sys.executable,
                str(script),
                f"wss://{PUBLIC}:443",
                str(ca),
                "subscribe",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert subscriber.stdout is not None
        assert subscriber.stdout.readline().strip() == "SUBSCRIBE OK"
        published = in_ns(namespaces["lan"], sys.executable, str(script), f"ws://{LAN}:8800", str(ca), "lan", env=env)
        assert published.stdout.strip() == "PUBLISH OK", published.stderr
        assert subscriber.stdout.readline().strip() == "GOT from-lan"
        # a publish attempt from the public side is denied
        denied = in_ns(
            namespaces["pub"], sys.executable, str(script), f"wss://{PUBLIC}:443", str(ca), "internet", env=env
        )
        assert denied.stdout.strip() == "PUBLISH DENIED", denied.stderr
    finally:
        if subscriber is not None:
            subscriber.kill()
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()
    access = (tmp_path / "logs" / "access.log").read_text()
    assert '"reason_code":"address_not_allowed"' in access
