"""Configuration: one ``migratorydata.conf`` loaded into one frozen, typed :class:`Config`.

File syntax: ``Key = value`` lines, ``#`` starts a comment line, a trailing ``\\``
continues the value on the next line. Keys are CamelCase with dotted groups, as in
the product (``Listen``, ``MonitorHTTP.Listen``). Every key is a field of
:class:`Config` whose metadata carries its name, parser and documentation, so the
loader, ``migratory config check`` and the documentation test all read one table.

Errors never stop at the first one: all are collected and reported as
``file:line: Key: what is wrong`` and the CLI exits with code 2.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Config",
    "ConfigError",
    "DeliveryMode",
    "Endpoint",
    "LogLevel",
    "SlowConsumerPolicy",
    "key_specs",
    "parse_bool",
    "parse_endpoints",
    "parse_size",
]


class ConfigError(Exception):
    """One or more configuration errors, each ``file:line: Key: what is wrong``."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A listening address; host ``*`` means every interface."""

    host: str
    port: int

    @property
    def bind_host(self) -> str | None:
        """The host to hand to ``bind``: ``None`` binds every interface."""
        return None if self.host == "*" else self.host

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class LogLevel(enum.StrEnum):
    """Server log verbosity."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class DeliveryMode(enum.StrEnum):
    """How a cluster delivers messages across member failures (docs/cluster.md)."""

    STANDARD = "Standard"
    GUARANTEED = "Guaranteed"


class SlowConsumerPolicy(enum.StrEnum):
    """What happens to a client whose pending output exceeds ``MaxPendingOutput``."""

    DISCONNECT = "Disconnect"
    DROP = "Drop"


# --- value parsers: each raises ValueError with a message for the user -------------


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also yes/no, on/off, 1/0), any case."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "on", "1"):
        return True
    if lowered in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KB": 1024,
    "M": 1024**2,
    "MB": 1024**2,
    "G": 1024**3,
    "GB": 1024**3,
}


def parse_size(text: str) -> int:
    """A byte count: ``131072``, ``128K``, ``4MB``, ``1G``."""
    stripped = text.strip().upper().replace(" ", "")
    digits = stripped.rstrip("KMGB")
    unit = stripped[len(digits) :]
    if not digits.isdigit() or unit not in _SIZE_UNITS:
        raise ValueError(f"expected a size in bytes such as 131072, 128K or 4MB, got {text!r}")
    return int(digits) * _SIZE_UNITS[unit]


def _int_parser(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"expected a whole number, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            upper = "" if maximum is None else f" and at most {maximum}"
            raise ValueError(f"must be at least {minimum}{upper}, got {value}")
        return value

    return parse


def _size_parser(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = parse_size(text)
        if value < minimum:
            raise ValueError(f"must be at least {minimum} bytes, got {value}")
        return value

    return parse


def _float_parser(minimum: float, maximum: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise ValueError(f"must be between {minimum} and {maximum}, got {value}")
        return value

    return parse


def _enum_parser(kind: type[enum.StrEnum]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        for member in kind:
            if member.value.lower() == text.strip().lower():
                return member
        choices = ", ".join(m.value for m in kind)
        raise ValueError(f"expected one of {choices}, got {text!r}")

    return parse


def _parse_endpoint(item: str) -> Endpoint:
    item = item.strip()
    if item.startswith("["):
        host, sep, port_text = item[1:].partition("]:")
        if not sep:
            raise ValueError(f"{item!r} is not [ipv6]:port")
    else:
        host, sep, port_text = item.rpartition(":")
        if not sep:
            raise ValueError(f"{item!r} is not address:port")
    if not host:
        raise ValueError(f"{item!r} has no address (use * for every interface)")
    if host != "*":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not all(part.isalnum() or "-" in part for part in host.split(".")):
                raise ValueError(f"{host!r} is neither an IP address nor a host name") from None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{item!r} has no valid port (0-65535)")
    return Endpoint(host, int(port_text))


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """Comma-separated ``addr:port`` list; ``*:8800`` listens on every interface."""
    items = [part for part in (p.strip() for p in text.split(",")) if part]
    endpoints = tuple(_parse_endpoint(item) for item in items)
    if len(set(endpoints)) != len(endpoints):
        raise ValueError("the same address:port is listed twice")
    return endpoints


def _parse_optional_endpoints(text: str) -> tuple[Endpoint, ...]:
    """Like :func:`parse_endpoints`, where ``none`` (or nothing) disables the listener."""
    if text.strip().lower() in ("", "none"):
        return ()
    return parse_endpoints(text)


def _parse_members(text: str) -> tuple[Endpoint, ...]:
    """The cluster's ordered member list: ``host:port`` of every member's cluster listener."""
    members = _parse_optional_endpoints(text)
    for member in members:
        if member.host == "*":
            raise ValueError(f"{member}: a member address must be one that the other members can reach, not *")
    return members


def _parse_member(text: str) -> Endpoint | None:
    if text.strip().lower() in ("", "none"):
        return None
    (member,) = _parse_members(text) or (None,)
    if member is None or "," in text:
        raise ValueError(f"expected one addr:port, got {text!r}")
    return member


def _parse_seed_count(text: str) -> int:
    value = text.strip()
    if value.lower() == "auto":
        return 0
    if value not in ("3", "5"):
        raise ValueError(f"expected auto, 3 or 5, got {text!r}")
    return int(value)


def _parse_text(text: str) -> str:
    return text.strip()


def _parse_tls_version(text: str) -> str:
    value = text.strip()
    if value not in ("TLSv1.2", "TLSv1.3"):
        raise ValueError(f"expected TLSv1.2 or TLSv1.3, got {text!r}")
    return value


def _parse_path(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a folder path")
    return text.strip()


def _parse_workers(text: str) -> int:
    """``auto`` (0 here: one per core, resolved at start) or a number of processes."""
    value = text.strip()
    if value.lower() == "auto":
        return 0
    if not value.isdigit() or not 1 <= int(value) <= 256:
        raise ValueError(f"expected auto or a number of processes from 1 to 256, got {text!r}")
    return int(value)


def _parse_server_keep_alive(text: str) -> int:
    """``auto`` (-1 here: resolved by :attr:`Config.server_keep_alive_ms`), 0 (off) or milliseconds from 1000."""
    value = text.strip()
    if value.lower() == "auto":
        return -1
    if not value.isdigit() or (value != "0" and not 1000 <= int(value) <= 3_600_000):
        raise ValueError(f"expected auto, 0 or milliseconds from 1000 to 3600000, got {text!r}")
    return int(value)


def _parse_entitlement(text: str) -> str:
    for value in ("None", "Basic", "JWT", "Custom"):
        if value.lower() == text.strip().lower():
            return value
    raise ValueError(f"expected None, Basic, JWT or Custom, got {text!r}")


def _parse_networks(text: str) -> tuple[str, ...]:
    """Comma-separated IPv4/IPv6 addresses and CIDR blocks."""
    out = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise ValueError(f"{item!r} is neither an IP address nor a CIDR block") from None
        out.append(item)
    return tuple(out)


def _parse_custom_class(text: str) -> str:
    value = text.strip()
    if value and (":" not in value or not all(value.partition(":")[::2])):
        raise ValueError(f"expected module:Class, got {text!r}")
    return value


def key(
    name: str,
    default: Any,
    parse: Callable[[str], Any],
    doc: str,
    *,
    shown: str | None = None,
) -> Any:
    """Declare one configuration key as a dataclass field (used in :class:`Config`)."""
    return field(default=default, metadata={"key": name, "parse": parse, "doc": doc, "shown": shown})


@dataclass(frozen=True, slots=True)
class Config:
    """Every server parameter, typed, with its default. Built once, never mutated.

    Why it is long: one declaration per documented configuration key, nothing else.
    """

    listen: tuple[Endpoint, ...] = key(
        "Listen",
        (Endpoint("*", 8800),),
        parse_endpoints,
        "Plain listeners (ws:// and http:// on the same port), comma-separated addr:port; * means every interface.",
        shown="*:8800",
    )
    workers: int = key(
        "Workers",
        0,
        _parse_workers,
        "Worker processes sharing the listeners: auto (one per CPU core) or a number. "
        "Each holds its own connections; publications reach the subscribers of all.",
        shown="auto",
    )
    log_folder: str = key(
        "LogFolder",
        "logs",
        _parse_path,
        "Folder of the server, access and message logs (JSON lines); relative paths are "
        "relative to the working directory.",
    )
    log_level: LogLevel = key(
        "LogLevel",
        LogLevel.INFO,
        _enum_parser(LogLevel),
        "Server log verbosity: DEBUG, INFO, WARNING or ERROR.",
    )
    log_max_file_size: int = key(
        "LogMaxFileSize",
        100 * 1024 * 1024,
        _size_parser(4096),
        "Size at which a log file is rotated (bytes, or with K/M/G).",
        shown="100MB",
    )
    log_max_files: int = key(
        "LogMaxFiles",
        10,
        _int_parser(1, 10000),
        "Rotated files kept per log, besides the current one.",
    )
    access_log: bool = key("AccessLog", True, parse_bool, "Write access.log (connect, disconnect, subscribe, denials).")
    message_log: bool = key("MessageLog", True, parse_bool, "Write message.log (one line per logged publication).")
    message_log_sampling: float = key(
        "MessageLogSampling",
        1.0,
        _float_parser(0.0, 1.0),
        "Fraction of publications written to message.log (1 = all, 0.01 = one in a hundred).",
    )
    publish_snapshot_message: bool = key(
        "PublishSnapshotMessage",
        True,
        parse_bool,
        "Send the snapshot of a subject first when a client subscribes to it.",
    )
    message_size_limit: int = key(
        "MessageSizeLimit",
        128 * 1024,
        _size_parser(64),
        "Largest accepted message (WebSocket message or HTTP body), in bytes; larger ones "
        "are refused with a clear error.",
        shown="128K",
    )
    batching_time: int = key(
        "BatchingTime",
        0,
        _int_parser(0, 60000),
        "Milliseconds during which output to a client is collected and sent in one write; 0 disables time batching.",
    )
    batching_size: int = key(
        "BatchingSize",
        0,
        _size_parser(0),
        "Bytes of collected output that trigger a write before BatchingTime expires; 0 disables size batching.",
    )
    bus_batching_time: int = key(
        "BusBatchingTime",
        0,
        _int_parser(0, 1000),
        "Milliseconds during which the workers and the member agent of this node collect what they send "
        "each other before one write; 0 writes once per event-loop turn. Each write wakes the receiving "
        "process, and at many workers and low per-client rates the wake-ups, not the messages, cost the "
        "CPU (bench/million.md). Messages between processes wait up to this long.",
    )
    max_subscriptions_per_client: int = key(
        "MaxSubscriptionsPerClient",
        10000,
        _int_parser(1),
        "Subjects one client may be subscribed to at once; more are refused.",
    )
    max_pending_output: int = key(
        "MaxPendingOutput",
        4 * 1024 * 1024,
        _size_parser(1024),
        "Output bytes a client may have waiting (ours plus the kernel-side buffer that "
        "asyncio reports) before SlowConsumerPolicy applies.",
        shown="4MB",
    )
    slow_consumer_policy: SlowConsumerPolicy = key(
        "SlowConsumerPolicy",
        SlowConsumerPolicy.DISCONNECT,
        _enum_parser(SlowConsumerPolicy),
        "Disconnect: close a client that exceeds MaxPendingOutput. Drop: discard the "
        "messages that do not fit (the client later gets fresh ones). Both are counted.",
    )
    keep_alive_interval: int = key(
        "KeepAliveInterval",
        30000,
        _int_parser(1000),
        "Milliseconds of silence from a client after which the server sends a WebSocket ping.",
    )
    keep_alive_timeout: int = key(
        "KeepAliveTimeout",
        30000,
        _int_parser(1000),
        "Milliseconds the server waits for any data (a pong at least) after a ping before "
        "closing the connection as dead.",
    )
    server_keep_alive: int = key(
        "ServerKeepAlive",
        -1,
        _parse_server_keep_alive,
        "Milliseconds a native client (protocol version 3) may go without hearing from the server: past it, "
        "it takes the server for hung and fails over to another of its list. The server sends a small NOTIFY "
        "to a connection that was sent nothing for a third of it. auto: ClusterHeartbeatTimeout in a "
        "cluster, 0 (off) on a node alone; 0 turns it off.",
        shown="auto",
    )
    drain_time: int = key(
        "DrainTime",
        10000,
        _int_parser(0, 600000),
        "Milliseconds a stopping server (SIGTERM, migratory drain, systemctl stop) takes at most to move its "
        "clients away before it stops: it stops accepting, /health answers 503 draining, and its clients are "
        "told to reconnect elsewhere a few at a time (WebSocket close 1013, MQTT 5 DISCONNECT 0x9C), at "
        "least 100 a second per worker, so a few clients leave at once. 0 closes every client at once "
        '(1001, MQTT 5 0x8B) as a crash would (docs/operations.md, "Draining").',
    )
    handshake_timeout: int = key(
        "HandshakeTimeout",
        10000,
        _int_parser(100),
        "Milliseconds a new connection has to complete its HTTP request or WebSocket handshake.",
    )
    max_header_size: int = key(
        "MaxHeaderSize",
        16384,
        _size_parser(1024),
        "Largest HTTP request head (request line and headers) accepted, in bytes.",
        shown="16K",
    )
    state_folder: str = key(
        "StateFolder",
        "state",
        _parse_path,
        "Folder of the server's persistent state (the epoch counter); relative paths are "
        "relative to the working directory.",
    )
    listen_encrypted: tuple[Endpoint, ...] = key(
        "ListenEncrypted",
        (),
        _parse_optional_endpoints,
        "TLS listeners (wss:// and https:// on the same port), comma-separated addr:port; none "
        "disables them. Needs TLSCertificate and TLSKey.",
        shown="none",
    )
    listen_mqtt: tuple[Endpoint, ...] = key(
        "ListenMqtt",
        (),
        _parse_optional_endpoints,
        "MQTT 3.1.1 and 5.0 listeners over TCP (mqtt://, usually port 1883), comma-separated addr:port; "
        "none disables them. MQTT over WebSocket needs no key: path /mqtt on Listen and ListenEncrypted "
        "(docs/mqtt.md).",
        shown="none",
    )
    listen_mqtt_encrypted: tuple[Endpoint, ...] = key(
        "ListenMqttEncrypted",
        (),
        _parse_optional_endpoints,
        "MQTT over TLS listeners (mqtts://, usually port 8883), comma-separated addr:port; none disables "
        "them. Needs TLSCertificate and TLSKey (the same certificate as ListenEncrypted, reloaded on SIGHUP).",
        shown="none",
    )
    mqtt_session_expiry: int = key(
        "MqttSessionExpiry",
        604800,
        _int_parser(0, 0xFFFFFFFF),
        "Seconds (not milliseconds) an MQTT session outlives its connection at most: the cap on an MQTT 5 "
        "client's session expiry interval and the expiry of an MQTT 3.1.1 persistent session (clean session "
        "0). Sessions are kept in the cluster (docs/mqtt.md); 0 ends every session with its connection.",
    )
    mqtt_max_keep_alive: int = key(
        "MqttMaxKeepAlive",
        0,
        _int_parser(0, 65535),
        "Seconds (not milliseconds): the longest keep-alive an MQTT client may ask, 0 for no limit. An MQTT 5 "
        "client asking more, or none (0), is told this value in CONNACK (Server Keep Alive) and held to it; "
        "an MQTT 3.1.1 client, which cannot be told, is refused (CONNACK 0x02), as Mosquitto's max_keepalive.",
    )
    mqtt_receive_maximum: int = key(
        "MqttReceiveMaximum",
        1024,
        _int_parser(1, 65535),
        "QoS 1 and 2 publications an MQTT 5 client may have unacknowledged by the server at once (announced "
        "in CONNACK as Receive Maximum); one more and it is disconnected (0x93). A QoS 1 publication counts "
        "until its PUBACK, a QoS 2 one until its PUBREL.",
    )
    mqtt_allow_anonymous: bool = key(
        "MqttAllowAnonymous",
        True,
        parse_bool,
        "Whether an MQTT client with neither user name nor password may connect (it may then do what the "
        "entitlement allows without a token). false refuses it at CONNECT (CONNACK 0x87, 3.1.1: 0x05). A "
        "credential the entitlement can tell is bad (a JWT badly signed, malformed or expired) is always "
        "refused at CONNECT (docs/mqtt.md).",
    )
    tls_certificate: str = key(
        "TLSCertificate",
        "",
        _parse_text,
        "PEM file with the server certificate followed by its chain. Reloaded on SIGHUP.",
        shown="",
    )
    tls_key: str = key("TLSKey", "", _parse_text, "PEM file with the certificate's private key.", shown="")
    tls_key_password: str = key(
        "TLSKeyPassword", "", _parse_text, "Password of TLSKey when the key is encrypted.", shown=""
    )
    tls_min_version: str = key(
        "TLSMinVersion",
        "TLSv1.2",
        _parse_tls_version,
        "Oldest TLS version accepted: TLSv1.2 or TLSv1.3.",
    )
    tls_ciphers: str = key(
        "TLSCiphers",
        "ECDHE+AESGCM:ECDHE+CHACHA20",
        _parse_text,
        "OpenSSL cipher list for TLS 1.2 (TLS 1.3 suites are OpenSSL's own).",
    )
    lean_transport: bool = key(
        "LeanTransport",
        True,
        parse_bool,
        "Serve the client connections of Listen and ListenEncrypted from one epoll set per worker instead "
        "of an event-loop transport each: about 1 KB less memory per connection (bench/million.md, "
        "bench/tls.md). false: the event loop's transports, as before.",
    )
    tls_lean_transport: bool = key(
        "TLSLeanTransport",
        True,
        parse_bool,
        "After a TLS 1.3 handshake, carry the records with the server's own record layer, which keeps "
        "no OpenSSL state per connection (bench/tls.md). false: OpenSSL carries them for the whole "
        "connection and its keylog hook is never set; certificate reload on SIGHUP, TLSMinVersion, "
        "TLSCiphers and HandshakeTimeout work the same.",
    )
    monitor_listen: tuple[Endpoint, ...] = key(
        "MonitorHTTP.Listen",
        (),
        _parse_optional_endpoints,
        "Listeners of the HTTP monitoring service (/stats, /metrics, /health), comma-separated "
        "addr:port; none disables it. Put it on a LAN address. The TLS counters of /metrics (migratory_tls_*) "
        "are listed in docs/security.md.",
        shown="none",
    )
    monitor_username: str = key(
        "MonitorHTTP.Username",
        "",
        _parse_text,
        "When set, the monitoring service requires HTTP Basic authentication with this user.",
        shown="",
    )
    monitor_password: str = key(
        "MonitorHTTP.Password",
        "",
        _parse_text,
        "The password that goes with MonitorHTTP.Username.",
        shown="",
    )
    monitor_listen_encrypted: tuple[Endpoint, ...] = key(
        "MonitorHTTP.ListenEncrypted",
        (),
        _parse_optional_endpoints,
        "TLS listeners of the monitoring service (https://), with the TLSCertificate and TLSKey of "
        "ListenEncrypted, reloaded on SIGHUP; none disables them.",
        shown="none",
    )
    monitor_push_interval: int = key(
        "MonitorPushInterval",
        10,
        _int_parser(0, 3600),
        "Seconds (not milliseconds) between two publications of the node's statistics on the meta-subject "
        "/migratory/stats/node (in a cluster, /migratory/stats/member-N from each member), which any "
        "entitled client may subscribe to and no client may publish on; 0 disables it.",
    )
    sys_interval: int = key(
        "SysInterval",
        10,
        _int_parser(0, 3600),
        "Seconds (not milliseconds) between two publications of the node's statistics on the MQTT topics "
        "$SYS/broker/... under the names Mosquitto uses (clients/connected, messages/received, uptime, "
        "version...; in a cluster $SYS/broker/member-N/... from each member), retained, read-only for "
        "clients (docs/mqtt.md); 0 disables them.",
    )
    stats_log_interval: int = key(
        "Stats.LogInterval",
        60,
        _int_parser(0, 86400),
        "Seconds (not milliseconds) between two lines of stats.log, every indicator of the node "
        "(docs/logs.md); 0 disables the stats log.",
    )
    entitlement: str = key(
        "Entitlement",
        "None",
        _parse_entitlement,
        "Who may subscribe and publish: None (everyone), Basic (everyone subscribes, the "
        "EntitlementAllowToken token publishes), JWT (permissions in signed tokens) or Custom "
        "(a Python class). See docs/security.md.",
    )
    entitlement_allow_token: str = key(
        "EntitlementAllowToken", "", _parse_text, "With Entitlement = Basic: the token that may publish.", shown=""
    )
    entitlement_jwt_secret: str = key(
        "EntitlementJwtSecret", "", _parse_text, "With Entitlement = JWT: the HS256 shared secret.", shown=""
    )
    entitlement_jwt_public_key: str = key(
        "EntitlementJwtPublicKey",
        "",
        _parse_text,
        "With Entitlement = JWT: PEM public key file for RS256/ES256 tokens (instead of a secret).",
        shown="",
    )
    entitlement_custom_class: str = key(
        "EntitlementCustomClass",
        "",
        _parse_custom_class,
        "With Entitlement = Custom: module:Class with authorize_subscribe and authorize_publish.",
        shown="",
    )
    publish_allow_from: tuple[str, ...] = key(
        "PublishAllowFromAddressList",
        (),
        _parse_networks,
        "Addresses and CIDR blocks allowed to publish, comma-separated; empty allows every address.",
        shown="",
    )
    max_connection_rate_per_address: int = key(
        "MaxConnectionsPerSecondPerAddress",
        0,
        _int_parser(0),
        "New connections accepted per second from one client address (a burst of twice that "
        "is allowed); 0 disables the limit.",
    )
    admission_rate: int = key(
        "AdmissionRate",
        0,
        _int_parser(0),
        "New client sessions (WebSocket and MQTT connections) each worker admits per second, so that a "
        "reconnect storm leaves the loop to the clients already served; 0 disables the limit. Beyond it a "
        "session is refused with HTTP 503 and Retry-After (MQTT: CONNACK 0x89, 3.1.1 0x03), each refused "
        "one given a later second so that they come back spread at this rate (docs/operations.md).",
    )
    run_as_user: str = key(
        "RunAsUser",
        "",
        _parse_text,
        "Started as root, bind the listeners and then run as this user for good.",
        shown="",
    )
    run_as_group: str = key(
        "RunAsGroup", "", _parse_text, "The group to run as (default: RunAsUser's primary group).", shown=""
    )

    cluster_members: tuple[Endpoint, ...] = key(
        "ClusterMembers",
        (),
        _parse_members,
        "Every member's cluster address (addr:port), comma-separated, in the same order on every member; "
        "none runs a single server. See docs/cluster.md.",
        shown="none",
    )
    cluster_member_listen: Endpoint | None = key(
        "ClusterMemberListen",
        None,
        _parse_member,
        "This member's cluster address (addr:port), exactly as it appears in ClusterMembers; the other "
        "members connect to it. In Guaranteed delivery mode a seed member also uses the next port "
        "(port + 1) for the seed members' consensus.",
        shown="none",
    )
    cluster_password: str = key(
        "ClusterPassword",
        "",
        _parse_text,
        "Shared secret of the cluster's members (at least 12 characters): members prove it to each other "
        "with a challenge-response and refuse a peer that does not know it. `migratory cluster init` makes one.",
        shown="",
    )
    cluster_delivery_mode: DeliveryMode = key(
        "ClusterDeliveryMode",
        DeliveryMode.STANDARD,
        _enum_parser(DeliveryMode),
        "Standard: after a failover a client gets the current snapshot of its subjects (at least 2 members, "
        "tolerates all but one down). Guaranteed: it gets every message it missed, from the members' "
        "replicated caches (at least 3 members; a majority of the seed members must be up).",
    )
    cluster_seed_member_count: int = key(
        "ClusterSeedMemberCount",
        0,
        _parse_seed_count,
        "Guaranteed mode: how many of the first ClusterMembers are seed members, which decide membership and "
        "coordinators by majority: auto (3 for clusters of 3 or 4 members, 5 from 5 members), 3 or 5.",
        shown="auto",
    )
    max_cached_messages_per_subject: int = key(
        "MaxCachedMessagesPerSubject",
        1000,
        _int_parser(1, 1_000_000),
        "Guaranteed mode: the most recent messages of each subject every member keeps, to resend to a "
        "client what it missed during a failover.",
    )
    cache_expire_time: int = key(
        "CacheExpireTime",
        180,
        _int_parser(1, 86400),
        "Guaranteed mode: seconds (not milliseconds) a cached message is kept; a client away longer gets "
        "the snapshot instead of the missed messages.",
    )
    cluster_heartbeat_interval: int = key(
        "ClusterHeartbeatInterval",
        500,
        _int_parser(50, 60000),
        "Milliseconds between heartbeats on each link between two members.",
    )
    cluster_heartbeat_timeout: int = key(
        "ClusterHeartbeatTimeout",
        3000,
        _int_parser(200, 600000),
        "Milliseconds without any data from a member after which it is considered down (hung or cut off); a "
        "closed connection counts at once. Also how long a starting member looks for live members before it "
        "starts alone.",
    )
    cluster_tls: bool = key(
        "ClusterTLS",
        False,
        parse_bool,
        "Encrypt the links between members with TLS; both sides present ClusterTLSCertificate and verify "
        "the other against ClusterTLSCA.",
    )
    cluster_tls_certificate: str = key(
        "ClusterTLSCertificate",
        "",
        _parse_text,
        "PEM certificate (and chain) this member presents to the others; empty uses TLSCertificate.",
        shown="",
    )
    cluster_tls_key: str = key(
        "ClusterTLSKey", "", _parse_text, "Private key of ClusterTLSCertificate; empty uses TLSKey.", shown=""
    )
    cluster_tls_ca: str = key(
        "ClusterTLSCA",
        "",
        _parse_text,
        "PEM file of the certificate authority that signed every member's certificate (`migratory cert create-ca`).",
        shown="",
    )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Config:
        """Load and validate ``path``; raise :class:`ConfigError` listing every problem."""
        name = os.fspath(path)
        try:
            text = Path(name).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError([f"{name}:0: (file): cannot read: {exc.strerror or exc}"]) from None
        except UnicodeDecodeError as exc:
            raise ConfigError([f"{name}:0: (file): not UTF-8 text: {exc.reason}"]) from None
        return cls.from_text(text, name)

    @classmethod
    def from_text(cls, text: str, filename: str = "<config>") -> Config:
        """Parse configuration text; ``filename`` is used in error messages."""
        specs = key_specs()
        by_lower = {spec_name.lower(): spec_name for spec_name in specs}
        errors: list[str] = []
        values: dict[str, Any] = {}
        seen: dict[str, int] = {}
        for lineno, line in _logical_lines(text):
            name, sep, raw = line.partition("=")
            name = name.strip()
            if not sep:
                errors.append(f"{filename}:{lineno}: {name}: expected 'Key = value'")
                continue
            if name not in specs:
                hint = by_lower.get(name.lower())
                suggestion = f" (did you mean {hint}?)" if hint else ""
                errors.append(f"{filename}:{lineno}: {name}: unknown key{suggestion}")
                continue
            if name in seen:
                errors.append(f"{filename}:{lineno}: {name}: already set on line {seen[name]}")
                continue
            seen[name] = lineno
            attr, parse = specs[name]
            try:
                values[attr] = parse(raw.strip())
            except ValueError as exc:
                errors.append(f"{filename}:{lineno}: {name}: {exc}")
        if not errors:
            config = cls(**values)
            for problem in config.problems():
                errors.append(f"{filename}:{_problem_line(problem, seen)}: {problem}")
            if not errors:
                return config
        raise ConfigError(errors)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, str]) -> Config:
        """Build from ``{"Key": "value"}`` pairs (handy in tests and embedding)."""
        return cls.from_text("\n".join(f"{k} = {v}" for k, v in mapping.items()), "<mapping>")

    @property
    def server_keep_alive_ms(self) -> int:
        """``ServerKeepAlive`` resolved: ``auto`` is ClusterHeartbeatTimeout in a cluster, off on a node alone."""
        if self.server_keep_alive >= 0:
            return self.server_keep_alive
        return self.cluster_heartbeat_timeout if self.cluster_members else 0

    @property
    def worker_count(self) -> int:
        """``Workers`` resolved: ``auto`` is the number of CPU cores this process may use."""
        if self.workers:
            return self.workers
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover - not Linux
            return max(1, os.cpu_count() or 1)

    def check(self) -> None:
        """Cross-key checks; raise ValueError as ``Key: what is wrong`` (the first problem)."""
        problems = self.problems()
        if problems:
            raise ValueError(problems[0])

    def _port_collisions(self) -> list[str]:
        """Two listener keys naming one address and port: the second could never bind."""
        seen: dict[tuple[str, int], str] = {}
        out: list[str] = []
        for name, endpoints in (
            ("Listen", self.listen),
            ("ListenEncrypted", self.listen_encrypted),
            ("ListenMqtt", self.listen_mqtt),
            ("ListenMqttEncrypted", self.listen_mqtt_encrypted),
            ("MonitorHTTP.Listen", self.monitor_listen),
            ("MonitorHTTP.ListenEncrypted", self.monitor_listen_encrypted),
        ):
            for endpoint in endpoints:
                if not endpoint.port:
                    continue  # port 0: the kernel picks one for each
                where = (endpoint.host, endpoint.port)
                if where in seen and seen[where] != name:
                    out.append(f"{name}: {endpoint} is also a {seen[where]} listener")
                seen.setdefault(where, name)
        return out

    def problems(self) -> list[str]:
        """Every cross-key problem, each as ``Key: what is wrong``."""
        out: list[str] = []
        if not self.listen:
            out.append("Listen: at least one listener is required")
        if self.listen_encrypted and not (self.tls_certificate and self.tls_key):
            out.append("ListenEncrypted: needs TLSCertificate and TLSKey")
        if self.listen_mqtt_encrypted and not (self.tls_certificate and self.tls_key):
            out.append("ListenMqttEncrypted: needs TLSCertificate and TLSKey")
        out.extend(self._port_collisions())
        if self.entitlement == "Basic" and not self.entitlement_allow_token:
            out.append("Entitlement: Basic needs EntitlementAllowToken")
        if self.entitlement == "JWT" and not (self.entitlement_jwt_secret or self.entitlement_jwt_public_key):
            out.append("Entitlement: JWT needs EntitlementJwtSecret or EntitlementJwtPublicKey")
        if self.entitlement == "Custom" and not self.entitlement_custom_class:
            out.append("Entitlement: Custom needs EntitlementCustomClass")
        if self.monitor_listen_encrypted and not (self.tls_certificate and self.tls_key):
            out.append("MonitorHTTP.ListenEncrypted: needs TLSCertificate and TLSKey")
        if bool(self.monitor_username) != bool(self.monitor_password):
            out.append("MonitorHTTP.Password: MonitorHTTP.Username and MonitorHTTP.Password go together")
        if self.batching_size and not self.batching_time:
            out.append("BatchingSize: needs BatchingTime too (the longest a message may wait for the batch to fill)")
        out.extend(self._cluster_problems())
        return out

    @property
    def clustered(self) -> bool:
        return bool(self.cluster_members)

    @property
    def member_index(self) -> int:
        """This member's position in ClusterMembers (-1 without a cluster)."""
        if self.cluster_member_listen is None or self.cluster_member_listen not in self.cluster_members:
            return -1
        return self.cluster_members.index(self.cluster_member_listen)

    @property
    def seed_count(self) -> int:
        """Guaranteed mode's seed members: the first 3 or 5 of ClusterMembers (0 in Standard mode)."""
        if self.cluster_delivery_mode is not DeliveryMode.GUARANTEED:
            return 0
        if self.cluster_seed_member_count:
            return self.cluster_seed_member_count
        return 3 if len(self.cluster_members) < 5 else 5

    def _consensus_collisions(self) -> list[str]:
        """A seed's consensus port (its cluster port + 1) that another listed member uses as its cluster port.

        The two listen on the same address: one of them cannot start (the seed, when it binds second).
        """
        members = self.cluster_members
        out: list[str] = []
        for seed in members[: self.seed_count]:
            for other in members:
                if other.port == seed.port + 1 and _same_host(other.host, seed.host):
                    out.append(
                        f"ClusterMembers: seed member {seed} needs port {seed.port + 1} too, for the seed members' "
                        f"consensus (its port + 1), but member {other} listens there: leave a free port after "
                        "each seed's cluster port"
                    )
        return out

    def _cluster_problems(self) -> list[str]:
        members = self.cluster_members
        me = self.cluster_member_listen
        if not members:
            if me is not None:
                return ["ClusterMemberListen: set without ClusterMembers (list every member, this one included)"]
            return []
        out: list[str] = []
        if len(members) < 2:
            out.append("ClusterMembers: a cluster needs at least two members (remove the key to run one server)")
        if me is None:
            out.append("ClusterMemberListen: required with ClusterMembers (this member's address in the list)")
        elif me not in members:
            out.append(f"ClusterMemberListen: {me} is not one of ClusterMembers ({', '.join(map(str, members))})")
        if len(self.cluster_password) < 12:
            out.append("ClusterPassword: required with ClusterMembers, at least 12 characters (same on every member)")
        guaranteed = self.cluster_delivery_mode is DeliveryMode.GUARANTEED
        if guaranteed and len(members) < 3:
            out.append(f"ClusterDeliveryMode: Guaranteed needs at least 3 members, ClusterMembers lists {len(members)}")
        if guaranteed and 3 <= len(members) < self.seed_count:
            out.append(
                f"ClusterSeedMemberCount: {self.seed_count} seed members but ClusterMembers lists {len(members)}"
            )
        if self.cluster_heartbeat_timeout < 2 * self.cluster_heartbeat_interval:
            out.append("ClusterHeartbeatTimeout: must be at least twice ClusterHeartbeatInterval")
        out.extend(self._consensus_collisions())
        if me is not None:
            listeners = (
                *self.listen,
                *self.listen_encrypted,
                *self.listen_mqtt,
                *self.listen_mqtt_encrypted,
                *self.monitor_listen,
                *self.monitor_listen_encrypted,
            )
            ports = {e.port: str(e) for e in listeners}
            used = [me.port] + ([me.port + 1] if guaranteed and self.member_index < self.seed_count else [])
            for port in used:
                if port in ports:
                    out.append(f"ClusterMemberListen: port {port} is also the client or monitor listener {ports[port]}")
            if guaranteed and me.port >= 65535:
                out.append("ClusterMemberListen: a seed member needs port + 1 too; choose a port below 65535")
        if self.cluster_tls:
            if not (self.cluster_tls_certificate or self.tls_certificate):
                out.append("ClusterTLS: needs ClusterTLSCertificate (or TLSCertificate)")
            if not (self.cluster_tls_key or self.tls_key):
                out.append("ClusterTLS: needs ClusterTLSKey (or TLSKey)")
            if not self.cluster_tls_ca:
                out.append("ClusterTLS: needs ClusterTLSCA, the authority that signed every member's certificate")
        return out


