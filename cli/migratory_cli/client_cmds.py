"""``migratory publish|subscribe|snapshot``: the client library from the shell.

URLs may be ``ws://``/``wss://`` (native protocol over WebSocket) or
``http://``/``https://`` (the HTTP endpoints); each command converts as needed. Where a
URL goes, a cluster's server list may go too, in the client libraries' syntax:
``"100 ws://a:8800, 100 ws://b:8800"`` (an optional weight before each URL, commas
between). The commands then choose a server by weight, fail over to another when theirs
dies (with the client library's backoff, and, for ``subscribe``, its recovery from the
last position), and say so on stderr.

A mistake or a failure is one line on stderr, ``error: <URL>: <cause>``, and an
exit code that says what kind of failure it was (never a traceback):

====  =======================================================================
0     done (``publish``: OK or NO_SUBSCRIBER)
1     the server answered and the request did not succeed: a publish status other
      than OK/NO_SUBSCRIBER, no snapshot, entitlement refused, no subject allowed
2     bad input: a URL without ws://, wss://, http:// or https://, no host, a port
      outside 1-65535, a bad option value (``--conflation -5``, ``--field novalue``)
3     cannot connect: connection refused, unknown host, network unreachable, no
      answer in time, TLS failure
4     refused by the server: it answered the connection with an HTTP error (for
      example 503 while a cluster member synchronises), closed it, or does not
      speak the protocol
====  =======================================================================
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import random
import socket
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console

from migratory.client import ClientMessage, EventKind, MigratoryClient, StatusEvent
from migratory.protocol import Status

__all__ = ["EXIT_CONNECT", "EXIT_FAILED", "EXIT_REFUSED", "EXIT_USAGE", "register"]

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CONNECT = 3
EXIT_REFUSED = 4

EXIT_CODES_HELP = (
    "Exit codes: 0 done; 1 the server answered and the request did not succeed; 2 bad input (URL, port, "
    "option); 3 cannot connect (refused, unknown host, no answer in time); 4 refused by the server (HTTP "
    "error, connection closed, not a MigratoryData server)."
)

TIMEOUT = 10.0
"""Seconds to wait for a connection or an answer."""

_err = Console(stderr=True, highlight=False, soft_wrap=True)

T = TypeVar("T")


class CliError(Exception):
    """A failure the command reports as one line, ``error: <url>: <cause>``, and an exit code."""

    def __init__(self, code: int, url: str, cause: str) -> None:
        super().__init__(f"{url}: {cause}")
        self.code = code
        self.url = url
        self.cause = cause


def _shown(url: str) -> str:
    """The URL as error lines show it: without a query (a token may travel there) or a password."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc.rpartition("@")[2] if "@" in parts.netloc else parts.netloc
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _fail(error: CliError) -> NoReturn:
    _err.print(f"error: {_shown(error.url)}: {error.cause}", markup=False)
    raise typer.Exit(error.code)


