"""MQTT QoS 1 and 2 through a member's death, with paho (a client nobody here wrote).

A persistent session (clean session 0, and MQTT 5 with a session expiry) subscribes on one
member of a three-member Guaranteed cluster; a publisher on another member publishes QoS 1
without pause; the subscriber's member is SIGKILLed; later the subscriber comes back with the
same client id on the third member and must get every acknowledged publication, in order,
with redeliveries flagged DUP (docs/mqtt.md, "Sessions"); at QoS 2, every one exactly once. The same
holds in a Standard cluster, whose members cache what stored sessions want although they cache
nothing for native clients.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from migratory.bench.cluster import LocalCluster, free_ports

pytestmark = pytest.mark.slow


class Subscriber:
    """A paho session that records (number, dup) for each message."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.got: list[tuple[int, bool]] = []
        self.lock = threading.Lock()
        self.client: mqtt.Client | None = None

    def connect(self, host: str, port: int) -> None:
        kwargs: dict[str, object] = {"client_id": "persistent-sub", "protocol": self.version}
        props = None
        if self.version == mqtt.MQTTv311:
            kwargs["clean_session"] = False
        else:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 600
        client = mqtt.Client(CallbackAPIVersion.VERSION2, **kwargs)  # type: ignore[arg-type]
        client.on_message = self._on_message
        connected = threading.Event()
        client.on_connect = lambda *_: connected.set()
        if self.version == mqtt.MQTTv5:
            client.connect(host, port, clean_start=False, properties=props)
        else:
            client.connect(host, port)
        client.loop_start()
        assert connected.wait(10)
        self.client = client

    def _on_message(self, _c: mqtt.Client, _u: object, message: mqtt.MQTTMessage) -> None:
        with self.lock:
            self.got.append((int(message.payload), bool(message.dup)))

    def numbers(self) -> list[int]:
        with self.lock:
            return [n for n, _ in self.got]


def _mqtt_listeners(cluster: LocalCluster) -> dict[int, int]:
    """A ListenMqtt for every member, before they start: member index -> its MQTT port."""
    ports = {}
    for member in cluster.members:
        ports[member.index] = free_ports(member.host, 1)[0]
        with member.conf.open("a") as conf:
            conf.write(f"ListenMqtt = {member.host}:{ports[member.index]}\n")
    return ports


@pytest.mark.parametrize(
    ("version", "mode", "qos"),
    [
        (mqtt.MQTTv311, "Guaranteed", 1),
        (mqtt.MQTTv5, "Guaranteed", 1),
        (mqtt.MQTTv5, "Standard", 1),
        (mqtt.MQTTv311, "Guaranteed", 2),
    ],
)
def test_a_persistent_session_gets_every_message_after_its_member_is_killed(
    tmp_path: Path, version: int, mode: str, qos: int
) -> None:
    base = {(mqtt.MQTTv311, "Guaranteed", 1): 51, (mqtt.MQTTv5, "Guaranteed", 1): 54, (mqtt.MQTTv5, "Standard", 1): 57}
    base = base.get((version, mode, qos), 60)
    with LocalCluster(tmp_path, 3, mode=mode, base=base) as cluster:
        ports = _mqtt_listeners(cluster)
        cluster.start_all()
        sub = Subscriber(version)
        sub.connect(cluster[0].host, ports[0])
        assert sub.client is not None
        subscribed = threading.Event()
        sub.client.on_subscribe = lambda *_: subscribed.set()
        sub.client.subscribe("orders/eu", qos=qos)
        assert subscribed.wait(10)
        pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="publisher", protocol=version)
        pub.connect(cluster[1].host, ports[1])
        pub.loop_start()
        acknowledged = []
        try:
            for n in range(1, 301):
                info = pub.publish("orders/eu", str(n).encode(), qos=qos)
                info.wait_for_publish(10)
                assert info.is_published(), f"publication {n} not acknowledged"
                acknowledged.append(n)
                if n == 100:
                    deadline = time.monotonic() + 10
                    while len(sub.numbers()) < 100 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    sub.client.loop_stop()
                    cluster.kill(0)  # the subscriber's member dies with its session's connection
                if n == 200:
                    sub.connect(cluster[2].host, ports[2])  # the same client id, on another member
        finally:
            pub.loop_stop()
        deadline = time.monotonic() + 15
        while set(acknowledged) - set(sub.numbers()) and time.monotonic() < deadline:
            time.sleep(0.05)
        numbers = sub.numbers()
        assert sorted(set(acknowledged) - set(numbers)) == [], "acknowledged messages lost"
        first_seen = list(dict.fromkeys(numbers))
        assert first_seen == sorted(first_seen), "out of order"
        if qos == 2:
            assert numbers == sorted(set(numbers)), "QoS 2: a message delivered twice"
        with sub.lock:
            seen: set[int] = set()
            for number, dup in sub.got:
                assert number not in seen or dup, f"{number} delivered twice without the DUP flag"
                seen.add(number)
        if sub.client is not None:
            sub.client.loop_stop()
        if mode == "Standard":  # a clean session takes its client id from a connection on another member
            ended = threading.Event()
            first = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="clean-roamer", protocol=mqtt.MQTTv5)
            first.on_disconnect = lambda *_: ended.set()
            first.connect(cluster[1].host, ports[1], clean_start=True)
            first.loop_start()
            time.sleep(0.5)
            second = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="clean-roamer", protocol=mqtt.MQTTv5)
            second.connect(cluster[2].host, ports[2], clean_start=True)
            second.loop_start()
            try:
                assert ended.wait(5), "the connection on the other member kept the client id"
            finally:
                first.loop_stop()
                second.loop_stop()


