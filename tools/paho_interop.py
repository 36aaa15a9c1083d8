"""The Eclipse Paho MQTT interoperability suite, unmodified, against this server and Mosquitto side by side.

The suite (https://github.com/eclipse/paho.mqtt.testing, folder ``interoperability/``) is not vendored:
give this a checkout of it. Each test of ``client_test.py`` (MQTT 3.1.1) and ``client_test5.py`` (MQTT 5.0)
runs alone, against a freshly started broker with its default configuration (the suite's tests leave
retained messages and sessions behind that fail the next ones), with a time limit; the table says ok,
FAIL, ERROR or hung per test and broker. docs/mqtt.md ("Conformance") has the last table.

    .venv/bin/python tools/paho_interop.py --suite /tmp/paho.mqtt.testing --out bench/results/paho.json
    .venv/bin/python tools/paho_interop.py --table bench/results/paho.json  # the markdown table
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from migratory.bench.servers import free_port, wait_listening

TEST_TIMEOUT = 90.0
FILES = {"3.1.1": "client_test.py", "5.0": "client_test5.py"}

# client_test.py's __main__ leaves its --port option in sys.argv, which unittest.main then rejects: run the
# file unmodified as __main__ with its own option parsing, and give unittest.main the test names instead
_V311_WRAPPER = """
import functools, runpy, sys, unittest
suite_file, port, tests = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(0, ".")
sys.argv = [suite_file, "--hostname", "127.0.0.1", "--port", port]
unittest.main = functools.partial(unittest.main, argv=[suite_file, "-v", *tests])
runpy.run_path(suite_file, run_name="__main__")
"""


def _start(broker: str, work: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A fresh broker on a free port, its default configuration but for where it listens."""
    port = free_port()
    if broker == "mosquitto":
        conf = work / "mosquitto.conf"
        conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\n")
        command = [shutil.which("mosquitto") or "/usr/sbin/mosquitto", "-c", str(conf)]
    else:
        logs = work / "logs"
        logs.mkdir(exist_ok=True)
        conf = work / "migratorydata.conf"
        conf.write_text(f"Listen = 127.0.0.1:{free_port()}\nListenMqtt = 127.0.0.1:{port}\nLogFolder = {logs}\n")
        command = [sys.executable, "-m", "migratory_cli.main", "serve", "-c", str(conf)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening("127.0.0.1", port, proc, 30.0)
    return proc, port


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_names(suite: Path, version: str) -> list[str]:
    """The test methods of one of the suite's files, in their order there."""
    text = (suite / FILES[version]).read_text()
    return re.findall(r"^    def (test\w+)", text, re.MULTILINE)


def run_one(suite: Path, version: str, test: str, port: int, python: str) -> str:
    """One test against the broker on ``port``: ok, FAIL, ERROR or hung."""
    if version == "5.0":
        command = [python, FILES[version], "-p", str(port), "-v", f"Test.{test}"]
    else:
        command = [python, "-c", _V311_WRAPPER, FILES[version], str(port), f"Test.{test}"]
    try:
        done = subprocess.run(command, cwd=suite, capture_output=True, timeout=TEST_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        return "hung"
    output = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
    if re.search(r"^OK", output, re.MULTILINE):
        return "ok"
    return "ERROR" if re.search(r"^ERROR:", output, re.MULTILINE) else "FAIL"


def run(suite: Path, brokers: list[str], python: str) -> dict[str, dict[str, dict[str, str]]]:
    """version -> test -> broker -> outcome."""
    results: dict[str, dict[str, dict[str, str]]] = {}
    for version in FILES:
        for test in test_names(suite, version):
            row = results.setdefault(version, {}).setdefault(test, {})
            for broker in brokers:
                with tempfile.TemporaryDirectory(prefix="paho-") as work:
                    proc, port = _start(broker, Path(work))
                    try:
                        row[broker] = run_one(suite, version, test, port, python)
                    finally:
                        _stop(proc)
                print(f"{version} {test} {broker}: {row[broker]}", flush=True)
    return results


def table(results: dict[str, dict[str, dict[str, str]]]) -> str:
    """The results as markdown: one row a test, a column a broker, the totals of ok last."""
    lines: list[str] = []
    for version, tests in results.items():
        brokers = list(next(iter(tests.values())).keys()) if tests else []
        lines += [f"MQTT {version}:", "", "| test | " + " | ".join(brokers) + " |"]
        lines.append("| --- |" + " ---: |" * len(brokers))
        for test, row in tests.items():
            lines.append(f"| {test} | " + " | ".join(row.get(b, "") for b in brokers) + " |")
        totals = [sum(1 for row in tests.values() if row.get(b) == "ok") for b in brokers]
        lines.append(f"| **passed of {len(tests)}** | " + " | ".join(f"**{n}**" for n in totals) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", type=Path, help="a checkout of eclipse/paho.mqtt.testing (or its interoperability/)")
    parser.add_argument("--brokers", default="migratory,mosquitto", help="comma-separated: migratory, mosquitto")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the suite")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--table", type=Path, help="print the markdown table of a JSON written by --out, and exit")
    args = parser.parse_args()
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return 0
    if args.suite is None:
        parser.error("--suite is required (a checkout of https://github.com/eclipse/paho.mqtt.testing)")
    suite = args.suite / "interoperability" if (args.suite / "interoperability").is_dir() else args.suite
    if not (suite / FILES["5.0"]).is_file():
        parser.error(f"{suite} has no {FILES['5.0']}: not the Paho interoperability suite")
    results = run(suite, [b.strip() for b in args.brokers.split(",") if b.strip()], args.python)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
