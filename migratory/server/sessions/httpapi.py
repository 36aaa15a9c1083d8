"""Plain HTTP endpoints served on the client listeners.

``GET /snapshot?subject=X[&token=U]``: the snapshot content as the body, or with
``Accept: application/json`` a JSON object with subject, content (or
content_base64), fields, seq and epoch. ``POST /publish?subject=X[&token=U]
[&retained=true|false]``: publish the body exactly as a WebSocket publisher would
(or a JSON object with ``Content-Type: application/json``). ``GET /health``: a
liveness answer with the node's counters.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from migratory import web
from migratory.config import parse_bool
from migratory.entitlement import Decision
from migratory.http import Request, json_response, response
from migratory.message import Message
from migratory.protocol import Status
from migratory.server.engine.core import Engine, Origin, PublishResult
from migratory.server.engine.types import PRIVATE_PREFIX

__all__ = ["HttpClient", "handle"]


class HttpClient(Protocol):
    """What the HTTP API needs of the connection a request came on."""

    @property
    def session(self) -> str: ...

    def origin(self) -> Origin: ...

    def start_stream(self, request: Request) -> None:
        """Become the client's HTTP stream (``GET /stream``)."""


_PUBLISH_HTTP_STATUS = {
    Status.OK: 200,
    Status.NO_SUBSCRIBER: 200,
    Status.DENIED: 403,
    Status.INVALID_SUBJECT: 400,
    Status.TOO_LARGE: 413,
    Status.FAILED: 503,
}


Respond = Callable[[Request, int, bytes], None]


def handle(engine: Engine, conn: HttpClient, request: Request, body: bytes, respond: Respond) -> None:
    """Answer one request through ``respond(request, status, response bytes)``.

    Most answers are immediate; a publish answers once its subject's coordinating
    worker has sequenced it.
    """
    keep = request.keep_alive
    path = request.path.rstrip("/") or "/"
    if path == "/health":
        respond(
            request,
            200 if engine.healthy else 503,
            json_response(200 if engine.healthy else 503, engine.health(), keep_alive=keep),
        )
        return
    if not engine.ready and path in ("/publish", "/snapshot"):
        respond(request, *_error(503, "this cluster member is synchronising; try another member", keep))
        return
    if path == "/stream" and request.method == "GET":
        conn.start_stream(request)  # the connection becomes the client's HTTP stream
        return
    if path.startswith("/stream/"):
        respond(request, *_stream_input(engine, request, path[len("/stream/") :], body, keep))
        return
    if path in web.PAGES and request.method in ("GET", "HEAD"):
        respond(request, *web.page(path, request.method == "HEAD", keep))
        return
    if path == "/publish":
        if request.method != "POST":
            respond(request, *_error(405, "use POST for /publish", keep))
            return
        _publish(engine, conn, request, body, keep, respond)
        return
    if path == "/snapshot":
        if request.method not in ("GET", "HEAD"):
            answer = _error(405, "use GET for /snapshot", keep)
        elif engine.async_entitlement:
            engine.in_order(conn.session, _snapshot_after_decision(engine, conn, request, keep, respond))
            return
        else:
            answer = _snapshot(engine, conn, request, keep)
    else:
        answer = _error(404, f"no such endpoint: {request.path}", keep)
    respond(request, *answer)


CORS = {
    "Access-Control-Allow-Origin": "*",
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "Content-Type",
    "Access-Control-Max-Age": "600",
}


def _stream_input(engine: Engine, request: Request, stream: str, body: bytes, keep: bool) -> tuple[int, bytes]:
    """``POST /stream/<id>``: one native message of an HTTP-streaming client (docs/protocol.md)."""
    if request.method == "OPTIONS":  # a browser's preflight before a cross-origin POST
        return 204, response(204, b"", keep_alive=keep, extra=CORS)
    if request.method != "POST":
        return 405, json_response(
            405, {"error": "POST one native message to /stream/<id>"}, keep_alive=keep, extra=CORS
        )
    if not body:
        return 400, json_response(400, {"error": "the body must be one native message"}, keep_alive=keep, extra=CORS)
    if not engine.stream_input(stream, body):
        return 404, json_response(404, {"error": "no such stream (it ended?)"}, keep_alive=keep, extra=CORS)
    return 204, response(204, b"", keep_alive=keep, extra=CORS)


def _error(status: int, reason: str, keep: bool) -> tuple[int, bytes]:
    return status, json_response(status, {"error": reason}, keep_alive=keep)


def _wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


