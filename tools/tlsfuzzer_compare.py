"""tlsfuzzer's TLS 1.3 scripts against the lean record layer, the OpenSSL mode and ``openssl s_server``, side by side.

tlsfuzzer (https://github.com/tlsfuzzer/tlsfuzzer) is not vendored: give this a checkout of it (its
``scripts/`` and ``tlsfuzzer/`` folders) and an interpreter that has the tlslite-ng it pins. One RSA
certificate serves all three servers; each script runs against each, with its defaults, and the table
counts its conversations passed and failed (its own PASS and FAIL lines). A script that fails on the lean
layer where it passes on the OpenSSL mode is the regression to look for (docs/security.md, issue 52).

    python3 -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install 'tlslite-ng==0.9.0b2' ecdsa
    .venv/bin/python tools/tlsfuzzer_compare.py --tlsfuzzer /tmp/tlsfuzzer --python /tmp/tfenv/bin/python \\
        --out bench/results/tlsfuzzer.json
    .venv/bin/python tools/tlsfuzzer_compare.py --table bench/results/tlsfuzzer.json  # the markdown table
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from migratory.bench.servers import free_port, wait_listening

# timing and statistics scripts (hours each), post-quantum groups OpenSSL 3.0 lacks, and scripts that need a client
# certificate, a PSK or 0-RTT set up on the server: not record-layer conformance
SKIPPED = (
    "minerva",
    "mlkem",
    "mldsa",
    "psk",
    "0rtt",
    "certificate-request",
    "post-handshake-auth",
    "client-certificate",
)
SCRIPT_TIMEOUT = 900.0


def _certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed RSA 2048 certificate for 127.0.0.1 and localhost (tlsfuzzer's scripts offer RSA schemes)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def _migratory(folder: Path, cert: Path, key: Path, lean: bool) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "migratorydata.conf"
    conf.write_text(
        f"Listen = 127.0.0.1:{free_port()}\nListenEncrypted = 127.0.0.1:{port}\nTLSCertificate = {cert}\n"
        f"TLSKey = {key}\nTLSLeanTransport = {'true' if lean else 'false'}\nWorkers = 1\n"
        f"LogFolder = {folder / 'logs'}\nStateFolder = {folder / 'state'}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "migratory_cli.main", "serve", "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_listening("127.0.0.1", port, proc, 30.0)
    return proc, port


def _s_server(cert: Path, key: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        ["openssl", "s_server", "-accept", f"127.0.0.1:{port}", "-cert", str(cert), "-key", str(key), "-www", "-quiet"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_listening("127.0.0.1", port, proc, 30.0)
    return proc, port


Result = dict[str, int | float | str | list[str]]


def _count(result: Result, key: str) -> int:
    value = result.get(key, 0)
    return value if isinstance(value, int) else 0


def _seeded(folder: Path, seed: int) -> Path:
    """A folder whose ``sitecustomize.py`` seeds ``random``: each script then samples and orders its
    conversations the same way against every server, so their counts compare conversation for conversation."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(f"import random\nrandom.seed({seed})\n")
    return folder