def _checked_url(url: str) -> urllib.parse.SplitResult:
    """The URL, split; a :class:`CliError` with EXIT_USAGE unless it can be connected to at all."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise CliError(EXIT_USAGE, url, f"not a valid URL ({exc})") from None
    if parts.scheme.lower() not in ("ws", "wss", "http", "https") or not url.lower().startswith(parts.scheme + "://"):
        raise CliError(EXIT_USAGE, url, "the URL must start with ws://, wss://, http:// or https://")
    if not parts.hostname:
        raise CliError(EXIT_USAGE, url, "the URL has no host")
    try:
        port = parts.port
    except ValueError:
        raise CliError(EXIT_USAGE, url, "the port must be a number from 1 to 65535") from None
    if port == 0:
        raise CliError(EXIT_USAGE, url, "the port must be a number from 1 to 65535")
    return parts


def _servers(text: str) -> list[tuple[float, str]]:
    """``"[WEIGHT ]URL, ..."``: the weighted server list (one URL is a list of one)."""
    out: list[tuple[float, str]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise CliError(EXIT_USAGE, text, "an empty entry in the server list (two commas, or one at an end)")
        weight_text, _, rest = item.partition(" ")
        weight, url = 100.0, item
        if rest and "://" not in weight_text:
            try:
                weight = float(weight_text)
            except ValueError:
                raise CliError(EXIT_USAGE, item, f"expected 'WEIGHT URL' or 'URL', got {item!r}") from None
            url = rest.strip()
            if not weight > 0:
                raise CliError(EXIT_USAGE, url, f"a server's weight must be positive, got {weight_text}")
        _checked_url(url)
        out.append((weight, url))
    return out


def _by_weight(servers: list[tuple[float, str]]) -> list[str]:
    """The URLs in the order to try them: drawn by weight, as the client libraries draw."""
    left, order = list(servers), []
    while left:
        point = random.uniform(0, sum(w for w, _ in left))
        for index, (weight, url) in enumerate(left):
            point -= weight
            if point <= 0 or index == len(left) - 1:
                order.append(url)
                del left[index]
                break
    return order


def _http_url(url: str) -> str:
    _checked_url(url)
    if url.startswith("ws://"):
        return "http://" + url[5:]
    if url.startswith("wss://"):
        return "https://" + url[6:]
    return url


def _ws_url(url: str) -> str:
    _checked_url(url)
    if url.startswith("http://"):
        return "ws://" + url[7:]
    if url.startswith("https://"):
        return "wss://" + url[8:]
    return url


def _parse_fields(items: list[str], url: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError(EXIT_USAGE, url, f"--field takes name=value, got {item!r}")
        fields[name] = value
    return fields


def _os_cause(exc: BaseException, url: str) -> CliError:
    """Why a connection attempt failed, from the exception urllib or asyncio raised."""
    if isinstance(exc, socket.gaierror):
        host = urllib.parse.urlsplit(url).hostname or url
        return CliError(EXIT_CONNECT, url, f"cannot resolve host {host!r} ({exc.strerror or exc})")
    if isinstance(exc, ConnectionRefusedError):
        return CliError(EXIT_CONNECT, url, "connection refused (is the server running, on this port?)")
    if isinstance(exc, TimeoutError):
        return CliError(EXIT_CONNECT, url, f"no answer within {TIMEOUT:g} s")
    if isinstance(exc, ssl.SSLError):
        return CliError(EXIT_CONNECT, url, f"TLS failed: {exc.reason or exc}")
    if isinstance(exc, ConnectionResetError):  # http.client.RemoteDisconnected too
        return CliError(EXIT_REFUSED, url, "the server closed the connection without an answer")
    if isinstance(exc, http.client.HTTPException):
        return CliError(EXIT_REFUSED, url, f"not a MigratoryData HTTP answer ({type(exc).__name__})")
    if isinstance(exc, OSError):
        return CliError(EXIT_CONNECT, url, f"cannot connect: {exc.strerror or exc}")
    return CliError(EXIT_REFUSED, url, f"{type(exc).__name__}: {exc}")


def _ws_cause(detail: str, url: str) -> CliError:
    """Why the client's first connection failed, from its NOTIFY_SERVER_DOWN detail.

    The detail reads ``<url>: <exception type>: <text>`` or ``<url>: closed by server: <code> <reason>``
    (migratory.client); the exception type decides the exit code.
    """
    _, _, rest = detail.partition(": ")
    kind, _, text = rest.partition(": ")
    if kind == "closed by server":
        return CliError(EXIT_REFUSED, url, f"the server closed the connection ({text})")
    if kind == "gaierror":
        host = urllib.parse.urlsplit(url).hostname or url
        return CliError(EXIT_CONNECT, url, f"cannot resolve host {host!r}")
    if kind == "ConnectionRefusedError":
        return CliError(EXIT_CONNECT, url, "connection refused (is the server running, on this port?)")
    if kind == "TimeoutError":
        return CliError(EXIT_CONNECT, url, f"no answer within {TIMEOUT:g} s")
    if kind.startswith("SSL"):
        return CliError(EXIT_CONNECT, url, f"TLS failed: {text}")
    if kind == "InvalidStatus":  # the upgrade was answered with an HTTP error
        return CliError(EXIT_REFUSED, url, f"refused by the server ({text})")
    if kind.startswith("Invalid") or kind in ("DecodeError", "ConnectionClosedError", "ConnectionClosedOK"):
        return CliError(EXIT_REFUSED, url, f"not a MigratoryData WebSocket answer ({text})")
    return CliError(EXIT_CONNECT, url, f"cannot connect ({text or kind})")


def _run(url: str, coro: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; failures become one line and an exit code."""
    try:
        return asyncio.run(coro)
    except CliError as error:
        _fail(error)
    except (ConnectionError, TimeoutError, OSError) as exc:
        _fail(_os_cause(exc, url))