async def _snapshot_after_decision(
    engine: Engine, conn: HttpClient, request: Request, keep: bool, respond: Respond
) -> None:
    subject = request.query.get("subject")
    decided: Decision | bool = False
    if subject is not None and engine.check_subject(subject) is None:
        decided = await engine.custom_decision("authorize_subscribe", _origin(conn, request), subject)
    respond(request, *_snapshot(engine, conn, request, keep, decided))


def _origin(conn: HttpClient, request: Request) -> Origin:
    origin = conn.origin()
    return replace(origin, token=request.query["token"]) if "token" in request.query else origin


def _snapshot(
    engine: Engine, conn: HttpClient, request: Request, keep: bool, decided: Decision | bool = False
) -> tuple[int, bytes]:
    subject = request.query.get("subject")
    if subject is None:
        return _error(400, "missing query parameter: subject", keep)
    origin = _origin(conn, request)
    reason = engine.check_subject(subject)
    if reason is not None:
        engine.deny(origin, "snapshot", "invalid_subject", reason, subject)
        return _error(400, f"invalid subject: {reason}", keep)
    if subject.startswith(PRIVATE_PREFIX):
        private = f"subjects under {PRIVATE_PREFIX} are the server's private state"
        denial: Decision | bool = ("reserved_subject", private)
    else:
        denial = engine.authorizer.check_subscribe(origin, subject) if decided is False else decided
    if isinstance(denial, tuple):
        engine.deny(origin, "snapshot", denial[0], denial[1], subject)
        return _error(403, denial[1], keep)
    snapshot = engine.replica.get(subject)
    if snapshot is None:
        return _error(404, f"no snapshot for {subject}", keep)
    if _wants_json(request):
        document: dict[str, Any] = {
            "subject": snapshot.subject,
            "fields": dict(snapshot.fields),
            "seq": snapshot.seq,
            "epoch": snapshot.epoch,
        }
        try:
            document["content"] = snapshot.content.decode("utf-8")
        except UnicodeDecodeError:
            document["content"] = None
            document["content_base64"] = base64.b64encode(snapshot.content).decode("ascii")
        return 200, json_response(200, document, keep_alive=keep)
    body = b"" if request.method == "HEAD" else snapshot.content
    extra = {"X-Migratory-Seq": str(snapshot.seq), "X-Migratory-Epoch": str(snapshot.epoch)}
    return 200, response(200, body, "application/octet-stream", keep_alive=keep, extra=extra)


def _publish(engine: Engine, conn: HttpClient, request: Request, body: bytes, keep: bool, respond: Respond) -> None:
    answer = _publish_checked(engine, conn, request, body, keep, respond)
    if answer is not None:
        respond(request, *answer)


def _publish_checked(
    engine: Engine, conn: HttpClient, request: Request, body: bytes, keep: bool, respond: Respond
) -> tuple[int, bytes] | None:
    """Validate the request; returns an error answer, or None once the publish is under way."""
    origin = _origin(conn, request)
    subject = request.query.get("subject")
    retained_text = request.query.get("retained")
    fields: dict[str, str] = {}
    content = body
    if request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json":
        try:
            document = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            engine.deny(origin, "publish", "malformed", f"invalid JSON body: {exc}", subject)
            return _error(400, f"invalid JSON body: {exc}", keep)
        if not isinstance(document, dict):
            return _error(400, "the JSON body must be an object", keep)
        subject = document.get("subject", subject)
        raw_fields = document.get("fields", {})
        if not isinstance(raw_fields, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw_fields.items()
        ):
            return _error(400, "fields must be an object of strings", keep)
        fields = raw_fields
        if "content_base64" in document:
            try:
                content = base64.b64decode(str(document["content_base64"]), validate=True)
            except (binascii.Error, ValueError):
                return _error(400, "content_base64 is not valid base64", keep)
        elif isinstance(document.get("content"), str):
            content = document["content"].encode("utf-8")
        else:
            return _error(400, "the JSON body needs a string content (or content_base64)", keep)
        if "retained" in document:
            if not isinstance(document["retained"], bool):
                return _error(400, "retained must be true or false", keep)
            retained_text = "true" if document["retained"] else "false"
    if not isinstance(subject, str):
        return _error(400, "missing subject", keep)
    try:
        retained = True if retained_text is None else parse_bool(retained_text)
    except ValueError as exc:
        return _error(400, f"retained: {exc}", keep)

    def reply(result: PublishResult) -> None:
        status = _PUBLISH_HTTP_STATUS.get(result.status, 400)
        payload: dict[str, Any] = {"status": result.status.name}
        if result.reason:
            payload["error"] = result.reason
        respond(request, status, json_response(status, payload, keep_alive=keep))

    engine.publish(Message(subject, content, fields, retained), origin, reply)
    return None
