"""``migratory publish-file``: publish a file of messages, pipelined, at a rate or as fast as a window allows.

The file holds one JSON object per line, the form ``migratory subscribe --json`` prints,
so a captured stream replays as it is::

    {"subject": "/Stocks/NYSE/IBM", "content": "193", "fields": {"volume": "6.62M"}}
    {"subject": "/Stocks/NYSE/IBM", "content_base64": "AAEC", "retained": false}

Keys: ``subject`` (required), ``content`` (UTF-8 text) or ``content_base64``, and optional
``fields`` (an object of strings), ``retained`` and ``guaranteed`` (booleans), ``publish_id``
(a string: sending the same file again with ids keeps a cluster from numbering it twice).
Other keys (``type``, ``seq``, ``epoch`` of a capture) are ignored; blank lines are skipped.

A regular file is checked whole before anything is sent: a bad line is
``file:line: key: what is wrong`` and exit 2 with nothing published. From stdin (``-``)
lines are checked as they come; a bad one stops the sending, what was sent is waited
for, and the exit is 2.
"""

from __future__ import annotations

import base64
import binascii
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import typer

from migratory.client import Publication, PublishResult

from .client_cmds import (
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_USAGE,
    SERVERS_HELP,
    CliError,
    _err,
    _fail,
    _open,
    _run,
    _say_failover,
    _servers,
    _ws_url,
)

__all__ = ["BadLine", "publications", "register"]


class BadLine(Exception):
    """A line of a publication file that is not a publication: ``file:line: key: what is wrong``."""

    def __init__(self, source: str, line: int, key: str, problem: str) -> None:
        super().__init__(f"{source}:{line}: {key}: {problem}")
        self.line = line


def _publication(document: Any, source: str, line: int) -> Publication:
    if not isinstance(document, dict):
        raise BadLine(source, line, "line", "not a JSON object")
    subject = document.get("subject")
    if not isinstance(subject, str) or not subject:
        raise BadLine(source, line, "subject", "missing or not a non-empty string")
    if "content_base64" in document:
        encoded = document["content_base64"]
        if not isinstance(encoded, str):
            raise BadLine(source, line, "content_base64", "not a string")
        try:
            content: bytes | str = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise BadLine(source, line, "content_base64", "not valid base64") from None
    else:
        text = document.get("content")
        if not isinstance(text, str):
            raise BadLine(source, line, "content", "missing or not a string (use content_base64 for bytes)")
        content = text
    fields = document.get("fields") or {}
    if not isinstance(fields, dict) or not all(isinstance(v, str) for v in fields.values()):
        raise BadLine(source, line, "fields", "not an object of strings")
    flags: dict[str, bool] = {}
    for key, default in (("retained", True), ("guaranteed", False)):
        value = document.get(key, default)
        if not isinstance(value, bool):
            raise BadLine(source, line, key, f"not true or false: {value!r}")
        flags[key] = value
    publish_id = document.get("publish_id")
    if publish_id is not None and (not isinstance(publish_id, str) or not publish_id):
        raise BadLine(source, line, "publish_id", "not a non-empty string")
    return Publication(subject, content, fields or None, flags["retained"], flags["guaranteed"], publish_id)


def publications(stream: IO[str], source: str) -> Iterator[tuple[int, Publication]]:
    """``(line number, publication)`` for each non-blank line; :class:`BadLine` at the first bad one."""
    for number, text in enumerate(stream, start=1):
        if not text.strip():
            continue
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise BadLine(source, number, "line", f"not JSON ({exc})") from None
        yield number, _publication(document, source, number)


