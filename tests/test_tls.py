"""TLS listeners end to end: wss:// and https:// beside plain ws://, openssl s_client, SIGHUP reload."""

from __future__ import annotations

import asyncio
import datetime
import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from migratory.certs import CertError, create_ca, describe, issue_server_cert, verify_pair
from migratory.client import MigratoryClient
from migratory.protocol import Status
from tests.conftest import ServerProcess, free_port


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca_cert, ca_key = create_ca(tmp_path / "ca")
    cert, key = issue_server_cert(ca_cert, ca_key, ["localhost", "127.0.0.1"], tmp_path / "srv")
    return {"ca": ca_cert, "ca_key": ca_key, "cert": cert, "key": key}


def client_context(ca: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    return context


def tls_server(
    server_factory: Callable[..., ServerProcess], pki: dict[str, Path], **extra: str
) -> tuple[ServerProcess, int]:
    port = free_port()
    server = server_factory(
        {"ListenEncrypted": f"127.0.0.1:{port}", "TLSCertificate": str(pki["cert"]), "TLSKey": str(pki["key"]), **extra}
    )
    return server, port


def peer_serial(port: int, ca: Path) -> int:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        client_context(ca).wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    from cryptography import x509

    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


async def new_certificate_served(port: int, ca: Path, before: int) -> None:
    """Wait (up to about 10 s) until the listener serves a certificate other than serial ``before``."""
    loop = asyncio.get_running_loop()
    for _ in range(100):
        if await loop.run_in_executor(None, peer_serial, port, ca) != before:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the new certificate is not served after SIGHUP")


def test_wss_and_https_beside_plain_ws(server_factory: Callable[..., ServerProcess], pki: dict[str, Path]) -> None:
    server, port = tls_server(server_factory, pki)
    context = client_context(pki["ca"])

    async def scenario() -> None:
        async with (
            MigratoryClient([f"wss://127.0.0.1:{port}"], ssl=context) as secure,
            MigratoryClient([server.ws_url]) as plain,
        ):
            await secure.subscribe(["/t/l"])
            assert await plain.publish("/t/l", b"plain-to-secure") == Status.OK
            assert (await secure.next_message(5)).content == b"plain-to-secure"

    asyncio.run(asyncio.wait_for(scenario(), 30))
    with urllib.request.urlopen(
        f"https://127.0.0.1:{port}/snapshot?subject=/t/l", context=context, timeout=5
    ) as answer:
        assert answer.read() == b"plain-to-secure"
    # the access log tells encrypted clients apart
    server.stop()
    access = [json.loads(line) for line in (server.log_folder / "access.log").read_text().splitlines()]
    assert any(a["protocol"] == "wss" and a["tls"] for a in access if a["event"] == "connect")
    assert any(a["protocol"] == "https" for a in access if a["event"] == "http")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl command not installed")
def test_openssl_s_client_and_minimum_version(
    server_factory: Callable[..., ServerProcess], pki: dict[str, Path]
) -> None:
    server, port = tls_server(server_factory, pki, TLSMinVersion="TLSv1.3")
    ok = subprocess.run(
        [
            "openssl",
            "s_client",
            "-connect",
            f"127.0.0.1:{port}",
            "-CAfile",
            str(pki["ca"]),
            "-verify_return_error",
            "-ign_eof",
            "-servername",
            "localhost",
        ],
        input=b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        capture_output=True,
        timeout=30,
    )
    out = ok.stdout.decode(errors="replace")
    assert "Verify return code: 0 (ok)" in out and "TLSv1.3" in out
    assert '"status":"ok"' in out
    old = subprocess.run(
        ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-tls1_2"],
        input=b"",
        capture_output=True,
        timeout=30,
    )
    assert old.returncode != 0  # TLS 1.2 refused when TLSMinVersion = TLSv1.3
    assert server.proc.poll() is None


def test_sighup_reloads_the_certificate_without_dropping_connections(
    server_factory: Callable[..., ServerProcess], pki: dict[str, Path]
) -> None:
    server, port = tls_server(server_factory, pki, Workers="2")
    context = client_context(pki["ca"])
    before = peer_serial(port, pki["ca"])

    async def scenario() -> None:
        async with MigratoryClient([f"wss://127.0.0.1:{port}"], ssl=context) as client:
            await client.subscribe(["/t/r"])
            issue_server_cert(pki["ca"], pki["ca_key"], ["localhost", "127.0.0.1"], pki["cert"].parent)
            server.proc.send_signal(signal.SIGHUP)
            await new_certificate_served(port, pki["ca"], before)
            # the connection made before the reload still works
            assert await client.publish("/t/r", b"after-reload") == Status.OK
            assert (await client.next_message(5)).content == b"after-reload"

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert server.proc.poll() is None


def test_broken_tls_config_exits_2(tmp_path: Path, pki: dict[str, Path]) -> None:
    _other_ca, other_key = create_ca(tmp_path / "other")
    conf = tmp_path / "bad.conf"
    conf.write_text(
        f"Listen = 127.0.0.1:{free_port()}\nListenEncrypted = 127.0.0.1:{free_port()}\n"
        f"TLSCertificate = {pki['cert']}\nTLSKey = {other_key}\n"
        f"LogFolder = {tmp_path}/logs\nStateFolder = {tmp_path}/st\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "migratory_cli.main", "serve", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "TLSCertificate" in result.stderr and "does not match" in result.stderr


def test_certificate_checks(tmp_path: Path, pki: dict[str, Path]) -> None:
    info = verify_pair(pki["cert"], pki["key"])
    assert set(info.names) == {"localhost", "127.0.0.1"} and not info.expired
    _, other_key = issue_server_cert(pki["ca"], pki["ca_key"], ["x"], tmp_path / "other")
    with pytest.raises(CertError, match="does not match"):
        verify_pair(pki["cert"], other_key)
    locked_ca, locked_key = create_ca(tmp_path / "locked", password="right")
    with pytest.raises(CertError, match="wrong password"):
        issue_server_cert(locked_ca, locked_key, ["x"], tmp_path / "y", ca_password="wrong")
    with pytest.raises(CertError, match="encrypted"):
        issue_server_cert(locked_ca, locked_key, ["x"], tmp_path / "y")
    old = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    expired, expired_key = issue_server_cert(pki["ca"], pki["ca_key"], ["x"], tmp_path / "e", days=10, not_before=old)
    assert describe(expired).expired
    with pytest.raises(CertError, match="expired"):
        verify_pair(expired, expired_key)


def test_cert_cli(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "migratory_cli.main", "cert", *args], capture_output=True, text=True, timeout=60
        )

    assert cli("create-ca", "--out", str(tmp_path / "ca")).returncode == 0
    issued = cli(
        "issue",
        "push.example.com",
        "10.0.0.5",
        "--ca-cert",
        str(tmp_path / "ca/ca.pem"),
        "--ca-key",
        str(tmp_path / "ca/ca.key"),
        "--out",
        str(tmp_path / "srv"),
    )
    assert issued.returncode == 0, issued.stderr
    listeners = tmp_path / "listeners.conf"
    listeners.write_text("ListenEncrypted = 198.51.100.7:443, push.example.org:8443\nTLSCertificate = a\nTLSKey = b\n")
    from_config = cli(
        "issue",
        "--config",
        str(listeners),
        "--ca-cert",
        str(tmp_path / "ca/ca.pem"),
        "--ca-key",
        str(tmp_path / "ca/ca.key"),
        "--out",
        str(tmp_path / "cfg"),
    )
    assert from_config.returncode == 0, from_config.stderr
    assert set(describe(tmp_path / "cfg/server.pem").names) == {"198.51.100.7", "push.example.org"}
    shown = cli("show", str(tmp_path / "srv/server.pem"))
    assert "push.example.com" in shown.stdout and "10.0.0.5" in shown.stdout and "days left" in shown.stdout
    assert cli("csr", "push.example.com", "--out", str(tmp_path / "csr")).returncode == 0
    assert (tmp_path / "csr/server.csr").read_text().startswith("-----BEGIN CERTIFICATE REQUEST-----")
    conf = tmp_path / "m.conf"
    conf.write_text(f"TLSCertificate = {tmp_path}/srv/server.pem\nTLSKey = {tmp_path}/ca/ca.key\n")
    mismatch = cli("check", "-c", str(conf))
    assert mismatch.returncode == 1 and "does not match" in mismatch.stderr
