"""The TLS counters of ``/metrics`` (review of issue 31, item 6), summed over a node's workers.

A real server (two workers, a lean ``ListenEncrypted`` listener, ``MonitorHTTP.Listen``) gets a
lean wss connection, a lean HTTPS exchange closed by the client's close_notify, a client that
negotiates max_fragment_length (``openssl s_client -maxfraglen 512``: left on OpenSSL's record
layer), a client whose record has a corrupted ciphertext byte (``bad_record_mac`` sent) and a
plain-HTTP request on the TLS port (a failed handshake); then every ``migratory_tls_*`` counter is
read back from ``/metrics`` and checked, and ``promtool check metrics`` accepts the exposition.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from migratory.certs import create_ca, issue_server_cert
from migratory.client import MigratoryClient
from migratory.metrics import node_families, tls_families
from migratory.server.node.counters import TLS_FIELDS, SharedCounters, tls_values
from migratory.server.transport.tls import stats as tls_stats
from tests.conftest import ServerProcess, free_port


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    ca_cert, ca_key = create_ca(tmp_path / "ca")
    cert, key = issue_server_cert(ca_cert, ca_key, ["localhost", "127.0.0.1"], tmp_path / "srv")
    return {"ca": ca_cert, "ca_key": ca_key, "cert": cert, "key": key}


def tls13_context(ca: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


class RawClient:
    """A TLS 1.3 client over a blocking socket and memory BIOs: the test writes what it likes on the wire."""

    def __init__(self, port: int, ca: Path) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = tls13_context(ca).wrap_bio(self.incoming, self.outgoing, server_hostname="127.0.0.1")
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.flush()
                data = self.sock.recv(65536)
                assert data, "the server closed during the handshake"
                self.incoming.write(data)
        self.flush()
        assert self.tls.version() == "TLSv1.3"

    def flush(self) -> None:
        if self.outgoing.pending:
            self.sock.sendall(self.outgoing.read())

    def read_until_eof(self) -> bytes:
        """Everything the server sends until it closes TCP, as records (not opened)."""
        out = b""
        while data := self.sock.recv(65536):
            out += data
        return out

    def open(self, wire: bytes) -> tuple[bytes, ssl.SSLError | None]:
        """What the client's TLS makes of ``wire``: the data, and the error (an alert) that ended it."""
        self.incoming.write(wire)
        data = b""
        try:
            while chunk := self.tls.read(65536):
                data += chunk
        except ssl.SSLWantReadError:
            return data, None
        except ssl.SSLError as exc:
            return data, exc
        return data, None

    def close(self) -> None:
        self.sock.close()