def publish_file(
    url: str = typer.Argument(..., help=SERVERS_HELP + " ws:// or wss://."),
    path: str = typer.Argument(..., help="A file of JSON lines (subject, content, fields, ...); '-' reads stdin."),
    window: int = typer.Option(64, "--window", help="Publications awaiting their status at once (1: one by one)."),
    rate: float = typer.Option(0.0, "--rate", help="Publications per second (0: as fast as the window allows)."),
    retries: int = typer.Option(-1, "--retries", help="Times a FAILED one is sent again (-1: 5 with a list, else 0)."),
    token: str = typer.Option("", "--token", help="Entitlement token."),
    as_json: bool = typer.Option(False, "--json", help="One JSON line per result: line, subject, status, ..."),
) -> None:
    """Publish every message of a file, pipelined; print a summary (exit 1 unless all OK or NO_SUBSCRIBER)."""
    try:
        servers = _servers(url)
        first = servers[0][1]
        if first.startswith(("http://", "https://")):
            raise CliError(EXIT_USAGE, first, "publish-file needs ws:// or wss:// (it keeps one connection)")
        ws_url = _ws_url(first)
        for name, value, least in (("--window", window, 1), ("--retries", retries, -1)):
            if value < least:
                raise CliError(EXIT_USAGE, url, f"{name} must be {least} or more, got {value}")
        if rate < 0:
            raise CliError(EXIT_USAGE, url, f"--rate must be 0 or more, got {rate:g}")
    except CliError as error:
        _fail(error)
    source = "<stdin>" if path == "-" else path
    if path != "-":
        try:
            with open(path, encoding="utf-8") as stream:
                for _ in publications(stream, source):
                    pass
        except BadLine as error:
            _err.print(f"error: {error}", markup=False)
            raise typer.Exit(EXIT_USAGE) from None
        except (OSError, UnicodeDecodeError) as exc:
            _err.print(f"error: {source}: {getattr(exc, 'strerror', None) or exc}", markup=False)
            raise typer.Exit(EXIT_USAGE) from None
    tries = retries if retries >= 0 else (5 if len(servers) > 1 else 0)
    counts, bad = _run(first, _publish_file(ws_url, servers, path, source, window, rate, tries, token, as_json))
    if bad is not None:
        _err.print(f"error: {bad} (stopped there)", markup=False)
        raise typer.Exit(EXIT_USAGE)
    if any(status not in ("OK", "NO_SUBSCRIBER") for status in counts):
        raise typer.Exit(EXIT_FAILED)


async def _publish_file(
    url: str,
    servers: list[tuple[float, str]],
    path: str,
    source: str,
    window: int,
    rate: float,
    retries: int,
    token: str,
    as_json: bool,
) -> tuple[dict[str, int], BadLine | None]:
    listed = len(servers) > 1
    client = await _open(url, token, reconnect=False, servers=servers, on_status=_say_failover if listed else None)
    stream = sys.stdin if path == "-" else Path(path).open(encoding="utf-8")  # noqa: SIM115 (closed below)
    lines: dict[int, int] = {}  # index of a publication in flight -> its line
    bad: BadLine | None = None

    def numbered() -> Iterator[Publication]:
        nonlocal bad
        try:
            for index, (line, publication) in enumerate(publications(stream, source)):
                lines[index] = line
                yield publication
        except BadLine as error:
            bad = error
        except UnicodeDecodeError as exc:
            bad = BadLine(source, len(lines) + 1, "line", f"not UTF-8 ({exc.reason})")

    counts: dict[str, int] = {}
    started = time.monotonic()
    try:
        async for result in client.publish_all(numbered(), window=window, rate=rate, retries=retries):
            _report(result, lines.pop(result.index), source, as_json)
            counts[result.status.name] = counts.get(result.status.name, 0) + 1
    finally:
        if stream is not sys.stdin:
            stream.close()
        await client.close()
    elapsed = time.monotonic() - started
    total = sum(counts.values())
    summary = ", ".join(f"{name} {count}" for name, count in sorted(counts.items()))
    speed = f" ({total / elapsed:,.0f}/s)" if elapsed > 0 and total else ""
    line = f"published {total} in {elapsed:.2f} s{speed}: {summary or 'nothing'}"
    if as_json:  # stdout holds only the results' lines
        _err.print(line, markup=False)
    else:
        print(line, flush=True)
    return counts, bad


def _report(result: PublishResult, line: int, source: str, as_json: bool) -> None:
    """One result: a JSON line on stdout with ``--json``; otherwise only what did not succeed, on stderr."""
    if as_json:
        document = {
            "line": line,
            "subject": result.publication.subject,
            "status": result.status.name,
            "publish_id": result.publish_id,
            "attempts": result.attempts,
        }
        if not result.ok:
            document["reason"] = result.reason
        print(json.dumps(document, ensure_ascii=False), flush=False)
    elif not result.ok:
        reason = f": {result.reason}" if result.reason else ""
        _err.print(f"{source}:{line}: {result.publication.subject}: {result.status.name}{reason}", markup=False)


def register(app: typer.Typer) -> None:
    """Attach ``publish-file`` to ``app``."""
    app.command("publish-file", epilog=EXIT_CODES_HELP)(publish_file)
