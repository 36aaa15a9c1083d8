"""The JavaScript client (clients/js): Node's own tests against live servers, and the same scenario as Python."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from migratory.client import MigratoryClient
from migratory.protocol import Status
from tests.conftest import ServerProcess

JS = Path(__file__).resolve().parent.parent / "clients" / "js"
NODE = shutil.which("node")

pytestmark = pytest.mark.skipif(NODE is None, reason="Node.js is not installed")


def node(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Node.js in clients/js; one that outlives ``timeout`` fails the test with the end of what it printed
    (which subtest it was in), not only the command line."""
    assert NODE is not None
    try:
        return subprocess.run(
            [NODE, "--experimental-websocket", *args], cwd=JS, capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired as late:
        printed = late.stdout.decode(errors="replace") if isinstance(late.stdout, bytes) else late.stdout or ""
        pytest.fail(f"node {' '.join(args)} still running after {timeout} s; it printed:\n{printed[-4000:]}")


def test_node_test_runner_codec_and_live(server_factory: Callable[..., ServerProcess]) -> None:
    plain = server_factory({"Workers": "2"})
    basic = server_factory({"Entitlement": "Basic", "EntitlementAllowToken": "js-secret-token"}, name="basic")
    env = dict(os.environ, MIGRATORY_WS_URL=plain.ws_url, MIGRATORY_BASIC_URL=basic.ws_url)
    result = node("--test", "test/", env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# fail 0" in result.stdout and "# pass 10" in result.stdout, result.stdout[-2000:]


def test_the_same_scenario_gives_the_same_messages_in_python_and_javascript(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory({"Workers": "2"})
    subjects = ["/same/a", "/same/b"]

    async def scenario() -> tuple[list[dict[str, object]], list[dict[str, object]]]:
        async with MigratoryClient([server.ws_url]) as publisher:
            await publisher.publish("/same/a", b"a0", fields={"x": "1"})
            assert NODE is not None
            js = await asyncio.create_subprocess_exec(
                NODE,
                "--experimental-websocket",
                "scenario.mjs",
                server.ws_url,
                "11",
                *subjects,
                cwd=JS,
                stdout=asyncio.subprocess.PIPE,
            )
            assert js.stdout is not None
            early: list[bytes] = []  # the snapshot may be printed before "ready"
            while (line := await asyncio.wait_for(js.stdout.readline(), 30)) and json.loads(line) != {"ready": True}:
                early.append(line)
            python: list[dict[str, object]] = []
            async with MigratoryClient([server.ws_url]) as subscriber:
                await subscriber.subscribe(subjects)
                for n in range(1, 6):
                    for subject in subjects:
                        status = await publisher.publish(subject, f"{subject[-1]}{n}".encode(), fields={"n": str(n)})
                        assert status is Status.OK
                for _ in range(11):
                    m = await subscriber.next_message(10)
                    python.append(
                        {
                            "subject": m.subject,
                            "content": m.content.decode(),
                            "fields": dict(m.fields),
                            "type": m.type.name,
                            "seq": m.seq,
                        }
                    )
            out, _ = await asyncio.wait_for(js.communicate(), 30)
            javascript = [json.loads(line) for line in [*early, *out.splitlines()]][:11]
            return python, javascript

    python, javascript = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert python == javascript
    assert python[0]["type"] == "SNAPSHOT" and len(python) == 11


def test_npm_test_runs_on_its_own_starting_its_servers() -> None:
    """What a JavaScript developer runs first: `npm test` with no servers given starts two itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIGRATORY_")}
    env["MIGRATORY_BIN"] = str(Path(sys.executable).with_name("migratory"))
    result = node("--test", "test/", env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# fail 0" in result.stdout and "# pass 10" in result.stdout and "# skipped 0" in result.stdout


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed")
def test_npm_pack_gives_the_package_the_docs_install(tmp_path: Path) -> None:
    """docs/clients.md: `npm pack` in clients/js, then `npm install` of the tarball, then import it by name."""
    npm = shutil.which("npm")
    assert npm is not None
    packed = subprocess.run(
        [npm, "pack", "--pack-destination", str(tmp_path)], cwd=JS, capture_output=True, text=True, timeout=120
    )
    assert packed.returncode == 0, packed.stderr[-2000:]
    tarball = tmp_path / packed.stdout.strip().splitlines()[-1]
    app = tmp_path / "app"
    app.mkdir()
    (app / "package.json").write_text('{"name": "app", "version": "1.0.0", "type": "module"}\n')
    installed = subprocess.run(
        [npm, "install", "--offline", "--no-audit", "--no-fund", str(tarball)],
        cwd=app,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert installed.returncode == 0, installed.stderr[-2000:]
    (app / "use.mjs").write_text(
        'import { MigratoryClient, Status } from "@migratory/client";\n'
        "console.log(typeof MigratoryClient, Status.OK !== undefined);\n"
    )
    assert NODE is not None
    used = subprocess.run([NODE, "use.mjs"], cwd=app, capture_output=True, text=True, timeout=60)
    assert used.returncode == 0 and used.stdout.strip() == "function true", used.stdout + used.stderr
    assert (app / "node_modules" / "@migratory" / "client" / "migratory.d.ts").exists()


def test_an_mqtt_publication_reaches_the_javascript_client(server_factory: Callable[..., ServerProcess]) -> None:
    """MQTT is a session protocol beside the native one: an MQTT 5 publication (paho), its user properties as
    fields, reaches the JavaScript client (docs/mqtt.md)."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    from tests.conftest import free_port

    port = free_port()
    server = server_factory({"ListenMqtt": f"127.0.0.1:{port}"})
    assert NODE is not None
    js = subprocess.Popen(
        [NODE, "--experimental-websocket", "scenario.mjs", server.ws_url, "1", "/from/mqtt"],
        cwd=JS,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert js.stdout is not None
    assert json.loads(js.stdout.readline()) == {"ready": True}
    publisher = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="to-js", protocol=mqtt.MQTTv5)
    publisher.connect("127.0.0.1", port)
    publisher.loop_start()
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = [("price", "10.5")]
    publisher.publish("from/mqtt", b"hello js", qos=1, properties=props).wait_for_publish(10)
    publisher.loop_stop()
    out, _ = js.communicate(timeout=30)
    message = json.loads(out.splitlines()[0])
    assert (message["subject"], message["content"], message["fields"]) == ("/from/mqtt", "hello js", {"price": "10.5"})


_LEAVE_A_HUNG_SERVER = """
import { EventKind, MigratoryClient } from "./migratory.js";
const [hung, other] = process.argv.slice(1);
const ups = [];
const client = new MigratoryClient([`1000 ${hung}`, `1 ${other}`], {
  backoffInitial: 100,
  onStatus: (e) => { if (e.kind === EventKind.NOTIFY_SERVER_UP) ups.push([e.detail, Date.now()]); },
});
await client.connect();
console.log(JSON.stringify({ first: client.server }));
process.stdin.once("data", () => {
  const stopped = Date.now();
  const timer = setInterval(() => {
    const moved = ups.find(([url, t]) => url === other && t >= stopped);
    if (moved || Date.now() - stopped > 15000) {
      console.log(JSON.stringify({ moved: Boolean(moved), after_ms: moved ? moved[1] - stopped : null }));
      clearInterval(timer);
      client.close();
      process.exit(0);
    }
  }, 50);
});
"""


def test_both_clients_leave_a_server_that_stops_talking(server_factory: Callable[..., ServerProcess]) -> None:
    """Protocol version 3 (issue 48): a server that promised a keep-alive (ServerKeepAlive) and is then SIGSTOPped
    closes nothing; the Python and the JavaScript clients take its silence for a hang and connect to the other
    server of their list while it is still stopped."""
    import signal
    import time

    from migratory.client import EventKind

    hung = server_factory({"ServerKeepAlive": "1000"}, name="hung")
    other = server_factory({"ServerKeepAlive": "1000"}, name="other")
    assert NODE is not None
    js = subprocess.Popen(
        [
            NODE,
            "--experimental-websocket",
            "--input-type=module",
            "-e",
            _LEAVE_A_HUNG_SERVER,
            hung.ws_url,
            other.ws_url,
        ],
        cwd=JS,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert js.stdout is not None and js.stdin is not None
        assert json.loads(js.stdout.readline())["first"] == hung.ws_url

        async def python_side() -> float:
            ups: list[tuple[str, float]] = []

            def status(event: object) -> None:
                if getattr(event, "kind", None) is EventKind.NOTIFY_SERVER_UP:
                    ups.append((str(getattr(event, "detail", "")), time.monotonic()))

            client = MigratoryClient(
                [(hung.ws_url, 1000.0), (other.ws_url, 1.0)], on_status=status, backoff_initial=0.1
            )
            while True:
                await client.connect()
                if client.server == hung.ws_url:
                    break
                await client.close()
                client = MigratoryClient(
                    [(hung.ws_url, 1000.0), (other.ws_url, 1.0)], on_status=status, backoff_initial=0.1
                )
            await client.subscribe(["/ka/s"])
            os.killpg(hung.proc.pid, signal.SIGSTOP)  # the whole server, every worker: nothing answers, nothing closes
            js.stdin.write("go\n")  # type: ignore[union-attr]
            js.stdin.flush()  # type: ignore[union-attr]
            stopped = time.monotonic()
            while time.monotonic() - stopped < 15 and not any(u == other.ws_url and t > stopped for u, t in ups):
                await asyncio.sleep(0.05)
            moved = [t - stopped for u, t in ups if u == other.ws_url and t > stopped]
            await client.close()
            assert moved, "the Python client waited on the stopped server"
            return moved[0]

        python_after = asyncio.run(python_side())
        outcome = json.loads(js.stdout.readline())
        assert outcome["moved"], "the JavaScript client waited on the stopped server"
        # both left while the server was still stopped (it stays stopped until here), well before the 20 s the
        # websockets library's own pings would have taken
        assert python_after < 15 and outcome["after_ms"] < 15000
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(hung.proc.pid, signal.SIGCONT)
        js.kill()
        js.wait()
