"""Live reload (issue 34): SIGHUP applies what can change without dropping a connection, refuses the rest
with one line naming the key, and `migratory config check --diff OLD NEW` says which kind each change is."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

from migratory.client import MigratoryClient
from migratory.config import Config
from migratory.protocol import Status
from migratory.reload import diff, merged
from tests.conftest import free_port, start_server

OLD_TOKEN = "old-token-0123456789"
NEW_TOKEN = "new-token-9876543210"


def test_the_verdicts_of_a_reload() -> None:
    old = Config.from_text("Listen = 127.0.0.1:8800\nEntitlement = Basic\nEntitlementAllowToken = a\n", "o.conf")
    new = Config.from_text(
        "Listen = 127.0.0.1:8801\nEntitlement = Basic\nEntitlementAllowToken = b\nLogLevel = DEBUG\n", "n.conf"
    )
    assert {(c.key, c.live) for c in diff(old, new)} == {
        ("Listen", False),
        ("EntitlementAllowToken", True),
        ("LogLevel", True),
    }
    config, applied, refused = merged(old, new)
    assert config.entitlement_allow_token == "b" and config.log_level.value == "DEBUG"
    assert config.listen == old.listen  # refused: the node keeps its old value
    assert [c.key for c in refused] == ["Listen"] and len(applied) == 2


def test_config_check_diff_names_each_change_and_its_kind(tmp_path: Path) -> None:
    base = f"LogFolder = {tmp_path}/l\nStateFolder = {tmp_path}/s\nEntitlement = Basic\n"
    (tmp_path / "old.conf").write_text(base + f"Listen = 127.0.0.1:{free_port()}\nEntitlementAllowToken = a\n")
    (tmp_path / "new.conf").write_text(
        base + f"Listen = 127.0.0.1:{free_port()}\nEntitlementAllowToken = b\nMaxPendingOutput = 8MB\n"
    )
    command = [sys.executable, "-m", "migratory_cli.main", "config", "check"]
    done = subprocess.run(
        [*command, "--diff", str(tmp_path / "old.conf"), str(tmp_path / "new.conf")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "Listen: restart: the running node keeps the old value" in lines
    assert "EntitlementAllowToken: reload: SIGHUP applies it" in lines
    assert "MaxPendingOutput: reload: SIGHUP applies it" in lines
    assert " a\n" not in done.stdout and "b" not in "".join(line.split(":")[1] for line in lines[1:])  # no values


def test_sighup_applies_a_new_token_and_keeps_connections_and_the_listeners(tmp_path: Path) -> None:
    extra = {"Workers": "2", "Entitlement": "Basic", "EntitlementAllowToken": OLD_TOKEN}
    server = start_server(tmp_path / "srv", extra)
    try:

        async def scenario() -> None:
            async with MigratoryClient([server.ws_url]) as subscriber:
                await subscriber.subscribe(["/reload/x"])
                async with MigratoryClient([server.ws_url], token=OLD_TOKEN) as before:
                    assert await before.publish("/reload/x", b"before") is Status.OK
                assert (await subscriber.next_message(10)).content == b"before"
                text = server.conf.read_text()
                text = text.replace(OLD_TOKEN, NEW_TOKEN)
                text = text.replace(f"Listen = 127.0.0.1:{server.port}", f"Listen = 127.0.0.1:{free_port()}")
                server.conf.write_text(text + "LogLevel = DEBUG\n")
                server.proc.send_signal(signal.SIGHUP)
                log = server.log_folder / "server.log"
                deadline = time.monotonic() + 20
                while "SIGHUP: configuration reloaded" not in log.read_text() and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(0.5)  # every worker took it, not only the one that says so
                for _ in range(4):  # new connections land on either worker
                    async with MigratoryClient([server.ws_url], token=OLD_TOKEN) as old:
                        assert await old.publish("/reload/x", b"old") is Status.DENIED
                    async with MigratoryClient([server.ws_url], token=NEW_TOKEN) as new:
                        assert await new.publish("/reload/x", b"new") is Status.OK
                    assert (await subscriber.next_message(10)).content == b"new"  # never disconnected

        asyncio.run(asyncio.wait_for(scenario(), 90))
        text = (server.log_folder / "server.log").read_text()
        refused = [line for line in text.splitlines() if "Listen changed, but a running node cannot change it" in line]
        assert len(refused) == 1, text[-3000:]  # one line for the node, naming the key
        assert "EntitlementAllowToken" in text and "LogLevel" in text
        assert "Traceback" not in text
    finally:
        server.stop()