async def _open(
    url: str,
    token: str,
    *,
    reconnect: bool,
    on_status: Callable[[StatusEvent], None] | None = None,
    servers: list[tuple[float, str]] | None = None,
) -> MigratoryClient:
    """A connected client, or a :class:`CliError` as soon as the first connection attempt fails
    (with a server list: once every server failed once; the last one's cause is reported).

    ``MigratoryClient.connect()`` alone would wait its whole timeout while the client
    retries; the first NOTIFY_SERVER_DOWN ends the wait at once instead. Later status
    events (once connected) go to ``on_status``.
    """
    loop = asyncio.get_running_loop()
    first_down: asyncio.Future[str] = loop.create_future()
    opened = False
    listed = [(w, _ws_url(u)) for w, u in servers] if servers else [(100.0, url)]
    tried: set[str] = set()

    def status(event: StatusEvent) -> None:
        if not opened:
            if event.kind is EventKind.NOTIFY_SERVER_DOWN and not first_down.done():
                tried.add(event.detail.partition(": ")[0])
                if len(listed) > 1 and on_status is not None:  # a listed member is down: said, the next tried
                    on_status(event)
                if len(tried) >= len(listed):
                    first_down.set_result(event.detail)
            return
        if on_status is not None:
            on_status(event)

    client = MigratoryClient(
        [f"{w:g} {u}" for w, u in listed],
        token=token,
        reconnect=reconnect or len(listed) > 1,
        on_status=status,
        request_timeout=TIMEOUT,
    )
    connecting = asyncio.ensure_future(client.connect())
    waiting: list[asyncio.Future[Any]] = [connecting, first_down]
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
        opened = True
        first_down.cancel()
        return client
    connecting.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await connecting
    await client.close()
    if first_down.done() and not first_down.cancelled():
        detail = first_down.result()
        raise _ws_cause(detail, detail.partition(": ")[0] if len(listed) > 1 else url)
    raise CliError(EXIT_CONNECT, url, f"no answer within {TIMEOUT:g} s")


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


def _http_call(request: urllib.request.Request, shown: str) -> tuple[int, bytes]:
    """Status and body of an HTTP request (HTTP errors included); connection failures as CliError."""
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
            return int(answer.status), answer.read()
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, exc.read()
        except (OSError, http.client.HTTPException):
            return exc.code, b""
    except urllib.error.URLError as exc:
        reason = exc.reason
        raise _os_cause(reason if isinstance(reason, BaseException) else OSError(str(reason)), shown) from None
    except (OSError, http.client.HTTPException) as exc:
        raise _os_cause(exc, shown) from None


def _error_text(body: bytes, fallback: str) -> str:
    try:
        document = json.loads(body)
    except ValueError:
        return fallback
    return str(document.get("error", fallback)) if isinstance(document, dict) else fallback


def _http_failover(call: Callable[[str], T], servers: list[tuple[float, str]]) -> T:
    """``call`` on each server in weighted order until one answers; a server that cannot be reached or
    refuses the connection is said on stderr and the next one tried; the last failure is the command's."""
    order = _by_weight(servers)
    for index, url in enumerate(order):
        try:
            return call(url)
        except CliError as error:
            if error.code not in (EXIT_CONNECT, EXIT_REFUSED) or index == len(order) - 1:
                raise
            _err.print(f"error: {_shown(error.url)}: {error.cause}; trying {_shown(order[index + 1])}", markup=False)
    raise AssertionError("unreachable: the server list is never empty")


