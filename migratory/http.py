"""HTTP/1.1 request heads and responses, without I/O.

One listener serves both plain HTTP (snapshot, publish) and WebSocket upgrades, so
the first bytes of every connection go through :func:`parse_request_head`. The
parser is deliberately strict: anything it does not understand is a 400 with a
reason, never a guess.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

__all__ = ["HttpError", "Request", "json_response", "parse_request_head", "response"]

_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


class HttpError(Exception):
    """A request the server refuses; ``status`` and ``reason`` go to the client."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Request:
    """A parsed request head. Header names are lower-cased; the last value wins."""

    method: str
    target: str
    path: str
    query: Mapping[str, str]
    version: str
    headers: Mapping[str, str]

    @property
    def keep_alive(self) -> bool:
        connection = self.headers.get("connection", "").lower()
        if self.version == "HTTP/1.0":
            return "keep-alive" in connection
        return "close" not in connection

    @property
    def is_websocket_upgrade(self) -> bool:
        return (
            "upgrade" in self.headers.get("connection", "").lower()
            and self.headers.get("upgrade", "").lower() == "websocket"
        )


def parse_request_head(head: bytes) -> Request:
    """Parse the bytes before the blank line that ends the head."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes any byte
        raise HttpError(400, "request head is not text") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not method or not set(method) <= _TOKEN_CHARS:
        raise HttpError(400, "malformed method")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(505 if version.startswith("HTTP/") else 400, f"unsupported protocol {version[:20]!r}")
    if not target.startswith("/"):
        raise HttpError(400, "request target must be an absolute path")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or not set(name) <= _TOKEN_CHARS:
            raise HttpError(400, "malformed header line")
        headers[name.lower()] = value.strip()
    split = urlsplit(target)
    try:
        raw_query = parse_qs(split.query, keep_blank_values=True, strict_parsing=False, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise HttpError(400, "query string is not valid UTF-8") from None
    query = {name: values[-1] for name, values in raw_query.items()}
    return Request(method, target, split.path, query, version, headers)


def response(
    status: int,
    body: bytes = b"",
    content_type: str = "text/plain; charset=utf-8",
    *,
    keep_alive: bool = True,
    extra: Mapping[str, str] | None = None,
) -> bytes:
    """A complete HTTP/1.1 response with Content-Length."""
    phrase = HTTPStatus(status).phrase
    lines = [
        f"HTTP/1.1 {status} {phrase}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        "Cache-Control: no-store",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
    ]
    if extra:
        lines.extend(f"{k}: {v}" for k, v in extra.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_response(status: int, payload: object, *, keep_alive: bool = True) -> bytes:
    """A JSON response (UTF-8, compact)."""
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return response(status, body, "application/json", keep_alive=keep_alive)
