"""The `migratory` client commands against a real server."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ServerProcess

CLI = [sys.executable, "-m", "migratory_cli.main"]


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_publish_subscribe_snapshot_commands(server: ServerProcess) -> None:
    first = cli("publish", server.ws_url, "/c/l", "first", "--field", "k=v")
    assert first.stdout.strip() == "NO_SUBSCRIBER", first.stderr
    sub = subprocess.Popen(
        [*CLI, "subscribe", server.ws_url, "/c/l", "--json", "--count", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert sub.stdout is not None
        snapshot_line = sub.stdout.readline()  # subscribed: the snapshot came first
        assert cli("publish", server.ws_url, "/c/l", "second").stdout.strip() == "OK"
        assert cli("publish", server.http_url, "/c/l", "thïrd", "-f", "x=1").stdout.strip() == "OK"
        rest, err = sub.communicate(timeout=20)
    finally:
        sub.kill()
    out = snapshot_line + rest
    lines = [json.loads(line) for line in out.splitlines()]
    assert [m["type"] for m in lines] == ["SNAPSHOT", "UPDATE", "UPDATE"], err
    assert [m["content"] for m in lines] == ["first", "second", "thïrd"]
    assert lines[0]["fields"] == {"k": "v"} and lines[2]["fields"] == {"x": "1"}
    assert cli("snapshot", server.http_url, "/c/l").stdout == "thïrd"
    document = json.loads(cli("snapshot", server.ws_url, "/c/l", "--json").stdout)
    assert document["fields"] == {"k": "v", "x": "1"} and document["seq"] == 3


def test_command_errors(server: ServerProcess) -> None:
    missing = cli("snapshot", server.http_url, "/no/snapshot")
    assert missing.returncode == 1 and "404" in missing.stderr
    invalid = cli("publish", server.ws_url, "/bad", "x")
    assert invalid.returncode == 1 and invalid.stdout.strip() == "INVALID_SUBJECT"
    bad_field = cli("publish", server.ws_url, "/a/b", "x", "--field", "novalue")
    assert bad_field.returncode == 2


def test_help_lists_every_command() -> None:
    out = cli("--help").stdout
    for command in ("serve", "config", "publish", "subscribe", "snapshot"):
        assert command in out