SERVERS_HELP = "Server URL, or a cluster's list: '100 ws://a:8800, 100 ws://b:8800' (weights optional)."


def publish(
    url: str = typer.Argument(..., help=SERVERS_HELP + " ws:// or http://."),
    subject: str = typer.Argument(..., help="Subject, e.g. /Stocks/NYSE/IBM."),
    content: str = typer.Argument(..., help="Message content (UTF-8 text; '-' reads bytes from stdin)."),
    field: list[str] = typer.Option([], "--field", "-f", help="A field name=value; repeat for more."),
    token: str = typer.Option("", "--token", help="Entitlement token."),
    retained: bool = typer.Option(True, "--retained/--no-retained", help="Whether it updates the snapshot."),
) -> None:
    """Publish one message and print the server's publish status (exit 1 unless OK or NO_SUBSCRIBER)."""
    try:
        servers = _servers(url)
        fields = _parse_fields(field, url)
        first = servers[0][1]
        ws_url = _ws_url(first)
    except CliError as error:
        _fail(error)
    data = sys.stdin.buffer.read() if content == "-" else content.encode("utf-8")
    if first.startswith(("http://", "https://")):
        try:
            status = _http_failover(lambda u: _http_publish(u, subject, data, fields, token, retained), servers)
        except CliError as error:
            _fail(error)
    else:
        status = _run(first, _ws_publish(ws_url, subject, data, fields, token, retained, servers))
    typer.echo(status)
    if status not in ("OK", "NO_SUBSCRIBER"):
        raise typer.Exit(EXIT_FAILED)


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
    endpoint = f"{_http_url(url).rstrip('/')}/publish"  # shown in errors: without the query (and its token)
    request = urllib.request.Request(
        f"{endpoint}?{urllib.parse.urlencode(query)}", data=body, headers=headers, method="POST"
    )
    code, answer = _http_call(request, endpoint)
    try:
        document = json.loads(answer)
        status = document.get("status") if isinstance(document, dict) else None
    except ValueError:
        status = None
    if code >= 400:
        reason = _error_text(answer, http.client.responses.get(code, ""))
        if code == 413 and not isinstance(status, str):  # refused before the body was read
            status = Status.TOO_LARGE.name
        if not isinstance(status, str):  # not a publish status: the server refused the request itself
            raise CliError(EXIT_REFUSED, endpoint, f"HTTP {code}: {reason}")
        _err.print(f"error: {_shown(endpoint)}: HTTP {code}: {reason}", markup=False)
        return status
    if not isinstance(status, str):
        raise CliError(EXIT_REFUSED, endpoint, f"HTTP {code} without a publish status: not a MigratoryData server?")
    return status


async def _ws_publish(
    url: str,
    subject: str,
    data: bytes,
    fields: dict[str, str],
    token: str,
    retained: bool,
    servers: list[tuple[float, str]] | None = None,
) -> str:
    # with a list, a member that dies before answering: the library sends it again, same publish id, elsewhere
    listed = servers is not None and len(servers) > 1
    client = await _open(url, token, reconnect=False, servers=servers, on_status=_say_failover if listed else None)
    try:
        # a cluster's publication answered FAILED while a dead member's groups move is sent again, same id
        retries = 5 if listed else 0
        return (await client.publish(subject, data, fields=fields, retained=retained, retries=retries)).name
    finally:
        await client.close()


def _say_failover(event: StatusEvent) -> None:
    """A server list's failover, on stderr: the member lost, and the one taken instead."""
    if event.kind in (EventKind.NOTIFY_SERVER_DOWN, EventKind.NOTIFY_SERVER_UP):
        _err.print(f"{event.kind.value}: {event.detail or event.subject}", markup=False)


