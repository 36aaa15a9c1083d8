"""``migratory publish|subscribe|snapshot``: the client library from the shell.

URLs may be ``ws://``/``wss://`` (native protocol over WebSocket) or
``http://``/``https://`` (the HTTP endpoints); each command converts as needed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import typer
from rich.console import Console

from migratory.client import ClientMessage, EventKind, MigratoryClient, StatusEvent
from migratory.protocol import Status

__all__ = ["register"]

_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _http_url(url: str) -> str:
    if url.startswith("ws://"):
        return "http://" + url[5:]
    if url.startswith("wss://"):
        return "https://" + url[6:]
    return url


def _ws_url(url: str) -> str:
    if url.startswith("http://"):
        return "ws://" + url[7:]
    if url.startswith("https://"):
        return "wss://" + url[8:]
    return url


def _parse_fields(items: list[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise typer.BadParameter(f"--field takes name=value, got {item!r}")
        fields[name] = value
    return fields


def message_json(message: ClientMessage) -> dict[str, Any]:
    """The JSON line printed by ``subscribe --json`` (documented in docs/protocol.md)."""
    out: dict[str, Any] = {"subject": message.subject}
    try:
        out["content"] = message.content.decode("utf-8")
    except UnicodeDecodeError:
        out["content"] = None
        out["content_base64"] = base64.b64encode(message.content).decode("ascii")
    out.update(
        fields=dict(message.fields),
        type=message.type.name,
        seq=message.seq,
        epoch=message.epoch,
    )
    return out


def publish(
    url: str = typer.Argument(..., help="Server URL: ws://host:port or http://host:port."),
    subject: str = typer.Argument(..., help="Subject, e.g. /Stocks/NYSE/IBM."),
    content: str = typer.Argument(..., help="Message content (UTF-8 text; '-' reads bytes from stdin)."),
    field: list[str] = typer.Option([], "--field", "-f", help="A field name=value; repeat for more."),
    token: str = typer.Option("", "--token", help="Entitlement token."),
    retained: bool = typer.Option(True, "--retained/--no-retained", help="Whether it updates the snapshot."),
) -> None:
    """Publish one message and print the server's publish status (exit 1 unless OK or NO_SUBSCRIBER)."""
    fields = _parse_fields(field)
    data = sys.stdin.buffer.read() if content == "-" else content.encode("utf-8")
    if url.startswith(("http://", "https://")):
        status = _http_publish(url, subject, data, fields, token, retained)
    else:
        status = asyncio.run(_ws_publish(_ws_url(url), subject, data, fields, token, retained))
    typer.echo(status)
    if status not in ("OK", "NO_SUBSCRIBER"):
        raise typer.Exit(1)


def _http_publish(url: str, subject: str, data: bytes, fields: dict[str, str], token: str, retained: bool) -> str:
    query = {"subject": subject, "retained": "true" if retained else "false"}
    if token:
        query["token"] = token
    body, headers = data, {"Content-Type": "application/octet-stream"}
    if fields:
        try:
            text = data.decode("utf-8")
            document: dict[str, Any] = {"subject": subject, "content": text, "fields": fields, "retained": retained}
        except UnicodeDecodeError:
            document = {
                "subject": subject,
                "content_base64": base64.b64encode(data).decode(),
                "fields": fields,
                "retained": retained,
            }
        body, headers = json.dumps(document).encode(), {"Content-Type": "application/json"}
    target = f"{_http_url(url).rstrip('/')}/publish?{urllib.parse.urlencode(query)}"
    request = urllib.request.Request(target, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return str(json.loads(answer.read())["status"])
    except urllib.error.HTTPError as exc:
        payload = json.loads(exc.read() or b"{}")
        _err.print(f"error: HTTP {exc.code}: {payload.get('error', exc.reason)}", markup=False)
        return str(payload.get("status", "FAILED"))
    except OSError as exc:
        _err.print(f"error: {exc}", markup=False)
        raise typer.Exit(1) from None


async def _ws_publish(url: str, subject: str, data: bytes, fields: dict[str, str], token: str, retained: bool) -> str:
    async with MigratoryClient([url], token=token, reconnect=False) as client:
        return (await client.publish(subject, data, fields=fields, retained=retained)).name


def subscribe(
    url: str = typer.Argument(..., help="Server URL: ws://host:port (or wss://)."),
    subjects: list[str] = typer.Argument(..., help="One or more subjects."),
    conflation: int = typer.Option(0, "--conflation", help="Conflation time in ms (cut down to a multiple of 100)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line: subject, content, fields, type."),
    count: int = typer.Option(0, "--count", help="Exit after this many messages (0 = run until interrupted)."),
    token: str = typer.Option("", "--token", help="Entitlement token."),
) -> None:
    """Subscribe and print messages as they arrive (the snapshot first)."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_subscribe(_ws_url(url), subjects, conflation, as_json, count, token))


async def _subscribe(url: str, subjects: list[str], conflation: int, as_json: bool, count: int, token: str) -> None:
    out = Console(highlight=False, soft_wrap=True)

    def on_status(event: StatusEvent) -> None:
        if event.kind in (EventKind.SUBSCRIBE_DENY, EventKind.ERROR, EventKind.NOTIFY_SERVER_DOWN):
            _err.print(f"{event.kind.value}: {event.subject} {event.detail}".replace("  ", " "), markup=False)

    async with MigratoryClient([url], token=token, on_status=on_status) as client:
        statuses = await client.subscribe(subjects, conflation)
        if not any(s == Status.OK for s in statuses.values()):
            raise typer.Exit(1)
        received = 0
        while count == 0 or received < count:
            message = await client.next_message()
            received += 1
            if as_json:
                print(json.dumps(message_json(message), ensure_ascii=False), flush=True)
            else:
                fields = " ".join(f"{k}={v}" for k, v in message.fields.items())
                text = message.content.decode("utf-8", "replace")
                out.print(f"{message.type.name} {message.subject} {text} {fields}".rstrip(), markup=False)


def snapshot(
    url: str = typer.Argument(..., help="Server URL: http://host:port (ws:// is converted)."),
    subject: str = typer.Argument(..., help="The subject whose snapshot to fetch."),
    token: str = typer.Option("", "--token", help="Entitlement token."),
    as_json: bool = typer.Option(False, "--json", help="Print the JSON form (subject, content, fields, seq, epoch)."),
) -> None:
    """Fetch a subject's snapshot over HTTP (exit 1 if there is none or it is refused)."""
    query = {"subject": subject}
    if token:
        query["token"] = token
    target = f"{_http_url(url).rstrip('/')}/snapshot?{urllib.parse.urlencode(query)}"
    headers = {"Accept": "application/json"} if as_json else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(target, headers=headers), timeout=10) as answer:
            body = answer.read()
    except urllib.error.HTTPError as exc:
        try:
            reason = json.loads(exc.read()).get("error", exc.reason)
        except ValueError:
            reason = exc.reason
        _err.print(f"error: HTTP {exc.code}: {reason}", markup=False)
        raise typer.Exit(1) from None
    except OSError as exc:
        _err.print(f"error: {exc}", markup=False)
        raise typer.Exit(1) from None
    sys.stdout.buffer.write(body + (b"\n" if as_json else b""))
    sys.stdout.flush()


def register(app: typer.Typer) -> None:
    """Attach the client commands to ``app``."""
    app.command("publish")(publish)
    app.command("subscribe")(subscribe)
    app.command("snapshot")(snapshot)
