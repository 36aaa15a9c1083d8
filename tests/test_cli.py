"""The `migratory` client commands against a real server."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ServerProcess, free_port

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


# --- the common mistakes: one line naming the URL and the cause, a distinct exit code, at once ----------

DOWN = f"127.0.0.1:{free_port()}"  # nothing listens there

CLI_MISTAKES: list[tuple[str, list[str], int, str]] = [
    # (name, arguments, exit code, words the one line must contain)
    ("server down (ws)", ["publish", f"ws://{DOWN}", "/a/b", "x"], 3, "connection refused"),
    ("server down (subscribe)", ["subscribe", f"ws://{DOWN}", "/a/b"], 3, "connection refused"),
    ("server down (http publish)", ["publish", f"http://{DOWN}", "/a/b", "x"], 3, "connection refused"),
    ("server down (snapshot)", ["snapshot", f"http://{DOWN}", "/a/b"], 3, "connection refused"),
    ("no scheme", ["publish", DOWN, "/a/b", "x"], 2, "must start with ws://"),
    ("no scheme (subscribe)", ["subscribe", "localhost:8800", "/a/b"], 2, "must start with ws://"),
    ("no scheme (snapshot)", ["snapshot", DOWN, "/a/b"], 2, "must start with ws://"),
    ("wrong scheme", ["subscribe", "ftp://127.0.0.1/", "/a/b"], 2, "must start with ws://"),
    ("unresolvable host", ["publish", "ws://no-such-host.invalid:8800", "/a/b", "x"], 3, "cannot resolve host"),
    ("unresolvable host (snapshot)", ["snapshot", "http://no-such-host.invalid", "/a/b"], 3, "cannot resolve"),
    ("port 99999", ["publish", "ws://127.0.0.1:99999", "/a/b", "x"], 2, "port"),
    ("port 99999 (subscribe)", ["subscribe", "ws://127.0.0.1:99999", "/a/b"], 2, "port"),
    ("port 99999 (snapshot)", ["snapshot", "http://127.0.0.1:99999", "/a/b"], 2, "port"),
    ("port not a number", ["publish", "ws://127.0.0.1:80x", "/a/b", "x"], 2, "port"),
    ("no host", ["snapshot", "http://:8800", "/a/b"], 2, "no host"),
    ("negative conflation", ["subscribe", f"ws://{DOWN}", "/a/b", "--conflation", "-5"], 2, "--conflation"),
    ("negative count", ["subscribe", f"ws://{DOWN}", "/a/b", "--count", "-1"], 2, "--count"),
    ("field without =", ["publish", f"ws://{DOWN}", "/a/b", "x", "--field", "novalue"], 2, "--field"),
]


@pytest.mark.parametrize(("args", "code", "words"), [m[1:] for m in CLI_MISTAKES], ids=[m[0] for m in CLI_MISTAKES])
def test_common_mistakes_get_one_line_and_an_exit_code(args: list[str], code: int, words: str) -> None:
    started = time.monotonic()
    result = cli(*args, "--token", "s3cret-token")
    elapsed = time.monotonic() - started
    assert result.returncode == code, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    (line,) = lines
    assert line.startswith(f"error: {args[1]}") and words in line, line
    assert "s3cret-token" not in line  # the token never reaches the terminal
    assert result.stdout == ""
    assert elapsed < 8, elapsed  # before: a 10 s wait, then a traceback


def test_a_refused_connection_fails_at_once() -> None:
    """The client is not left retrying until its timeout: the first NOTIFY_SERVER_DOWN ends the command."""
    for command in (["publish", f"ws://{DOWN}", "/a/b", "x"], ["subscribe", f"ws://{DOWN}", "/a/b"]):
        started = time.monotonic()
        result = cli(*command)
        assert result.returncode == 3
        assert time.monotonic() - started < 5  # the interpreter's start included; about 0.6 s on an idle machine


class _FakeServer:
    """A TCP server on 127.0.0.1 that answers every connection with fixed bytes, then closes."""

    def __init__(self, answer: bytes) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.answer = answer
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.sendall(self.answer)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", "503"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "not a MigratoryData"),
        (b"", ""),
    ],
    ids=["upgrade answered 503", "not HTTP", "closed at once"],
)
def test_a_server_that_refuses_is_exit_4(answer: bytes, words: str) -> None:
    fake = _FakeServer(answer)
    try:
        url = f"ws://127.0.0.1:{fake.port}"
        for command in (["publish", url, "/a/b", "x"], ["subscribe", url, "/a/b"]):
            result = cli(*command)
            assert result.returncode == 4, result.stderr
            (line,) = result.stderr.splitlines()
            assert line.startswith(f"error: {url}: ") and words in line, line
        http_url = f"http://127.0.0.1:{fake.port}"
        for command in (["publish", http_url, "/a/b", "x"], ["snapshot", http_url, "/a/b"]):
            result = cli(*command)
            assert result.returncode == 4, result.stderr
            (line,) = result.stderr.splitlines()
            assert line.startswith(f"error: {http_url}/") and words in line, line
    finally:
        fake.close()


def test_http_errors_name_the_url(server: ServerProcess) -> None:
    missing = cli("snapshot", server.http_url, "/no/snapshot", "--token", "s3cret")
    assert missing.returncode == 1
    assert missing.stderr.strip() == f"error: {server.http_url}/snapshot: HTTP 404: no snapshot for /no/snapshot"
    invalid = cli("publish", server.http_url, "/bad", "x")
    assert invalid.returncode == 1 and invalid.stdout.strip() == "INVALID_SUBJECT"
    assert invalid.stderr.startswith(f"error: {server.http_url}/publish: HTTP 400: ")
    # a URL with a path that is no endpoint: the server refuses the request itself
    wrong = cli("publish", server.http_url + "/nothing", "/a/b", "x")
    assert wrong.returncode == 4 and wrong.stdout == ""
    assert (
        wrong.stderr.strip()
        == f"error: {server.http_url}/nothing/publish: HTTP 404: no such endpoint: /nothing/publish"
    )
    wrong = cli("snapshot", server.ws_url + "/nothing", "/a/b")
    assert wrong.returncode == 4
    assert wrong.stderr.startswith(f"error: {server.http_url}/nothing/snapshot: HTTP 404: no such endpoint")
    # an over-size HTTP publish is refused before its body is read: still the TOO_LARGE status, exit 1
    big = subprocess.run(
        [*CLI, "publish", server.http_url, "/a/b", "-"], input="x" * 200_000, capture_output=True, text=True
    )
    assert big.returncode == 1 and big.stdout.strip() == "TOO_LARGE"
    assert big.stderr.startswith(f"error: {server.http_url}/publish: HTTP 413: ")
    # a token in the URL is not shown
    token = cli("publish", server.ws_url + "?token=%ff-s3cret", "/a/b", "x")
    assert token.returncode == 4 and "s3cret" not in token.stderr
    assert token.stderr.startswith(f"error: {server.ws_url}: refused by the server")


def test_help_names_the_exit_codes() -> None:
    for command in ("publish", "subscribe", "snapshot"):
        out = cli(command, "--help").stdout
        assert "Exit codes" in out and "cannot connect" in out and "refused by the" in out


def test_cluster_status_says_why_a_member_is_not_ready_and_who_leads() -> None:
    from migratory_cli.cluster_cmd import status_table
    from rich.console import Console

    document = {
        "member": 0,
        "mode": "Guaranteed",
        "ready": True,
        "healthy": False,
        "reason": "no quorum: a majority of the seed members is not reachable",
        "quorum": False,
        "leader": 2,
        "term": 7,
        "members": [],
    }
    console = Console(width=200, record=True)
    console.print(status_table(document))
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    assert "quorum NO" in text and "leader member 3, term 7" in text
    assert "this member NOT ready: no quorum: a majority of the seed members is not reachable" in text


@pytest.mark.slow
def test_the_client_commands_follow_a_cluster_through_a_members_death(tmp_path: Path) -> None:
    """Issue 34: subscribe, publish and snapshot take the client libraries' weighted server list, fail over
    when their member dies (the subscriber recovers what it missed: Guaranteed mode), and say so on stderr."""
    from migratory.bench.cluster import LocalCluster

    with LocalCluster(tmp_path, 3, mode="Guaranteed") as cluster:
        cluster.start_all()
        for index in range(3):
            cluster.wait_view(index, {0, 1, 2})
        m = cluster.members
        everyone = ", ".join(f"100 {member.ws_url}" for member in m)
        first = cli("publish", everyone, "/cli/f", "m0")
        assert first.returncode == 0 and first.stdout.strip() in ("OK", "NO_SUBSCRIBER"), first.stderr
        # the subscriber almost surely starts on member 0 (weights), and must go on elsewhere when it dies
        sub = subprocess.Popen(
            [*CLI, "subscribe", f"1000000 {m[0].ws_url}, 1 {m[1].ws_url}, 1 {m[2].ws_url}", "/cli/f", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert sub.stdout is not None
            assert json.loads(sub.stdout.readline())["content"] == "m0"  # the snapshot: subscribed
            for n in range(1, 4):
                assert cli("publish", everyone, "/cli/f", f"m{n}").returncode == 0
            cluster.kill(0)
            survivors = f"{m[1].ws_url}, {m[2].ws_url}"
            for n in range(4, 8):
                published = cli("publish", survivors, "/cli/f", f"m{n}", timeout=60)
                assert published.returncode == 0, published.stdout + published.stderr
            # a dead member first in the list: publish and snapshot try the next one and say so
            dead_first = f"1000000 {m[0].ws_url}, 1 {m[1].ws_url}"
            published = cli("publish", dead_first, "/cli/f", "m8", timeout=60)
            assert published.returncode == 0 and published.stdout.strip() == "OK", published.stderr
            assert "NOTIFY_SERVER_DOWN" in published.stderr
            snap = cli("snapshot", f"1000000 {m[0].http_url}, 1 {m[1].http_url}", "/cli/f", timeout=60)
            assert snap.returncode == 0 and snap.stdout == "m8", snap.stdout + snap.stderr
            assert "connection refused" in snap.stderr and "trying" in snap.stderr
            seen: list[str] = []
            deadline = time.monotonic() + 60
            while "m8" not in seen and time.monotonic() < deadline:
                line = sub.stdout.readline()
                if line:
                    seen.append(json.loads(line)["content"])
        finally:
            sub.terminate()
            _, err = sub.communicate(timeout=20)
        assert seen == [f"m{n}" for n in range(1, 9)], (seen, err)  # none lost, none twice, in order
        assert "NOTIFY_SERVER_DOWN" in err and "NOTIFY_SERVER_UP" in err, err


def test_a_bad_server_list_is_refused_with_exit_code_2() -> None:
    for bad in ("100 ws://a:1,, ws://b:2", "x ws://a:1", "0 ws://a:1", "100 ftp://a:1"):
        done = cli("publish", bad, "/a/b", "x")
        assert done.returncode == 2 and done.stderr.startswith("error: "), (bad, done.stderr)
        assert "Traceback" not in done.stderr