def subscribe(
    url: str = typer.Argument(..., help=SERVERS_HELP + " ws:// or wss://."),
    subjects: list[str] = typer.Argument(..., help="One or more subjects."),
    conflation: int = typer.Option(0, "--conflation", help="Conflation time in ms (cut down to a multiple of 100)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line: subject, content, fields, type."),
    count: int = typer.Option(0, "--count", help="Exit after this many messages (0 = run until interrupted)."),
    token: str = typer.Option("", "--token", help="Entitlement token."),
) -> None:
    """Subscribe and print messages as they arrive (the snapshot first); reconnects once connected."""
    try:
        servers = _servers(url)
        ws_url = _ws_url(servers[0][1])
        if conflation < 0:
            raise CliError(EXIT_USAGE, url, f"--conflation must be 0 or more milliseconds, got {conflation}")
        if count < 0:
            raise CliError(EXIT_USAGE, url, f"--count must be 0 or more, got {count}")
    except CliError as error:
        _fail(error)
    with contextlib.suppress(KeyboardInterrupt):
        _run(servers[0][1], _subscribe(ws_url, subjects, conflation, as_json, count, token, servers))


async def _subscribe(
    url: str,
    subjects: list[str],
    conflation: int,
    as_json: bool,
    count: int,
    token: str,
    servers: list[tuple[float, str]] | None = None,
) -> None:
    out = Console(highlight=False, soft_wrap=True)
    down = False

    def on_status(event: StatusEvent) -> None:
        nonlocal down
        if event.kind in (EventKind.SUBSCRIBE_DENY, EventKind.ERROR, EventKind.NOTIFY_SERVER_DOWN):
            _err.print(f"{event.kind.value}: {event.subject} {event.detail}".replace("  ", " "), markup=False)
            down = down or event.kind is EventKind.NOTIFY_SERVER_DOWN
        elif event.kind is EventKind.NOTIFY_SERVER_UP and down:  # back, here or on another member: it recovers
            down = False
            _err.print(f"{event.kind.value}: {event.detail or event.subject}", markup=False)

    client = await _open(url, token, reconnect=True, on_status=on_status, servers=servers)
    try:
        try:
            statuses = await client.subscribe(subjects, conflation)
        except TimeoutError:
            raise CliError(EXIT_CONNECT, url, f"no subscribe status within {TIMEOUT:g} s") from None
        if not any(s == Status.OK for s in statuses.values()):
            raise typer.Exit(EXIT_FAILED)
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
    finally:
        await client.close()


def snapshot(
    url: str = typer.Argument(..., help=SERVERS_HELP + " http:// (ws:// is converted)."),
    subject: str = typer.Argument(..., help="The subject whose snapshot to fetch."),
    token: str = typer.Option("", "--token", help="Entitlement token."),
    as_json: bool = typer.Option(False, "--json", help="Print the JSON form (subject, content, fields, seq, epoch)."),
) -> None:
    """Fetch a subject's snapshot over HTTP (exit 1 if there is none or it is refused)."""
    try:
        servers = _servers(url)
        body = _http_failover(lambda u: _snapshot(u, subject, token, as_json), servers)
    except CliError as error:
        _fail(error)
    sys.stdout.buffer.write(body + (b"\n" if as_json else b""))
    sys.stdout.flush()


def _snapshot(url: str, subject: str, token: str, as_json: bool) -> bytes:
    endpoint = f"{_http_url(url).rstrip('/')}/snapshot"  # shown in errors: without the query (and its token)
    query = {"subject": subject}
    if token:
        query["token"] = token
    headers = {"Accept": "application/json"} if as_json else {}
    code, body = _http_call(
        urllib.request.Request(f"{endpoint}?{urllib.parse.urlencode(query)}", headers=headers), endpoint
    )
    if code >= 400:
        reason = _error_text(body, http.client.responses.get(code, ""))
        # 400 (invalid subject), 403 (refused), 404 (no snapshot) answer the request; anything else refuses it
        answered = code in (400, 403) or (code == 404 and not reason.startswith("no such endpoint"))
        raise CliError(EXIT_FAILED if answered else EXIT_REFUSED, endpoint, f"HTTP {code}: {reason}")
    return body


def register(app: typer.Typer) -> None:
    """Attach the client commands to ``app``."""
    app.command("publish", epilog=EXIT_CODES_HELP)(publish)
    app.command("subscribe", epilog=EXIT_CODES_HELP)(subscribe)
    app.command("snapshot", epilog=EXIT_CODES_HELP)(snapshot)
