"""The native protocol session of one client: what it may do, and what it gets back.

One place for CONNECT (protocol version, entitlement token and its expiry),
SUBSCRIBE (entitlement, limits, the snapshot or the recovery of what was missed),
UNSUBSCRIBE, PUBLISH (and its status), and the order of a client's requests under
asynchronous entitlement. Transports carry it: a WebSocket or an HTTP stream
(migratory/server/sessions/connection.py), later MQTT. A transport is a subclass that
provides the few hooks below; a session never writes bytes itself.

Messages to the client are handed to :meth:`send` as WebSocket binary frames, the
form the engine builds once per publication for every subscriber; a transport that
frames messages differently converts them (only its own connections pay for it).
"""

from __future__ import annotations

import time
from typing import Any, cast

from migratory import protocol as p
from migratory.entitlement import Decision
from migratory.message import Message, QoS
from migratory.server.engine.core import Origin, PublishResult
from migratory.server.engine.types import Client
from migratory.server.sessions.base import ConnectionBase
from migratory.subscriptions import SubjectSet, subject_set_items
from migratory.websocket import CLOSE_POLICY_VIOLATION, OP_BINARY, build_frame

__all__ = ["Session"]


def _frame(payload: bytes) -> bytes:
    return build_frame(OP_BINARY, payload)


class Session(ConnectionBase):
    """The session half of a client connection: its state here, its transport in a subclass."""

    __slots__ = ("hello", "subscriptions", "token", "token_expiry", "version")

    last_rx: float

    def __init__(self) -> None:
        self.hello = False  # CONNECT was received
        self.version = 1  # the native protocol version the client spoke in CONNECT
        self.token = ""
        self.token_expiry = 0.0  # wall-clock time the entitlement token expires (0: never)
        self.subscriptions: SubjectSet = ()

    # --- what a transport provides ---------------------------------------------------------

    def release_input(self, waiting: list[Any]) -> None:
        """Read this client again, first what arrived while it was held (``waiting``, as held)."""

    @property
    def session(self) -> str:
        raise NotImplementedError

    @property
    def open(self) -> bool:
        raise NotImplementedError

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def close(self, reason: str) -> None:
        raise NotImplementedError

    def origin(self) -> Origin:
        raise NotImplementedError

    def fail(self, status: p.Status, reason: str, close_code: int = CLOSE_POLICY_VIOLATION) -> None:
        """A fatal session error: tell the client (ERROR), end the session, close."""
        raise NotImplementedError

    # --- the session -----------------------------------------------------------------------

    def native(self, payload: bytes) -> None:
        """One native message from the client."""
        received = time.perf_counter_ns()
        try:
            msg = p.decode_client(payload)
        except p.DecodeError as exc:
            self.engine.deny(self.origin(), "frame", "malformed", f"malformed native message: {exc}")
            self.fail(p.Status.PROTOCOL_ERROR, f"malformed native message: {exc}")
            return
        engine = self.engine
        if isinstance(msg, p.Publish):
            if not self.session_ready():
                return
            closure = msg.closure
            engine.publish_started(self)

            def reply(result: PublishResult) -> None:
                engine.publish_done(self)
                self.send(_frame(p.encode_publish_status(result.status, closure, result.reason)))

            message = Message(
                msg.subject,
                msg.content,
                msg.fields,
                msg.retained,
                QoS.GUARANTEED if msg.guaranteed else QoS.STANDARD,
                msg.closure,
                msg.publish_id,
            )
            engine.publish(message, self.origin(), reply, received)
        elif isinstance(msg, p.Subscribe):
            if not self.session_ready():
                return
            if msg.positions and self.version < 2:
                reason = "SUBSCRIBE with positions needs protocol version 2"
                self.engine.deny(self.origin(), "frame", "malformed", reason)
                self.fail(p.Status.PROTOCOL_ERROR, reason)
                return
            if engine.async_entitlement:
                engine.in_order(self.session, self._subscribe_after_decisions(msg))
            else:
                for i, subject in enumerate(msg.subjects):
                    self.subscribe_one(subject, msg.conflation_ms, position=_position(msg, i))
        elif isinstance(msg, p.Unsubscribe):
            if not self.session_ready():
                return
            if engine.async_entitlement:
                engine.in_order(self.session, self._unsubscribe_in_order(msg.subjects))
            else:
                for subject in msg.subjects:
                    engine.unsubscribe(self.connection, subject)
        elif isinstance(msg, p.Connect):
            if msg.version not in p.SUPPORTED_VERSIONS:
                spoken = " and ".join(str(v) for v in p.SUPPORTED_VERSIONS)
                reason = f"protocol version {msg.version} not supported (this server speaks {spoken})"
                self.engine.deny(self.origin(), "frame", "malformed", reason)
                self.fail(p.Status.PROTOCOL_ERROR, reason)
                return
            if msg.token:
                self.set_token(msg.token)
            self.hello = True
            self.version = msg.version
            connected = p.encode_connected(
                self.session, engine.epoch, msg.version, engine.max_message_size, engine.keepalive_ms
            )
            self.send(_frame(connected))
            if engine.keepalive_ms and msg.version >= 3:  # the keep-alive's first check, sooner than a ping's
                engine.schedule(self.connection, engine.loop.time() + engine.keepalive_ms / 3000.0)

    @property
    def connection(self) -> Client:
        """This session as the engine knows its subscribers (the transport object itself)."""
        return cast("Client", self)

    def subscribe_one(
        self,
        subject: str,
        conflation_ms: int,
        decided: Decision | bool = False,
        position: tuple[int, int] | None = None,
    ) -> None:
        status, reason = self.engine.subscribe(self.connection, subject, conflation_ms, decided)
        self.send(_frame(p.encode_subscribe_status(status, subject, reason)))
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
                self.subscribe_one(subject, msg.conflation_ms, decided, _position(msg, i))

    async def _unsubscribe_in_order(self, subjects: tuple[str, ...]) -> None:
        for subject in subjects:
            self.engine.unsubscribe(self.connection, subject)

    def session_ready(self) -> bool:
        """Requests before CONNECT are refused with NOT_CONNECTED, and the session closed."""
        if self.hello:
            return True
        self.engine.deny(self.origin(), "connect", "not_connected", "CONNECT must be the first message")
        self.fail(p.Status.NOT_CONNECTED, "CONNECT must be the first message")
        return False

    def set_token(self, token: str) -> None:
        """The entitlement token; its expiry (a JWT's exp) revokes the subscriptions."""
        self.token = token
        expiry = self.engine.entitlement.expires_at(token) if token else None
        self.token_expiry = expiry or 0.0
        if expiry:
            engine = self.engine
            engine.schedule(
                self.connection, min(engine.loop.time() + max(0.0, expiry - time.time()), self.last_rx + 1.0)
            )

    def revoke_subscriptions(self) -> None:
        """The entitlement token expired: withdraw every subscription, and say so."""
        self.token_expiry = 0.0
        engine = self.engine
        for subject in subject_set_items(self.subscriptions):
            engine.unsubscribe(self.connection, subject)
            engine.deny(self.origin(), "subscribe", "entitlement", "the token has expired", subject)
            self.send(_frame(p.encode_subscribe_status(p.Status.REVOKED, subject, "the token has expired")))


def _position(msg: p.Subscribe, i: int) -> tuple[int, int] | None:
    """The recovery position a version 2 client sent for its i-th subject (None: it saw nothing)."""
    if not msg.positions:
        return None
    position = msg.positions[i]
    return position if position != (0, 0) else None
