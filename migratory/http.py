"""HTTP/1.1 request heads and responses, without I/O.

One listener serves both plain HTTP (snapshot, publish) and WebSocket upgrades, so
the first bytes of every connection go through :func:`parse_request_head`. The
parser is deliberately strict (RFC 9112): anything it does not understand is a 400
with a reason, never a guess. In particular it refuses what request smuggling and
parser-confusion attacks rely on:

- a request line that is not exactly ``method SP origin-form SP HTTP/1.x``, or a
  target with bytes that must be percent-encoded (controls, spaces, non-ASCII, ``#``);
- a header name that is not a token, whitespace before the colon, obsolete line
  folding, or a control character (bare CR or LF, NUL, ...) in a value;
- an HTTP/1.1 request without exactly one valid ``Host`` (RFC 9112 section 3.2);
- a ``Content-Length`` that is not 1 to 18 ASCII digits (``int()`` would take ``²``
  or ``٣``), or more than one ``Content-Length`` line, even with equal values
  (RFC 9112 section 6.3 lets a server refuse them; this one always does);
- a repeated ``Sec-WebSocket-Key``.

``Transfer-Encoding`` is parsed but not decoded: the connection answers 411 to it.
How the head is framed (``MaxHeaderSize``, pipelining, timeouts) is the connection's
business, not this module's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qs

__all__ = ["MAX_CONTENT_LENGTH_DIGITS", "HttpError", "Request", "json_response", "parse_request_head", "response"]

_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_TARGET = re.compile(r"/[\x21-\x22\x24-\x7e]*")  # origin-form: visible ASCII, no '#'
_VERSION = re.compile(r"HTTP/[0-9]\.[0-9]")
_FIELD_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # field values allow HTAB, SP, VCHAR, obs-text
_HOST = re.compile(r"[A-Za-z0-9\-._~%!$&'()*+,;=:\[\]]*")  # uri-host [ ":" port ], RFC 3986 characters
_DIGITS = re.compile(r"[0-9]+")  # a character class of ASCII digits only, unlike str.isdigit()

MAX_CONTENT_LENGTH_DIGITS = 18
"""Longer Content-Length values are refused with 413 before ``int()`` sees them."""

_SINGLETONS = frozenset({"host", "content-length", "sec-websocket-key"})
"""Fields that must not be repeated; other repeated fields are joined with ", " (RFC 9110 section 5.3)."""


class HttpError(Exception):
    """A request the server refuses; ``status`` and ``reason`` go to the client."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _tokens(value: str) -> frozenset[str]:
    """The comma-separated tokens of a list-valued field, lower-cased."""
    return frozenset(t for t in (item.strip(" \t").lower() for item in value.split(",")) if t)


@dataclass(frozen=True, slots=True)
class Request:
    """A parsed request head.

    Header names are lower-cased; a repeated field's values are joined with ", ".
    ``content_length`` is the validated body length (0 without the header).
    """

    method: str
    target: str
    path: str
    query: Mapping[str, str]
    version: str
    headers: Mapping[str, str]
    content_length: int = 0

    @property
    def keep_alive(self) -> bool:
        connection = _tokens(self.headers.get("connection", ""))
        if self.version == "HTTP/1.0":
            return "keep-alive" in connection
        return "close" not in connection

    @property
    def is_websocket_upgrade(self) -> bool:
        return "upgrade" in _tokens(self.headers.get("connection", "")) and "websocket" in _tokens(
            self.headers.get("upgrade", "")
        )

    @property
    def has_transfer_encoding(self) -> bool:
        return "transfer-encoding" in self.headers


def parse_request_head(head: bytes) -> Request:
    """Parse the bytes before the blank line that ends the head; raise :class:`HttpError`."""
    text = head.decode("latin-1")  # decodes any byte; non-ASCII is then refused where it matters
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not method or not set(method) <= _TOKEN_CHARS:
        raise HttpError(400, "malformed method")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        if _VERSION.fullmatch(version):
            raise HttpError(505, f"unsupported protocol {version}")
        raise HttpError(400, "malformed protocol version")
    if not target.startswith("/"):
        raise HttpError(400, "request target must be an absolute path")
    if not _TARGET.fullmatch(target):
        raise HttpError(400, "request target has characters that must be percent-encoded")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):
            raise HttpError(400, "obsolete line folding is not accepted")
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(400, "header line without a colon")
        if not name or not set(name) <= _TOKEN_CHARS:
            raise HttpError(400, "malformed header name")
        value = value.strip(" \t")
        if _FIELD_CONTROL.search(value):
            raise HttpError(400, f"control character in the {name} header")
        key = name.lower()
        if key in headers:
            if key in _SINGLETONS:
                raise HttpError(400, f"repeated {name} header")
            headers[key] += ", " + value
        else:
            headers[key] = value
    host = headers.get("host")
    if host is None:
        if version == "HTTP/1.1":
            raise HttpError(400, "missing Host header")
    elif not _HOST.fullmatch(host):
        raise HttpError(400, "invalid Host header")
    content_length = 0
    length_text = headers.get("content-length")
    if length_text is not None:
        if not _DIGITS.fullmatch(length_text):
            raise HttpError(400, "invalid Content-Length")
        digits = length_text.lstrip("0")
        if len(digits) > MAX_CONTENT_LENGTH_DIGITS:
            raise HttpError(413, "Content-Length too large")
        content_length = int(digits or "0")
    path, _, query_text = target.partition("?")
    try:
        raw_query = parse_qs(query_text, keep_blank_values=True, strict_parsing=False, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise HttpError(400, "query string is not valid UTF-8") from None
    query = {name: values[-1] for name, values in raw_query.items()}
    return Request(method, target, path, query, version, headers, content_length)


def response(
    status: int,
    body: bytes = b"",
    content_type: str = "text/plain; charset=utf-8",
    *,
    keep_alive: bool = True,
    extra: Mapping[str, str] | None = None,
    cache: str = "no-store",
) -> bytes:
    """A complete HTTP/1.1 response with Content-Length; one ``Cache-Control`` header (``cache``)."""
    phrase = HTTPStatus(status).phrase
    lines = [
        f"HTTP/1.1 {status} {phrase}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        f"Cache-Control: {cache}",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
    ]
    if extra:
        lines.extend(f"{k}: {v}" for k, v in extra.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_response(
    status: int, payload: object, *, keep_alive: bool = True, extra: Mapping[str, str] | None = None
) -> bytes:
    """A JSON response (UTF-8, compact)."""
    body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return response(status, body, "application/json", keep_alive=keep_alive, extra=extra)
