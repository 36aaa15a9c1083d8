"""Pipelined publishing (issue 50 item 3): ``MigratoryClient.publish_all`` and ``migratory publish-file``,
against a real server, every acknowledged publication looked for at a subscriber."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from migratory_cli.client_cmds import message_json

from migratory.client import ClientMessage, MigratoryClient, Publication, PublishResult
from migratory.protocol import Status
from tests.conftest import ServerProcess

CLI = [sys.executable, "-m", "migratory_cli.main"]
SUBJECTS = [f"/window/s{i}" for i in range(20)]


def cli(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, input=stdin)


class CountingClient(MigratoryClient):
    """Records how many publications awaited their status each time one was sent."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.outstanding: list[int] = []

    async def _send(self, data: bytes) -> None:
        self.outstanding.append(len(self._pending.publishes))
        await super()._send(data)


async def _collect(
    url: str, subjects: list[str], count: int
) -> tuple[MigratoryClient, asyncio.Task[list[ClientMessage]]]:
    sub = MigratoryClient([url])
    await sub.connect()
    assert set((await sub.subscribe(subjects)).values()) == {Status.OK}

    async def gather() -> list[ClientMessage]:
        got: list[ClientMessage] = []
        while len(got) < count:
            got.append(await sub.next_message(timeout=30))
        return got

    return sub, asyncio.create_task(gather())


def test_publish_all_keeps_a_window_and_every_result_reaches_the_subscriber(server: ServerProcess) -> None:
    total, window = 2000, 16

    async def scenario() -> tuple[list[PublishResult], list[ClientMessage], list[int]]:
        sub, gathering = await _collect(server.ws_url, SUBJECTS, total)
        pub = CountingClient([server.ws_url])
        await pub.connect()
        items = [Publication(SUBJECTS[i % len(SUBJECTS)], f"{i}", {"n": str(i)}) for i in range(total)]
        results = [r async for r in pub.publish_all(items, window=window)]
        got = await gathering
        await pub.close()
        await sub.close()
        return results, got, pub.outstanding

    results, got, outstanding = asyncio.run(scenario())
    assert len(results) == total
    assert sorted(r.index for r in results) == list(range(total))
    assert {r.status for r in results} == {Status.OK}
    assert all(r.attempts == 1 and r.ok for r in results)
    assert len({r.publish_id for r in results}) == total
    assert max(outstanding) == window  # the window was filled (this one included), never exceeded
    by_subject: dict[str, list[int]] = {}
    for message in got:
        by_subject.setdefault(message.subject, []).append(int(message.content))
    for subject, numbers in by_subject.items():
        assert numbers == sorted(numbers), f"{subject} out of order"
    assert sorted(n for numbers in by_subject.values() for n in numbers) == list(range(total))


def test_publish_all_gives_each_publication_its_own_status_and_honours_the_rate(server: ServerProcess) -> None:
    async def scenario() -> tuple[list[PublishResult], float]:
        pub = MigratoryClient([server.ws_url])
        await pub.connect()
        pub.max_message_size = 1000  # as a server announcing MessageSizeLimit 1000 would
        items = [
            Publication("/window/ok", "a"),
            Publication("bad subject", "b"),
            Publication("/window/big", b"x" * 2000),
            Publication("/window/ok", "c", publish_id="mine-1"),
        ] * 10
        loop = asyncio.get_running_loop()
        started = loop.time()
        results = [r async for r in pub.publish_all(items, window=4, rate=100)]
        elapsed = loop.time() - started
        await pub.close()
        return results, elapsed

    results, elapsed = asyncio.run(scenario())
    by_index = {r.index: r for r in results}
    assert sorted(by_index) == list(range(40))
    kinds = [by_index[i].status for i in range(4)]
    assert kinds[0] in (Status.OK, Status.NO_SUBSCRIBER)
    assert kinds[1] is Status.INVALID_SUBJECT and not by_index[1].ok
    assert kinds[2] is Status.TOO_LARGE and "MessageSizeLimit" in by_index[2].reason
    assert by_index[3].publish_id == "mine-1"
    assert elapsed >= 0.35  # 40 publications at 100/s are spread over about 0.4 s, not sent at once


def test_publish_all_ends_with_failed_results_when_the_server_dies(
    server_factory: Callable[..., ServerProcess],
) -> None:
    server = server_factory()

    async def scenario() -> list[PublishResult]:
        pub = MigratoryClient([server.ws_url], reconnect=False, request_timeout=5)
        await pub.connect()

        def items() -> object:
            for i in range(100_000):
                if i == 500:
                    server.stop(signal.SIGKILL)
                yield Publication("/window/die", str(i))

        results = [r async for r in pub.publish_all(items(), window=32, rate=0)]  # type: ignore[arg-type]
        await pub.close()
        return results

    results = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert len(results) == 100_000  # every publication answered, none waited for forever
    assert all(r.ok for r in results if r.index < 400)
    assert results[-1].status is Status.FAILED
    assert {r.status for r in results if not r.ok} == {Status.FAILED}


