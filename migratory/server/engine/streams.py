"""The HTTP streams of one worker, by connection number, and their unguessable ids.

A stream id (``w<worker>.<sid>.<tag>``) lets whoever holds it act as the client (POST
its input), so it carries an HMAC of the number under a secret of this process; the
worker it names may be another one of the node, which the engine relays to.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import cast

from migratory.server.engine.types import Client, Stream

__all__ = ["StreamRegistry"]


class StreamRegistry:
    """Open HTTP streams of this worker."""

    __slots__ = ("_secret", "streams", "worker")

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self.streams: dict[int, Client] = {}  # a Stream once it streams
        self._secret = secrets.token_bytes(16)

    def _tag(self, sid: int) -> str:
        return hmac.new(self._secret, str(sid).encode(), hashlib.sha256).hexdigest()[:24]

    def open(self, stream: Client) -> str:
        """Register a stream; its id names this worker and is unguessable."""
        self.streams[stream.sid] = stream
        return f"w{self.worker}.{stream.sid}.{self._tag(stream.sid)}"

    def forget(self, client: Client) -> None:
        if self.streams.get(client.sid) is client:
            del self.streams[client.sid]

    @staticmethod
    def worker_of(stream_id: str) -> int | None:
        """The worker a stream id names, or None when it is not a stream id at all."""
        worker_text, _, rest = stream_id.partition(".")
        sid_text, _, _ = rest.partition(".")
        if not (worker_text.startswith("w") and worker_text[1:].isdigit() and sid_text.isdigit()):
            return None
        return int(worker_text[1:])

    def input(self, stream_id: str, payload: bytes) -> bool:
        """Feed a POSTed native message to this worker's stream; False if the id is unknown or forged."""
        _, _, rest = stream_id.partition(".")
        sid_text, _, tag = rest.partition(".")
        if not sid_text.isdigit():
            return False
        sid = int(sid_text)
        stream = self.streams.get(sid)
        if stream is None or not hmac.compare_digest(tag, self._tag(sid)):
            return False
        cast(Stream, stream).stream_input(payload)  # registered by the session as it became a stream
        return True

    def __len__(self) -> int:
        return len(self.streams)
