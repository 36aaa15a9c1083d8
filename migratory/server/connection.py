"""One client connection: HTTP requests or a WebSocket carrying the native protocol.

Driven by ``asyncio.Protocol`` callbacks, with no task, reader or timer of its own
(an idle connection is this object, its transport and a few small attributes).
The first bytes are an HTTP request head: a WebSocket upgrade switches the
connection to frames; anything else is served by :mod:`migratory.server.httpapi`.

Output is queued with :meth:`Connection.send` (the same ``bytes`` object for every
subscriber of a message) and written by :meth:`Connection.flush`, which the engine
calls once per loop turn or batching period. Pending output is bounded by
``MaxPendingOutput``; past it ``SlowConsumerPolicy`` applies.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, cast

from migratory import protocol as p
from migratory.entitlement import Decision
from migratory.http import HttpError, Request, json_response, parse_request_head
from migratory.message import Message, QoS
from migratory.server.engine import Engine, Origin, PublishResult
from migratory.subscriptions import SubjectSet, subject_set_items
from migratory.websocket import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    CLOSE_UNSUPPORTED_DATA,
    OP_BINARY,
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    OP_TOO_BIG,
    FrameParser,
    WebSocketError,
    accept_key,
    build_close,
    build_frame,
    parse_close,
    valid_key,
)

__all__ = ["Connection"]

_HEAD = 0
_BODY = 1
_WAIT = 2  # an HTTP request is being answered (a publish waits for its coordinator)
_WS = 3
_CLOSING = 4
_CLOSED = 5

_PIPELINE_BATCH = 64
"""Pipelined HTTP requests served per call before yielding to the event loop."""


class Connection(asyncio.Protocol):
    """Per-connection state; ``__slots__`` keep an idle one small."""

    __slots__ = (
        "addr",
        "bytes_in",
        "bytes_out",
        "connected",
        "deadline",
        "engine",
        "hello",
        "inbuf",
        "last_rx",
        "listener",
        "msgs_in",
        "msgs_out",
        "parser",
        "paused",
        "pending",
        "pending_bytes",
        "ping_sent",
        "port",
        "reason",
        "request",
        "scheme",
        "sid",
        "started",
        "state",
        "subscriptions",
        "token",
        "token_expiry",
        "transport",
        "version",
        "wheel_at",
    )

    def __init__(self, engine: Engine, listener: str, scheme: str) -> None:
        self.engine = engine
        self.listener = listener
        self.scheme = scheme  # "ws" or "wss": the HTTP scheme is derived from it
        self.transport: asyncio.Transport | None = None
        self.state = _HEAD
        self.inbuf = b""
        self.parser: FrameParser | None = None
        self.pending: bytes | list[bytes] | None = None  # bytes while one item: no list per delivery
        self.pending_bytes = 0
        self.paused = False
        self.subscriptions: SubjectSet = ()
        self.sid = 0
        self.token = ""
        self.token_expiry = 0.0  # wall-clock time the entitlement token expires (0: never)
        self.connected = False
        self.hello = False
        self.addr = ""
        self.port = 0
        self.reason = ""
        self.request: Request | None = None
        self.started = 0.0
        self.last_rx = 0.0
        self.deadline = 0.0
        self.ping_sent = 0.0
        self.msgs_in = 0
        self.msgs_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.wheel_at = 0  # the engine's timer-wheel slot holding this connection (0: none)
        self.version = 1  # the native protocol version the client spoke in CONNECT

    # --- identity ---------------------------------------------------------------------

    @property
    def session(self) -> str:
        return self.engine.session_name(self.sid)

    @property
    def open(self) -> bool:
        return self.state < _CLOSING

    @property
    def tls(self) -> bool:
        return self.scheme == "wss"

    @property
    def protocol(self) -> str:
        if self.state == _WS or self.connected:
            return self.scheme
        return "https" if self.tls else "http"

    def origin(self) -> Origin:
        return Origin(self.addr, self.port, self.session, self.protocol, self.token, self.listener)

    def log_fields(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "addr": self.addr,
            "port": self.port,
            "listener": self.listener,
            "protocol": self.protocol,
            "tls": self.tls,
        }

    # --- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.addr = sys.intern(str(peer[0]))  # one string per client address, not per connection
            self.port = int(peer[1])
        engine = self.engine
        self.sid = engine.new_session()
        now = engine.loop.time()
        if not engine.admit(self.addr, now):
            engine.deny(
                self.origin(),
                "connect",
                "rate_limited",
                f"more than MaxConnectionsPerSecondPerAddress ({engine.config.max_connection_rate_per_address}) "
                f"new connections per second from {self.addr}",
            )
            self.state = _CLOSING
            self.transport.abort()
            return
        self.started = self.last_rx = now
        self.deadline = now + engine.config.handshake_timeout / 1000.0
        engine.register(self)
        engine.schedule(self, self.deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        previous = self.state
        self.state = _CLOSED
        self.pending = None
        self.parser = None
        self.inbuf = b""
        engine = self.engine
        engine.unregister(self)
        if self.connected:
            engine.stats.connections -= 1
            engine.stats.disconnections_total += 1
            reason = self.reason or ("connection_lost" if previous != _CLOSING else "client_closed")
            engine.access(
                "disconnect",
                self,
                duration_ms=int((engine.loop.time() - self.started) * 1000),
                reason=reason,
                msgs_in=self.msgs_in,
                msgs_out=self.msgs_out,
                bytes_in=self.bytes_in,
                bytes_out=self.bytes_out,
            )

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.pending is not None:
            self.flush()

    def data_received(self, data: bytes) -> None:
        self.last_rx = self.engine.loop.time()
        self.bytes_in += len(data)
        if self.state == _WS:
            self._ws_received(data)
        elif self.state < _WS:
            self.inbuf += data
            if len(self.inbuf) > self.engine.config.max_header_size + self.engine.max_message_size:
                self._http_error(413, "too much pipelined input while a request is answered")
                return
            self._http_received()

    def eof_received(self) -> bool | None:
        if self.state != _WS:
            self.reason = self.reason or "client_closed"
        return None

    # --- output -----------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Queue bytes for the next flush; the engine decides when that happens."""
        pending = self.pending
        engine = self.engine
        if pending is None:
            if self.state >= _CLOSING:
                return
            self.pending = data
            self.pending_bytes = len(data)
            if engine.batching_time:
                engine.mark_batch(self)
            else:
                engine._dirty.append(self)
                if not engine._flush_armed:
                    engine._flush_armed = True
                    engine.loop.call_soon(engine.flush_dirty)
        else:
            if isinstance(pending, bytes):
                self.pending = [pending, data]
            else:
                pending.append(data)
            self.pending_bytes += len(data)
            if self.pending_bytes > engine.max_pending:
                self._slow_consumer()
                return
        if engine.batching_size and self.pending_bytes >= engine.batching_size:
            self.flush()

    def flush(self) -> None:
        """Write everything pending in one call (unless the kernel asked us to pause)."""
        pending = self.pending
        if pending is None or self.paused or self.transport is None:
            return
        self.pending = None
        self.bytes_out += self.pending_bytes
        self.pending_bytes = 0
        if isinstance(pending, bytes):
            self.msgs_out += 1
            self.transport.write(pending)
        else:
            self.msgs_out += len(pending)
            self.transport.write(b"".join(pending))

    def _slow_consumer(self) -> None:
        engine = self.engine
        if engine.drop_slow:
            assert isinstance(self.pending, list)
            dropped = self.pending.pop()
            self.pending_bytes -= len(dropped)
            engine.stats.messages_dropped += 1
            return
        engine.stats.slow_consumers_disconnected += 1
        engine.deny(
            self.origin(),
            "frame",
            "slow_consumer",
            f"pending output exceeded MaxPendingOutput ({engine.max_pending} bytes)",
        )
        self.abort("slow_consumer")

    def abort(self, reason: str) -> None:
        """Drop the connection at once, discarding pending output."""
        self.reason = self.reason or reason
        self.pending = None
        if self.state < _CLOSING:
            self.state = _CLOSING
        if self.transport is not None:
            self.transport.abort()

    def close(self, reason: str) -> None:
        """Flush what is pending, then close."""
        self.reason = self.reason or reason
        if self.state >= _CLOSING:
            return
        self.flush()
        self.state = _CLOSING
        self.pending = None
        if self.transport is not None:
            self.transport.close()

    def shutdown(self) -> None:
        """Server shutdown: tell WebSocket clients with close code 1001."""
        if self.state == _WS:
            self.send(build_close(CLOSE_GOING_AWAY, "server shutdown"))
            self.flush()
        self.close("server_shutdown")

    # --- timers -----------------------------------------------------------------------

    def on_timer(self, now: float) -> None:
        engine = self.engine
        config = engine.config
        if self.state == _WAIT:
            engine.schedule(self, now + 1.0)
            return
        if self.state < _WS:
            if now >= self.deadline:
                engine.deny(
                    self.origin(),
                    "http",
                    "bad_request",
                    "request not completed within HandshakeTimeout",
                )
                self.abort("handshake_timeout")
            else:
                engine.schedule(self, self.deadline)
            return
        interval = config.keep_alive_interval / 1000.0
        timeout = config.keep_alive_timeout / 1000.0
        if self.token_expiry and time.time() >= self.token_expiry:
            self._revoke_subscriptions()
        if self.ping_sent and self.last_rx < self.ping_sent:
            if now - self.ping_sent >= timeout:
                self.abort("keepalive_timeout")
                return
            next_check = self.ping_sent + timeout
        else:
            self.ping_sent = 0.0
            if now - self.last_rx >= interval:
                self.ping_sent = now
                self.send(build_frame(OP_PING, b"ka"))
                next_check = now + timeout
            else:
                next_check = self.last_rx + interval
        if self.token_expiry:
            next_check = min(next_check, now + max(0.0, self.token_expiry - time.time()))
        engine.schedule(self, next_check)

    def _revoke_subscriptions(self) -> None:
        """The entitlement token expired: withdraw every subscription, and say so."""
        self.token_expiry = 0.0
        engine = self.engine
        for subject in subject_set_items(self.subscriptions):
            engine.unsubscribe(self, subject)
            engine.deny(self.origin(), "subscribe", "entitlement", "the token has expired", subject)
            self.send(
                build_frame(OP_BINARY, p.encode_subscribe_status(p.Status.REVOKED, subject, "the token has expired"))
            )

    def _set_token(self, token: str) -> None:
        self.token = token
        expiry = self.engine.entitlement.expires_at(token) if token else None
        self.token_expiry = expiry or 0.0
        if expiry:
            engine = self.engine
            engine.schedule(self, min(engine.loop.time() + max(0.0, expiry - time.time()), self.last_rx + 1.0))

    # --- HTTP -------------------------------------------------------------------------

    def _http_received(self) -> None:
        """Serve the complete requests in ``inbuf`` one after the other, in a loop.

        A request answered at once lets the loop go on with the next pipelined one; a
        request answered later (a publish waiting for its coordinator) stops it, and
        its answer schedules the rest on the next loop turn, so answering never
        recurses. At most ``_PIPELINE_BATCH`` requests are served per call and the
        rest on the next loop turn: a client pipelining thousands of requests cannot
        hold the event loop, and ``inbuf`` and ``MaxPendingOutput`` bound what it may
        queue.
        """
        served = 0
        while self.state < _WAIT and self.inbuf:
            if self.state == _HEAD:
                if served >= _PIPELINE_BATCH:
                    self.engine.loop.call_soon(self._http_received)
                    return
                inbuf = self.inbuf
                if inbuf.startswith(b"\r\n"):  # RFC 9112 section 2.2: ignore empty lines before a request
                    skip = 2
                    while inbuf.startswith(b"\r\n", skip):
                        skip += 2
                    inbuf = self.inbuf = inbuf[skip:]
                    if not inbuf:
                        return
                end = inbuf.find(b"\r\n\r\n")
                limit = self.engine.config.max_header_size
                if end < 0:
                    if len(inbuf) > limit:
                        self._http_error(431, f"request head larger than MaxHeaderSize ({limit} bytes)")
                    return
                if end > limit:
                    self._http_error(431, f"request head larger than MaxHeaderSize ({limit} bytes)")
                    return
                head = inbuf[:end]
                self.inbuf = inbuf[end + 4 :]
                try:
                    request = parse_request_head(head)
                except HttpError as exc:
                    self._http_error(exc.status, exc.reason)
                    return
                if request.is_websocket_upgrade:
                    self._upgrade(request)
                    return
                if request.has_transfer_encoding:
                    self._http_error(
                        411, "chunked request bodies are not supported: send Content-Length", request=request
                    )
                    return
                length = request.content_length
                if length > self.engine.max_message_size:
                    self._http_error(
                        413,
                        f"body of {length} bytes exceeds MessageSizeLimit ({self.engine.max_message_size} bytes)",
                        request=request,
                    )
                    return
                self.request = request
                self.state = _BODY
            pending_request = self.request
            assert pending_request is not None
            request = pending_request
            length = request.content_length
            if len(self.inbuf) < length:
                return
            body = self.inbuf[:length]
            self.inbuf = self.inbuf[length:]
            self.request = None
            self.state = _WAIT
            served += 1
            self._dispatch(request, body)

    def _dispatch(self, request: Request, body: bytes) -> None:
        """Hand one request to :mod:`migratory.server.httpapi`, which answers now or later."""
        from migratory.server import httpapi

        later = False

        def respond(answered: Request, status: int, payload: bytes) -> None:
            self._respond(answered, status, payload)
            if later and self.state == _HEAD and self.inbuf:
                # answered from a callback: go on with pipelined requests on a fresh stack
                self.engine.loop.call_soon(self._http_received)

        httpapi.handle(self.engine, self, request, body, respond)
        later = True

    def _respond(self, request: Request, status: int, payload: bytes) -> None:
        """Send one HTTP response and get ready for the next request (the caller goes on with it)."""
        if self.state != _WAIT:
            return  # the connection closed while the answer was being prepared
        self.send(payload)
        self.engine.access(
            "http",
            self,
            method=request.method,
            path=request.path,
            status=status,
            subject=request.query.get("subject"),
            bytes_out=len(payload),
        )
        if not request.keep_alive:
            self.close("http_done")
            return
        self.state = _HEAD
        self.deadline = self.engine.loop.time() + self.engine.config.handshake_timeout / 1000.0

    def _http_error(
        self,
        status: int,
        reason: str,
        *,
        reason_code: str = "",
        request: Request | None = None,
        extra: dict[str, str] | None = None,
    ) -> None:
        """Refuse a request: log it (``denied`` and ``http``), answer ``{"error": reason}``, close."""
        engine = self.engine
        engine.deny(
            self.origin(), "http", reason_code or ("message_too_big" if status == 413 else "bad_request"), reason
        )
        payload = json_response(status, {"error": reason}, keep_alive=False, extra=extra)
        self.send(payload)
        engine.access(
            "http",
            self,
            method=request.method if request is not None else None,
            path=request.path if request is not None else None,
            status=status,
            subject=None,
            bytes_out=len(payload),
        )
        self.close("protocol_error" if status != 413 else "message_too_big")

    def _upgrade(self, request: Request) -> None:
        if request.method != "GET":
            self._http_error(405, "WebSocket upgrade requires GET", request=request)
            return
        if request.version != "HTTP/1.1":
            self._http_error(400, "WebSocket upgrade requires HTTP/1.1", request=request)
            return
        if not self.engine.ready:
            self._http_error(
                503,
                "this cluster member is synchronising; try another member",
                reason_code="not_ready",
                request=request,
            )
            return
        if request.headers.get("sec-websocket-version") != "13":
            self._http_error(
                426, "Sec-WebSocket-Version 13 required", request=request, extra={"Sec-WebSocket-Version": "13"}
            )
            return
        key = request.headers.get("sec-websocket-key", "")
        if not valid_key(key):
            self._http_error(
                400, "missing or malformed Sec-WebSocket-Key (must be base64 of 16 bytes)", request=request
            )
            return
        if request.content_length or request.has_transfer_encoding:
            self._http_error(400, "a WebSocket upgrade request has no body", request=request)
            return
        lines = [
            "HTTP/1.1 101 Switching Protocols",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Accept: {accept_key(key)}",
        ]
        offered = [s.strip() for s in request.headers.get("sec-websocket-protocol", "").split(",") if s.strip()]
        if "migratory.v1" in offered:
            lines.append("Sec-WebSocket-Protocol: migratory.v1")
        self.send(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        self.state = _WS
        self.connected = True
        engine = self.engine
        engine.stats.connections += 1
        engine.stats.connections_total += 1
        self.deadline = 0.0  # handshake done: keepalive timers take over
        engine.access("connect", self)
        engine.schedule(self, self.last_rx + engine.config.keep_alive_interval / 1000.0)
        if "token" in request.query:
            self._set_token(request.query["token"])
        rest = self.inbuf
        self.inbuf = b""
        if rest:
            self._ws_received(rest)

    # --- WebSocket --------------------------------------------------------------------

    def _ws_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:
            parser = self.parser = FrameParser(self.engine.max_message_size)
        try:
            frames = parser.feed(data)
        except WebSocketError as exc:
            self._ws_fail(exc.code, exc.reason, "protocol_error", "malformed")
            return
        if parser.idle:
            self.parser = None  # idle connections keep no parser (memory per connection)
        for frame in frames:
            if self.state != _WS:
                return
            opcode = frame.opcode
            if opcode == OP_BINARY:
                self.msgs_in += 1
                self._native(frame.payload)
            elif opcode == OP_PING:
                self.send(build_frame(OP_PONG, frame.payload))
            elif opcode == OP_PONG:
                pass
            elif opcode == OP_CLOSE:
                try:
                    code, _ = parse_close(frame.payload)
                except WebSocketError as exc:  # a forbidden code, a 1-byte payload, a reason not UTF-8
                    self._ws_fail(exc.code, exc.reason, "protocol_error", "malformed", notice=False)
                    return
                self.send(build_close(CLOSE_NORMAL if code == 1005 else code))
                self.close("client_closed")
                return
            elif opcode == OP_TOO_BIG:
                size = frame.payload.decode()
                reason = (
                    f"message of at least {size} bytes exceeds MessageSizeLimit "
                    f"({self.engine.max_message_size} bytes); it was discarded"
                )
                self.engine.deny(self.origin(), "frame", "message_too_big", reason)
                self.send(build_frame(OP_BINARY, p.encode_error(p.Status.TOO_LARGE, reason)))
            elif opcode == OP_TEXT:
                self._ws_fail(
                    CLOSE_UNSUPPORTED_DATA,
                    "the native protocol uses binary messages (see docs/protocol.md)",
                    "protocol_error",
                    "malformed",
                )
                return

    def _ws_fail(
        self, code: int, reason: str, disconnect_reason: str, reason_code: str, *, notice: bool = True
    ) -> None:
        """Report a fatal error to the client (native ERROR unless ``notice`` is false, then close frame) and close.

        ``notice=False`` answers a bad close frame: the peer has begun the closing
        handshake, so it gets only the close frame (RFC 6455 section 5.5.1).
        """
        self.engine.deny(self.origin(), "frame", reason_code, reason)
        if notice:
            self.send(build_frame(OP_BINARY, p.encode_error(p.Status.PROTOCOL_ERROR, reason)))
        self.send(build_close(code, reason))
        self.close(disconnect_reason)

    def _native(self, payload: bytes) -> None:
        received = time.perf_counter_ns()
        try:
            msg = p.decode_client(payload)
        except p.DecodeError as exc:
            self._ws_fail(
                CLOSE_POLICY_VIOLATION,
                f"malformed native message: {exc}",
                "protocol_error",
                "malformed",
            )
            return
        engine = self.engine
        if isinstance(msg, p.Publish):
            if not self.session_ready():
                return
            closure = msg.closure

            def reply(result: PublishResult) -> None:
                self.send(build_frame(OP_BINARY, p.encode_publish_status(result.status, closure, result.reason)))

            engine.publish(
                Message(
                    msg.subject,
                    msg.content,
                    msg.fields,
                    msg.retained,
                    QoS.GUARANTEED if msg.guaranteed else QoS.STANDARD,
                    msg.closure,
                    msg.publish_id,
                ),
                self.origin(),
                reply,
                received,
            )
        elif isinstance(msg, p.Subscribe):
            if not self.session_ready():
                return
            if msg.positions and self.version < 2:
                self._ws_fail(
                    CLOSE_POLICY_VIOLATION,
                    "SUBSCRIBE with positions needs protocol version 2",
                    "protocol_error",
                    "malformed",
                )
                return
            if engine.async_entitlement:
                engine.in_order(self.session, self._subscribe_after_decisions(msg))
            else:
                for i, subject in enumerate(msg.subjects):
                    self._subscribe_one(subject, msg.conflation_ms, position=_position(msg, i))
        elif isinstance(msg, p.Unsubscribe):
            if not self.session_ready():
                return
            if engine.async_entitlement:
                engine.in_order(self.session, self._unsubscribe_in_order(msg.subjects))
            else:
                for subject in msg.subjects:
                    engine.unsubscribe(self, subject)
        elif isinstance(msg, p.Connect):
            if msg.version not in p.SUPPORTED_VERSIONS:
                spoken = " and ".join(str(v) for v in p.SUPPORTED_VERSIONS)
                self._ws_fail(
                    CLOSE_POLICY_VIOLATION,
                    f"protocol version {msg.version} not supported (this server speaks {spoken})",
                    "protocol_error",
                    "malformed",
                )
                return
            if msg.token:
                self._set_token(msg.token)
            self.hello = True
            self.version = msg.version
            connected = p.encode_connected(self.session, engine.epoch, msg.version, engine.max_message_size)
            self.send(build_frame(OP_BINARY, connected))

    def _subscribe_one(
        self,
        subject: str,
        conflation_ms: int,
        decided: Decision | bool = False,
        position: tuple[int, int] | None = None,
    ) -> None:
        status, reason = self.engine.subscribe(self, subject, conflation_ms, decided)
        self.send(build_frame(OP_BINARY, p.encode_subscribe_status(status, subject, reason)))
        if status == p.Status.OK:
            for frame in self.engine.initial_frames(self.version, subject, position):
                self.send(frame)

    async def _subscribe_after_decisions(self, msg: p.Subscribe) -> None:
        """Asynchronous custom entitlement: await each decision, in order, then subscribe."""
        engine = self.engine
        for i, subject in enumerate(msg.subjects):
            if not self.open:
                return
            decided: Decision | bool = False
            if engine.check_subject(subject) is None:
                decided = await engine.custom_decision("authorize_subscribe", self.origin(), subject)
            if self.open:
                self._subscribe_one(subject, msg.conflation_ms, decided, _position(msg, i))

    async def _unsubscribe_in_order(self, subjects: tuple[str, ...]) -> None:
        for subject in subjects:
            self.engine.unsubscribe(self, subject)

    def session_ready(self) -> bool:
        """Requests before CONNECT are refused with NOT_CONNECTED, and the session closed."""
        if self.hello:
            return True
        self.engine.deny(self.origin(), "connect", "not_connected", "CONNECT must be the first message")
        self.send(
            build_frame(
                OP_BINARY,
                p.encode_error(p.Status.NOT_CONNECTED, "CONNECT must be the first message"),
            )
        )
        self.send(build_close(CLOSE_POLICY_VIOLATION, "CONNECT must be the first message"))
        self.close("protocol_error")
        return False


def _position(msg: p.Subscribe, i: int) -> tuple[int, int] | None:
    """The recovery position a version 2 client sent for its i-th subject (None: it saw nothing)."""
    if not msg.positions:
        return None
    position = msg.positions[i]
    return position if position != (0, 0) else None
