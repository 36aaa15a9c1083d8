"""One client connection, the transport of a session: HTTP requests, a WebSocket, or an HTTP stream.

Driven by ``asyncio.Protocol`` callbacks, with no task, reader or timer of its own
(an idle connection is this object, its transport and a few small attributes).
The first bytes are an HTTP request head: a WebSocket upgrade switches the
connection to frames carrying the native protocol, whose session logic lives in
migratory/server/sessions/native.py; ``GET /stream`` switches it to HTTP streaming (the
fallback for clients behind proxies that strip ``Upgrade``, :class:`StreamConnection`);
anything else is served by :mod:`migratory.server.sessions.httpapi`.

Output is queued with :meth:`Connection.send` (the same ``bytes`` object for every
subscriber of a message) and written by :meth:`Connection.flush`, which the engine
calls once per loop turn or batching period. Pending output is bounded by
``MaxPendingOutput``; past it ``SlowConsumerPolicy`` applies.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

from migratory import protocol as p
from migratory.http import HttpError, Request, json_response, parse_request_head
from migratory.server.engine.core import Engine, Origin
from migratory.server.sessions.base import ConnectionBase
from migratory.server.sessions.native import Session
from migratory.websocket import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY_VIOLATION,
    CLOSE_TRY_AGAIN_LATER,
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
    frame_payload,
    parse_close,
    valid_key,
)

__all__ = ["Connection", "StreamConnection"]

_HEAD = 0
_BODY = 1
_WAIT = 2  # an HTTP request is being answered (a publish waits for its coordinator)
_WS = 3
_CLOSING = 4
_CLOSED = 5

_PIPELINE_BATCH = 64
"""Pipelined HTTP requests served per call before yielding to the event loop."""


class Connection(Session, asyncio.Protocol):
    """Per-connection state; ``__slots__`` keep an idle one small.

    Why it is long: one socket's whole life is one state machine (HTTP/1.1 head, the WebSocket
    upgrade, frames, HTTP streaming, keepalive and closing) over the same few slots; splitting it
    would put a second object, and its memory, on every idle connection.
    """

    __slots__ = (
        "bytes_in",
        "connected",
        "deadline",
        "inbuf",
        "ka_mark",
        "last_rx",
        "listener",
        "msgs_in",
        "parser",
        "ping_sent",
        "reason",
        "request",
        "scheme",
        "started",
        "state",
        "wheel_at",
    )

    def __init__(self, engine: Engine, listener: str, scheme: str) -> None:
        super().__init__()
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
        self.sid = 0
        self.connected = False
        self.addr = ""
        self.port = 0
        self.reason = ""
        self.request: Request | None = None
        self.started = 0.0
        self.last_rx = 0.0
        self.deadline = 0.0
        self.ping_sent = 0.0
        self.ka_mark = -1  # msgs_out at the last keep-alive check (protocol version 3); -1: none yet
        self.msgs_in = 0
        self.msgs_out = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.wheel_at = 0  # the engine's timer-wheel slot holding this connection (0: none)

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
        if not self.admitted(transport):
            self.state = _CLOSING
            return
        engine = self.engine
        now = engine.loop.time()
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
        if engine.inflight or engine.held:  # held with nothing in flight: waiting for the worker's budget
            engine.forget_session(self)
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

    send = ConnectionBase.queue_output  # the engine's fan-out calls it once per delivery: no wrapper

    def flush(self) -> None:
        """Write everything pending in one call (unless the kernel asked us to pause)."""
        data = self.take_output()
        if data is not None:
            assert self.transport is not None
            self.transport.write(data)

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

    def send_away(self, reason: str) -> None:
        """This member cannot serve (cut off from the cluster's majority): close 1013, so the client goes elsewhere."""
        if self.state == _WS:
            self.send(build_close(CLOSE_TRY_AGAIN_LATER, reason[:100]))
            self.flush()
        self.close("sent_away")

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
            self.revoke_subscriptions()
        if engine.held and self in engine.held:  # not read on purpose (backpressure): its silence is ours
            self.ping_sent = 0.0
            engine.schedule(self, now + interval)
            return
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
        if engine.keepalive_ms and self.version >= 3 and self.hello:
            # nothing sent since the last check (a third of the promised silence ago): a NOTIFY says we live
            sent = self.msgs_out != self.ka_mark
            if not sent:
                self.send(engine.keepalive_frame)
            self.ka_mark = self.msgs_out + (not sent)  # the keep-alive itself is not news: the next check may send one
            next_check = min(next_check, now + engine.keepalive_ms / 3000.0)
        if self.token_expiry:
            next_check = min(next_check, now + max(0.0, self.token_expiry - time.time()))
        engine.schedule(self, next_check)

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
        """Hand one request to :mod:`migratory.server.sessions.httpapi`, which answers now or later."""
        from migratory.server.sessions import httpapi

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

    def _refused_not_ready(self, request: Request) -> bool:
        """A member still synchronising answers 503 so the client tries another (True: refused)."""
        if self.engine.ready:
            return False
        why = self.engine.not_ready_reason() or "this cluster member is synchronising"
        self._http_error(503, f"{why}; try another member", reason_code="not_ready", request=request)
        return True

    def _upgrade(self, request: Request) -> None:
        if request.method != "GET":
            self._http_error(405, "WebSocket upgrade requires GET", request=request)
            return
        if request.version != "HTTP/1.1":
            self._http_error(400, "WebSocket upgrade requires HTTP/1.1", request=request)
            return
        if self._refused_not_ready(request):
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
        if request.path == "/mqtt":
            self._upgrade_mqtt(request, lines, offered)  # admitted at its CONNECT
            return
        wait = self.engine.admission.admit(self.engine.loop.time())
        if wait:
            self._http_error(
                503,
                f"this server admits {self.engine.config.admission_rate} new sessions a second (AdmissionRate); "
                f"come back in {wait} s",
                reason_code="admission",
                request=request,
                extra={"Retry-After": str(wait)},
            )
            return
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
            self.set_token(request.query["token"])
        rest = self.inbuf
        self.inbuf = b""
        if rest:
            self._ws_received(rest)

    def _upgrade_mqtt(self, request: Request, lines: list[str], offered: list[str]) -> None:
        """``/mqtt``: MQTT over WebSocket; the connection is handed to an MQTT session (same transport)."""
        from migratory.server.sessions.mqtt import mqtt_connection

        if "mqtt" not in offered:
            self._http_error(400, "MQTT over WebSocket needs the subprotocol mqtt", request=request)
            return
        lines.append("Sec-WebSocket-Protocol: mqtt")
        self.send(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        self.flush()
        transport = self.transport
        assert transport is not None
        engine = self.engine
        mqtt = mqtt_connection(engine, self.listener, "wss-mqtt" if self.tls else "ws-mqtt")
        rest, self.inbuf = self.inbuf, b""
        # this object leaves quietly: no disconnect is logged for it, its timer and registration go
        self.state = _CLOSED
        self.transport = None
        engine.unregister(self)
        mqtt.adopt(transport, self.addr, self.port, self.sid, rest)

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
        self._frames(frames)

    def release_input(self, waiting: list[Any]) -> None:
        if self.transport is None or self.state != _WS:
            return
        if not self.paused:
            self.transport.resume_reading()
        if waiting:
            self.engine.loop.call_soon(self._frames, waiting)

    def _frames(self, frames: list[Any]) -> None:
        held = self.engine.held
        for i, frame in enumerate(frames):
            if self.state != _WS:
                return
            if held and self in held:  # a publication before this one filled a budget: the rest waits
                held[self].extend(frames[i:])
                return
            opcode = frame.opcode
            if opcode == OP_BINARY:
                self.msgs_in += 1
                self.native(frame.payload)
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

    def fail(self, status: p.Status, reason: str, close_code: int = CLOSE_POLICY_VIOLATION) -> None:
        """A fatal session error on a WebSocket: native ERROR, close frame, close."""
        self.send(build_frame(OP_BINARY, p.encode_error(status, reason)))
        self.send(build_close(close_code, reason))
        self.close("protocol_error")

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

    # --- HTTP streaming ----------------------------------------------------------------

    def start_stream(self, request: Request) -> None:
        """``GET /stream``: become an HTTP stream carrying this client's session (docs/protocol.md)."""
        engine = self.engine
        if self._refused_not_ready(request):
            return
        stream = engine.open_stream(self)
        head = (
            "HTTP/1.1 200 OK\r\n"
            "Content-Type: application/octet-stream\r\n"
            "Cache-Control: no-store\r\n"
            "X-Accel-Buffering: no\r\n"
            "Access-Control-Allow-Origin: *\r\n"
            "Access-Control-Expose-Headers: X-Migratory-Stream\r\n"
            f"X-Migratory-Stream: {stream}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        self.flush()
        self.send(head.encode("latin-1"))
        self.flush()
        self.__class__ = StreamConnection  # same slots: the object stays, its transport changes
        self.state = _WS
        self.connected = True
        self.inbuf = b""
        engine.stats.connections += 1
        engine.stats.connections_total += 1
        self.deadline = 0.0
        engine.access("connect", self, path="/stream")
        engine.schedule(self, engine.loop.time() + engine.config.keep_alive_interval / 1000.0)
        if "token" in request.query:
            self.set_token(request.query["token"])


_LENGTH = struct.Struct("!I")
_KEEPALIVE = _LENGTH.pack(0)


class StreamConnection(Connection):
    """HTTP streaming: the session's messages as length-prefixed frames in a chunked response.

    A connection becomes one by ``GET /stream`` (class assignment, same slots), so
    WebSocket connections pay nothing for the fallback: only these convert the
    engine's WebSocket frames (``u32`` length + the native message, one HTTP chunk per
    flush). The client's messages arrive as ``POST /stream/<id>`` on other connections
    (:meth:`Engine.stream_input`), possibly through another worker.
    """

    __slots__ = ()

    @property
    def protocol(self) -> str:
        return "https-stream" if self.tls else "http-stream"

    def send(self, data: bytes) -> None:
        opcode = data[0] & 0x0F
        if opcode != OP_BINARY:
            if opcode == OP_PING:
                super().send(_KEEPALIVE)
            return  # pongs and close frames have no meaning here: the stream's end is the close
        payload = frame_payload(data)
        super().send(_LENGTH.pack(len(payload)) + payload)

    def flush(self) -> None:
        body = self.take_output()
        if body is not None:
            assert self.transport is not None
            self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    def data_received(self, data: bytes) -> None:
        """Nothing may follow ``GET /stream`` on its connection (messages are POSTed)."""
        self.last_rx = self.engine.loop.time()
        if data.strip():
            self.abort("protocol_error")

    def fail(self, status: p.Status, reason: str, close_code: int = CLOSE_POLICY_VIOLATION) -> None:
        self.send(build_frame(OP_BINARY, p.encode_error(status, reason)))
        self.close("protocol_error")

    def close(self, reason: str) -> None:
        """End the stream properly (the last chunk), then close."""
        if self.state < _CLOSING and self.transport is not None:
            self.flush()
            self.transport.write(b"0\r\n\r\n")
        super().close(reason)

    def shutdown(self) -> None:
        self.close("server_shutdown")

    def send_away(self, reason: str) -> None:
        self.close("sent_away")  # an HTTP stream's end: the client opens another, on another member

    def on_timer(self, now: float) -> None:
        """No pings to answer on a stream: a zero-length frame every KeepAliveInterval keeps proxies from cutting it."""
        engine = self.engine
        if self.token_expiry and time.time() >= self.token_expiry:
            self.revoke_subscriptions()
        next_check = now + engine.config.keep_alive_interval / 1000.0
        if engine.keepalive_ms and self.version >= 3 and self.hello:
            sent = self.msgs_out != self.ka_mark
            if not sent:
                self.send(engine.keepalive_frame)  # protocol version 3: the client's watchdog hears it
            self.ka_mark = self.msgs_out + (not sent)
            next_check = min(next_check, now + engine.keepalive_ms / 3000.0)
        else:
            self.send(build_frame(OP_PING, b""))
        if self.token_expiry:
            next_check = min(next_check, now + max(0.0, self.token_expiry - time.time()))
        engine.schedule(self, next_check)

    def stream_input(self, payload: bytes) -> None:
        """One native message the client POSTed."""
        self.last_rx = self.engine.loop.time()
        self.msgs_in += 1
        self.bytes_in += len(payload)
        if self.open:
            self.native(payload)