def _same_host(a: str, b: str) -> bool:
    """Whether two member hosts name one address (``::1`` and ``0::1`` do); names are compared as written."""
    if a == b:
        return True
    try:
        return ipaddress.ip_address(a) == ipaddress.ip_address(b)
    except ValueError:
        return False


def _problem_line(problem: str, seen: Mapping[str, int]) -> int:
    """The line to blame: the key's own, else that of a key the message names (a missing key's cause)."""
    culprit = problem.partition(":")[0]
    if culprit in seen:
        return seen[culprit]
    named = [seen[name] for name in seen if name in problem]
    return min(named) if named else 0


def key_specs() -> dict[str, tuple[str, Callable[[str], Any]]]:
    """Map each configuration key to (attribute name, parser)."""
    return {f.metadata["key"]: (f.name, f.metadata["parse"]) for f in dataclasses.fields(Config)}


def documented_keys() -> Iterator[tuple[str, str, str]]:
    """Yield (key, default as written in the file, doc) for documentation and tests."""
    for f in dataclasses.fields(Config):
        shown = f.metadata["shown"]
        if shown is None:
            default = f.default
            if isinstance(default, bool):
                shown = "true" if default else "false"
            elif isinstance(default, enum.Enum):
                shown = str(default.value)
            else:
                shown = str(default)
        yield f.metadata["key"], shown, f.metadata["doc"]


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """Yield (first line number, line) with comments dropped and continuations joined."""
    pending: list[str] = []
    start = 0
    for lineno, physical in enumerate(text.splitlines(), 1):
        stripped = physical.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = lineno
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        yield start, " ".join(part for part in pending if part)
        pending = []
    if pending:
        yield start, " ".join(part for part in pending if part)
