"""An MQTT subscriber in the fault rounds: paho-mqtt (a client nobody here wrote), QoS 1, a persistent
session over WebSocket (``/mqtt`` on the members' client port), connected to the member the fault
hits. When its connection drops it comes back, with the same client id, on the next member that
answers; at the end of the round every acknowledged publication must have reached it, each
subject's messages in the cluster's order, and a message twice only with the DUP flag
(docs/mqtt.md, "Sessions").
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["MqttObserver", "available", "check_mqtt"]


def available() -> bool:
    try:
        import paho.mqtt.client  # noqa: F401
    except ImportError:
        return False
    return True


class MqttObserver:
    """One persistent MQTT session that follows the cluster's members."""

    def __init__(self, client_id: str, members: list[tuple[str, int]], first: int, topics: list[str]) -> None:
        self.client_id = client_id
        self.members = members
        self.index = first
        self.topics = topics
        self.lock = threading.Lock()
        self.received: list[tuple[str, bytes, bool]] = []
        self.reconnections = 0
        self.sessions_lost = 0  # reconnections that found no session (session present 0)
        self._client: Any = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 20.0) -> None:
        """Connect and subscribe (QoS 1) on the first member; raise if that fails."""
        if not self._connect(self.index, subscribe=True, timeout=timeout):
            raise RuntimeError(f"MQTT observer: no session on member {self.index + 1}")
        self._thread = threading.Thread(target=self._follow, name=f"mqtt-{self.client_id}", daemon=True)
        self._thread.start()

    def _connect(self, index: int, *, subscribe: bool, timeout: float = 5.0) -> bool:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        host, port = self.members[index]
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            clean_session=False,
            transport="websockets",
            reconnect_on_failure=False,
        )
        client.ws_set_options(path="/mqtt")
        connected = threading.Event()
        subscribed = threading.Event()
        present: list[bool] = []

        def on_connect(_c: Any, _u: Any, flags: Any, reason: Any, _p: Any) -> None:
            if not reason.is_failure:
                present.append(bool(flags.session_present))
                connected.set()

        client.on_connect = on_connect
        client.on_subscribe = lambda *_: subscribed.set()
        client.on_message = self._on_message
        try:
            client.connect(host, port, keepalive=10)
        except OSError:
            return False
        client.loop_start()
        if not connected.wait(timeout):
            client.loop_stop()
            return False
        if not subscribe and not present[0]:
            self.sessions_lost += 1
        if subscribe:
            client.subscribe([(topic, 1) for topic in self.topics])
            if not subscribed.wait(timeout):
                client.loop_stop()
                return False
        self._client = client
        self.index = index
        return True

    def _on_message(self, _client: Any, _userdata: Any, message: Any) -> None:
        with self.lock:
            self.received.append((message.topic, bytes(message.payload), bool(message.dup)))

    def _follow(self) -> None:
        """Reconnect to the next member whenever the connection is lost."""
        while not self._stopped.is_set():
            client = self._client
            if client is not None and client.is_connected():
                self._stopped.wait(0.2)
                continue
            if client is not None:
                client.loop_stop()
                self._client = None
            self._stopped.wait(0.5)
            for step in range(1, len(self.members) + 1):
                if self._stopped.is_set():
                    return
                if self._connect((self.index + step) % len(self.members), subscribe=False):
                    self.reconnections += 1
                    break

    def payloads(self, topic: str) -> list[tuple[bytes, bool]]:
        with self.lock:
            return [(payload, dup) for t, payload, dup in self.received if t == topic]

    def wait_for(self, expected: dict[str, set[bytes]], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(want <= {p for p, _ in self.payloads(topic)} for topic, want in expected.items()):
                return
            time.sleep(0.1)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(5)
        client = self._client
        if client is not None:
            client.disconnect()
            client.loop_stop()


def check_mqtt(observer: MqttObserver, acked: dict[str, list[bytes]], order: dict[str, list[bytes]]) -> list[str]:
    """Violations: acknowledged publications missing, out of the cluster's order, or twice without DUP."""
    violations: list[str] = []
    if observer.sessions_lost:
        violations.append(f"mqtt: {observer.sessions_lost} reconnections found no session")
    for subject, contents in acked.items():
        got = observer.payloads(subject[1:])
        seen = {payload for payload, _ in got}
        missing = [c for c in contents if c not in seen]
        if missing:
            violations.append(f"mqtt: {len(missing)} acknowledged messages of {subject} never reached the session")
        first: list[bytes] = []
        counted: set[bytes] = set()
        for payload, dup in got:
            if payload in counted:
                if not dup:
                    violations.append(f"mqtt: {subject} {payload!r} delivered twice without the DUP flag")
                continue
            counted.add(payload)
            first.append(payload)
        position = {c: i for i, c in enumerate(order.get(subject, []))}
        ranks = [position[p] for p in first if p in position]
        if ranks != sorted(ranks):
            violations.append(f"mqtt: {subject} delivered out of the cluster's order")
    return violations