def _run(python: str, tlsfuzzer: Path, script: str, port: int, extra: list[str], seeded: Path) -> Result:
    """One script against one server: its PASS and FAIL counts and the names of the failed conversations."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [python, str(tlsfuzzer / "scripts" / script), "-h", "127.0.0.1", "-p", str(port), *extra],
            capture_output=True,
            text=True,
            timeout=SCRIPT_TIMEOUT,
            cwd=tlsfuzzer,
            env=dict(os.environ, PYTHONPATH=f"{tlsfuzzer}{os.pathsep}{seeded}"),
        )
        out = done.stdout
    except subprocess.TimeoutExpired:
        return {"pass": 0, "fail": 0, "error": f"timed out after {SCRIPT_TIMEOUT:.0f} s", "failed": []}
    counts = {k.lower(): int(v) for k, v in re.findall(r"^(PASS|FAIL|XFAIL|XPASS|SKIP|TOTAL): (\d+)$", out, re.M)}
    failed = re.findall(r"^\t'(.*)'$", out.split("FAILED:", 1)[1], re.M) if "FAILED:" in out else []
    result: Result = {
        "pass": counts.get("pass", 0),
        "fail": counts.get("fail", 0) + counts.get("xpass", 0),
        "failed": failed,
        "seconds": round(time.monotonic() - started, 1),
    }
    if "pass" not in counts:
        lines = (done.stderr or out).strip().splitlines()
        result["error"] = lines[-1] if lines else "no summary"
    return result


def table(results: dict[str, dict[str, Result]]) -> str:
    """The results as a markdown table: conversations passed / failed per script and server, totals last."""
    servers = list(next(iter(results.values()))) if results else []
    lines = [
        "| script | " + " | ".join(f"{name} passed / failed" for name in servers) + " |",
        "| --- |" + " ---: |" * len(servers),
    ]
    for script, row in results.items():
        cells = []
        for name in servers:
            r = row[name]
            cell = f"{_count(r, 'pass')} / {_count(r, 'fail')}"
            cells.append(cell + (f" ({r['error']})" if r.get("error") else ""))
        worse = _count(row["lean"], "fail") > _count(row["openssl-mode"], "fail")
        lines.append(
            f"| {script.removeprefix('test-tls13-').removesuffix('.py')}{' **worse**' if worse else ''} | "
            + " | ".join(cells)
            + " |"
        )
    totals = []
    for name in servers:
        passed = sum(_count(r[name], "pass") for r in results.values())
        failed = sum(_count(r[name], "fail") for r in results.values())
        totals.append(f"**{passed:,} / {failed:,}**")
    lines.append(f"| all {len(results)} scripts | " + " | ".join(totals) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", type=Path, help="print the markdown table of a JSON written by --out, and stop")
    parser.add_argument("--tlsfuzzer", type=Path, help="a checkout of tlsfuzzer (scripts/, tlsfuzzer/)")
    parser.add_argument("--python", default=sys.executable, help="an interpreter with tlsfuzzer's tlslite-ng")
    parser.add_argument(
        "--script", action="append", default=[], help="test-tls13-*.py to run (default: all that apply)"
    )
    parser.add_argument(
        "--script-arg", action="append", default=[], help="passed to every script (e.g. the name of one conversation)"
    )
    parser.add_argument("--seed", type=int, default=52, help="seeds each script's random choice of conversations")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--no-s-server", action="store_true", help="leave out openssl s_server")
    args = parser.parse_args()
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return 0
    if args.tlsfuzzer is None:
        parser.error("--tlsfuzzer is required (or --table)")
    scripts = args.script or sorted(
        p.name
        for p in (args.tlsfuzzer / "scripts").glob("test-tls13-*.py")
        if not any(word in p.name for word in SKIPPED)
    )
    folder = Path(tempfile.mkdtemp(prefix="tlsfuzzer-compare-"))
    cert, key = _certificate(folder)
    seeded = _seeded(folder / "seeded", args.seed)
    servers: dict[str, tuple[subprocess.Popen[bytes], int]] = {
        "lean": _migratory(folder / "lean", cert, key, lean=True),
        "openssl-mode": _migratory(folder / "openssl-mode", cert, key, lean=False),
    }
    if not args.no_s_server and shutil.which("openssl"):
        servers["s_server"] = _s_server(cert, key)
    results: dict[str, dict[str, Result]] = {}
    try:
        for script in scripts:
            results[script] = {
                name: _run(args.python, args.tlsfuzzer, script, port, args.script_arg, seeded)
                for name, (_, port) in servers.items()
            }
            row = "  ".join(f"{name} {r['pass']}/{r['fail']}" for name, r in results[script].items())
            print(f"{script:55} {row}", flush=True)
            if args.out is not None:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1))
    finally:
        for proc, _ in servers.values():
            os.killpg(proc.pid, 9)
        shutil.rmtree(folder, ignore_errors=True)
    totals = {
        name: [
            sum(_count(r[name], "pass") for r in results.values()),
            sum(_count(r[name], "fail") for r in results.values()),
        ]
        for name in servers
    }
    print("passed / failed:", json.dumps(totals))
    regressions = [s for s, r in results.items() if _count(r["lean"], "fail") > _count(r["openssl-mode"], "fail")]
    print("scripts worse on the lean layer than on the OpenSSL mode:", regressions or "none")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