def test_a_shared_subscription_spreads_over_the_members_of_a_cluster_once_each(tmp_path: Path) -> None:
    """$share/{group}/{filter} with members on every cluster member: each message to exactly one of them, every
    member of the cluster taking a share; when one cluster member's group members leave, the others take all."""
    with LocalCluster(tmp_path, 3, mode="Standard", base=63) as cluster:
        ports = _mqtt_listeners(cluster)
        cluster.start_all()
        got: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
        lock = threading.Lock()
        clients = []
        for index in range(3):
            for n in range(2):
                client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sh-{index}-{n}", protocol=mqtt.MQTTv5)

                def on_message(_c: mqtt.Client, _u: object, message: mqtt.MQTTMessage, index: int = index) -> None:
                    with lock:
                        got[index].append(message.payload)

                client.on_message = on_message
                subscribed = threading.Event()
                client.on_subscribe = lambda *_, done=subscribed: done.set()
                client.connect(cluster[index].host, ports[index])
                client.loop_start()
                client.subscribe("$share/billing/invoices/+", qos=1)
                assert subscribed.wait(10)
                clients.append(client)
        time.sleep(1.5)  # every worker of every member hears who holds the group
        pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="sh-pub", protocol=mqtt.MQTTv5)
        pub.connect(cluster[0].host, ports[0])
        pub.loop_start()

        def publish(numbers: range) -> list[bytes]:
            sent = []
            for n in numbers:
                info = pub.publish(f"invoices/{n % 7}", f"invoice {n}".encode(), qos=1)
                info.wait_for_publish(10)
                sent.append(f"invoice {n}".encode())
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with lock:
                    if sum(len(v) for v in got.values()) >= len(sent):
                        break
                time.sleep(0.05)
            time.sleep(0.5)  # and no second copy
            return sent

        try:
            sent = publish(range(90))
            with lock:
                seen = sorted(p for v in got.values() for p in v)
                shares = {k: len(v) for k, v in got.items()}
            assert seen == sorted(sent), (len(seen), shares)
            assert all(shares.values()), shares  # every cluster member took some
            for client in clients[4:]:  # member 2's group members leave
                client.disconnect()
                client.loop_stop()
            time.sleep(1.5)
            with lock:
                for v in got.values():
                    v.clear()
            sent = publish(range(90, 150))
            with lock:
                seen = sorted(p for v in got.values() for p in v)
                shares = {k: len(v) for k, v in got.items()}
            assert seen == sorted(sent), (len(seen), shares)
            assert shares[2] == 0 and shares[0] and shares[1], shares
        finally:
            pub.loop_stop()
            for client in clients[:4]:
                client.loop_stop()