def test_publish_file_replays_a_subscribe_capture(server: ServerProcess, tmp_path: Path) -> None:
    lines = [json.dumps({"subject": SUBJECTS[i % 5], "content": f"m{i}", "fields": {"i": str(i)}}) for i in range(300)]
    lines.insert(7, "")  # blank lines are skipped
    lines.append(json.dumps({"subject": "/window/bin", "content_base64": "AAEC", "retained": False}))
    path = tmp_path / "messages.jsonl"
    path.write_text("\n".join(lines) + "\n")

    async def scenario() -> tuple[subprocess.CompletedProcess[str], list[ClientMessage]]:
        sub, gathering = await _collect(server.ws_url, [*SUBJECTS[:5], "/window/bin"], 301)
        args = ["publish-file", server.ws_url, str(path), "--window", "32", "--rate", "2000"]
        done = await asyncio.to_thread(cli, *args)
        got = await gathering
        await sub.close()
        return done, got

    done, got = asyncio.run(scenario())
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("published 301 in "), done.stdout
    assert "OK 301" in done.stdout
    assert [m.content for m in got if m.subject != "/window/bin"] == [f"m{i}".encode() for i in range(300)]
    assert [(m.content, m.retained) for m in got if m.subject == "/window/bin"] == [(b"\x00\x01\x02", False)]
    assert got[0].fields == {"i": "0"}
    # what `subscribe --json` prints replays as it is: each line's result on stdout with --json
    replay = tmp_path / "capture.jsonl"
    replay.write_text("".join(json.dumps(message_json(m)) + "\n" for m in got))
    again = cli("publish-file", server.ws_url, str(replay), "--json")
    assert again.returncode == 0, again.stderr
    results = [json.loads(line) for line in again.stdout.splitlines()]
    assert sorted(r["line"] for r in results) == list(range(1, 302))
    assert {r["status"] for r in results} == {"NO_SUBSCRIBER"}
    assert "published 301" in again.stderr
    snapshot = cli("snapshot", server.http_url, SUBJECTS[4], "--json")
    assert json.loads(snapshot.stdout)["content"] == "m299"


def test_publish_file_refuses_a_bad_file_before_sending_anything(server: ServerProcess, tmp_path: Path) -> None:
    good = json.dumps({"subject": "/window/never", "content": "x"})
    cases = {
        "not json": "{nope",
        "fields": json.dumps({"subject": "/window/never", "content": "x", "fields": {"a": 1}}),
        "content": json.dumps({"subject": "/window/never"}),
        "content_base64": json.dumps({"subject": "/window/never", "content_base64": "%%%"}),
        "retained": json.dumps({"subject": "/window/never", "content": "x", "retained": "yes"}),
        "subject": json.dumps({"content": "x"}),
    }
    for key, bad in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(f"{good}\n{good}\n{bad}\n{good}\n")
        done = cli("publish-file", server.ws_url, str(path))
        assert done.returncode == 2, (key, done.stdout, done.stderr)
        expected_key = "line" if key == "not json" else key
        assert done.stderr.startswith(f"error: {path}:3: {expected_key}: "), done.stderr
        assert "Traceback" not in done.stderr
    snapshot = cli("snapshot", server.http_url, "/window/never")
    assert snapshot.returncode == 1  # nothing of the bad files was published
    missing = cli("publish-file", server.ws_url, str(tmp_path / "absent.jsonl"))
    assert missing.returncode == 2 and "absent.jsonl" in missing.stderr
    http = cli("publish-file", server.http_url, str(path))
    assert http.returncode == 2 and "ws://" in http.stderr
    window = cli("publish-file", server.ws_url, str(path), "--window", "0")
    assert window.returncode == 2 and "--window" in window.stderr


def test_publish_file_from_stdin_stops_at_a_bad_line_after_what_came_before(server: ServerProcess) -> None:
    first = json.dumps({"subject": "/window/stdin", "content": "before"})
    done = cli("publish-file", server.ws_url, "-", stdin=f"{first}\n[1, 2]\n{first}\n")
    assert done.returncode == 2, done.stderr
    assert "error: <stdin>:2: line: not a JSON object (stopped there)" in done.stderr
    assert "published 1 in " in done.stdout
    snapshot = cli("snapshot", server.http_url, "/window/stdin")
    assert snapshot.returncode == 0 and snapshot.stdout == "before"