def lean_https_closed_by_the_client(port: int, ca: Path) -> None:
    """A request and its answer, then the client's close_notify: the server answers with its own."""
    client = RawClient(port, ca)
    client.tls.write(b"GET /snapshot?subject=/tls/metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    client.flush()
    answer = b""
    while b"HTTP/1.1 " not in answer:
        data = client.sock.recv(65536)
        assert data
        answer += client.open(data)[0]
    with contextlib.suppress(ssl.SSLWantReadError):
        client.tls.unwrap()
    client.flush()
    client.open(client.read_until_eof())
    client.close()


def corrupted_record(port: int, ca: Path) -> ssl.SSLError | None:
    """A record whose ciphertext has one bit flipped: the server answers bad_record_mac and closes."""
    client = RawClient(port, ca)
    client.tls.write(b"GET /snapshot?subject=/tls/metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    record = bytearray(client.outgoing.read())
    assert record[0] == 23 and len(record) > 5 + 16
    record[5 + 3] ^= 0x01  # a byte of the encrypted content: the AEAD tag no longer verifies
    client.sock.sendall(bytes(record))
    _, error = client.open(client.read_until_eof())
    client.close()
    return error


def handshake_with_plain_http(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        while sock.recv(65536):
            pass


def max_fragment_length_client(port: int, ca: Path) -> bytes:
    request = b"GET /snapshot?subject=/tls/metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    command = ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-CAfile", str(ca)]
    command += ["-verify_return_error", "-tls1_3", "-maxfraglen", "512", "-ign_eof"]
    done = subprocess.run(command, input=request, capture_output=True, timeout=30)
    return done.stdout + done.stderr


def metrics_text(monitor_port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/metrics", timeout=5) as answer:
        assert answer.status == 200
        return str(answer.read().decode())


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(table: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str, **labels: str) -> float:
    return table.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl command not installed")
def test_tls_counters_in_metrics_summed_over_the_workers(
    server_factory: Callable[..., ServerProcess], pki: dict[str, Path]
) -> None:
    tls_port, monitor_port = free_port(), free_port()
    server = server_factory(
        {
            "Workers": "2",
            "ListenEncrypted": f"127.0.0.1:{tls_port}",
            "TLSCertificate": str(pki["cert"]),
            "TLSKey": str(pki["key"]),
            "MonitorHTTP.Listen": f"127.0.0.1:{monitor_port}",
        }
    )
    before = samples(metrics_text(monitor_port))
    for name in (
        "migratory_tls_lean_connections_total",
        "migratory_tls_bad_record_mac_total",
        "migratory_tls_handshake_failures_total",
    ):
        assert value(before, name) == 0, name
    assert value(before, "migratory_tls_alerts_sent_total", alert="bad_record_mac") == 0

    async def wss() -> None:
        async with MigratoryClient([f"wss://127.0.0.1:{tls_port}"], ssl=tls13_context(pki["ca"])) as client:
            await client.subscribe(["/tls/metrics"])

    asyncio.run(asyncio.wait_for(wss(), 30))  # lean: 1
    lean_https_closed_by_the_client(tls_port, pki["ca"])  # lean: 2; close_notify both ways
    out = max_fragment_length_client(tls_port, pki["ca"])  # OpenSSL's record layer: max_fragment_length
    assert b"HTTP/1.1 " in out, out[-2000:]
    error = corrupted_record(tls_port, pki["ca"])  # lean: 3; bad_record_mac sent
    assert error is not None and "bad record mac" in str(error).lower().replace("_", " "), error
    handshake_with_plain_http(tls_port)  # a failed handshake

    deadline = time.monotonic() + 15
    while True:  # the workers copy their counters into the shared slots once a second
        answers = [samples(metrics_text(monitor_port)) for _ in range(4)]  # whichever worker answers
        done = all(
            value(a, "migratory_tls_lean_connections_total") >= 3
            and value(a, "migratory_tls_handshake_failures_total") >= 1
            and value(a, "migratory_tls_alerts_received_total", alert="close_notify") >= 1
            for a in answers
        )
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    for table in answers:
        assert value(table, "migratory_tls_lean_connections_total") == 3
        assert value(table, "migratory_tls_openssl_connections_total", reason="max_fragment_length") == 1
        for reason in tls_stats.FALLBACK_REASONS:  # every reason is exposed, the others at zero
            expected = 1 if reason == "max_fragment_length" else 0
            assert value(table, "migratory_tls_openssl_connections_total", reason=reason) == expected, reason
            assert (("reason", reason),) in table["migratory_tls_openssl_connections_total"]
        assert value(table, "migratory_tls_bad_record_mac_total") == 1
        assert value(table, "migratory_tls_alerts_sent_total", alert="bad_record_mac") == 1
        assert value(table, "migratory_tls_alerts_sent_total", alert="close_notify") >= 1
        assert value(table, "migratory_tls_alerts_received_total", alert="close_notify") >= 1
        assert value(table, "migratory_tls_alerts_sent_total", alert="record_overflow") == 0
        assert value(table, "migratory_tls_handshake_failures_total") == 1
        assert set(table["migratory_tls_alerts_sent_total"]) >= {(("alert", "decode_error"),)}  # exposed at zero
        # both workers carry their TLS records on the lean layer, and none fell back (issue 52, I1)
        assert value(table, "migratory_tls_lean_fallback") == 0
        assert value(table, "migratory_tls_record_layer", worker="0", layer="lean") == 1
        assert value(table, "migratory_tls_record_layer", worker="1", layer="lean") == 1
    if shutil.which("promtool") is not None:  # the real exposition, TLS families included
        body = metrics_text(monitor_port).encode()
        check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30)
        assert check.returncode == 0, check.stderr
    server.stop()
    log = (server.log_folder / "server.log").read_text()
    warnings = [line for line in log.splitlines() if "record-layer failure from" in line]
    assert len(warnings) == 1 and "bad_record_mac" in warnings[0] and "127.0.0.1" in warnings[0], warnings
    assert "WARN" in warnings[0].upper()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not installed")
def test_promtool_accepts_the_tls_metrics() -> None:
    tls: dict[str, Any] = {
        "lean_connections": 3,
        "bad_record_mac": 1,
        "handshake_failures": 2,
        "openssl": dict.fromkeys(tls_stats.FALLBACK_REASONS, 0) | {"max_fragment_length": 1},
        "alerts_sent": dict.fromkeys(tls_stats.ALERT_LABELS, 0) | {"bad_record_mac": 1, "close_notify": 4},
        "alerts_received": dict.fromkeys(tls_stats.ALERT_LABELS, 0) | {"close_notify": 2, "other": 1},
    }
    from migratory.metrics import exposition

    body = exposition(node_families({}, {}, {}, {}, {}, 0, None, tls))
    check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=30)
    assert check.returncode == 0, check.stderr


def test_a_workers_slot_carries_this_process_tls_counters() -> None:
    """the TLS layer's (tls/stats.py) module-level counters go into the slot; the node is the sum of the slots."""
    shared = SharedCounters(2, ("a",))
    width = len(shared.read(0))
    start = width - len(TLS_FIELDS)
    mine = tls_values()
    assert len(mine) == len(TLS_FIELDS)
    row = [0] * start + [i + 1 for i in range(len(TLS_FIELDS))]
    shared.write(0, row)
    shared.write(1, row)
    tls = shared.tls()
    assert tls["lean_connections"] == 2 and tls["bad_record_mac"] == 4 and tls["handshake_failures"] == 6
    assert set(tls["openssl"]) == set(tls_stats.FALLBACK_REASONS)
    assert set(tls["alerts_sent"]) == set(tls["alerts_received"]) == set(tls_stats.ALERT_LABELS)
    families = {f.name: f for f in tls_families(tls)}
    assert families["migratory_tls_lean_connections"].samples[0].value == 2
    assert {s.labels["reason"] for s in families["migratory_tls_openssl_connections"].samples} == set(
        tls_stats.FALLBACK_REASONS
    )


def test_a_worker_off_the_lean_layer_is_marked_in_stats_and_metrics() -> None:
    """Issue 52, I1: the record layer in use per worker, and an alert-worthy gauge when the lean layer was asked
    for and is off (a self-test failed, or outside the supported matrix)."""
    shared = SharedCounters(3, ())
    at = len(shared.read(0)) - len(TLS_FIELDS) + TLS_FIELDS.index("record_layer")
    for worker, layer in enumerate((1, 4, 0)):
        row = shared.read(worker)
        row[at] = layer
        row[at - TLS_FIELDS.index("record_layer") + TLS_FIELDS.index("selftest_failures")] = int(layer == 4)
        shared.write(worker, row)
    tls = shared.tls()
    assert tls["record_layer"] == {"0": "lean", "1": "openssl: a self-test failed", "2": "none"}
    assert tls["lean_fallback_workers"] == 1 and tls["selftest_failures"] == 1
    families = {f.name: f for f in tls_families(tls)}
    assert families["migratory_tls_lean_fallback"].samples[0].value == 1
    assert families["migratory_tls_lean_selftest_failures"].samples[0].value == 1
    layers = {(s.labels["worker"], s.labels["layer"]) for s in families["migratory_tls_record_layer"].samples}
    assert layers == {("0", "lean"), ("1", "openssl: a self-test failed"), ("2", "none")}


def test_record_layer_warnings_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    tls_stats._warned.pop("decode_error", None)
    with caplog.at_level("DEBUG", logger="migratory.server.tls"):
        for _ in range(3):
            tls_stats._warn_limited("decode_error", ("192.0.2.1", 4433))
    levels = [r.levelname for r in caplog.records if "record-layer failure" in r.getMessage()]
    assert levels == ["WARNING", "DEBUG", "DEBUG"]
    tls_stats._warned["decode_error"][0] -= tls_stats.WARN_EVERY  # a minute later
    caplog.clear()
    with caplog.at_level("DEBUG", logger="migratory.server.tls"):
        tls_stats._warn_limited("decode_error", ("192.0.2.1", 4433))
    [record] = [r for r in caplog.records if "record-layer failure" in r.getMessage()]
    assert record.levelname == "WARNING" and "2 more since the last warning" in record.getMessage()
    assert "192.0.2.1" in record.getMessage()
    tls_stats._warned.pop("decode_error", None)
