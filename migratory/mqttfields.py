"""MQTT 5 publication properties carried as message fields (docs/mqtt.md, "Properties").

MQTT 5 (3.3.2.3) says a server forwards a publication's Payload Format Indicator, Content Type,
Response Topic and Correlation Data unaltered. Here they travel as fields of the message, so they
cross the worker bus, the cluster and the caches like any field, and a native client reads and
sets them by name:

- ``mqtt-payload-format``: ``0`` or ``1`` (UTF-8 text);
- ``mqtt-content-type``: the content type;
- ``mqtt-response-topic``: the response topic, an MQTT topic name;
- ``mqtt-correlation-data``: the correlation data, base64.

A snapshot's fields are the union of its messages' (migratory/replica.py): so that a newer retained
message without a property is not given an older one's, an MQTT publication also writes
``mqtt-properties`` = ``<crc32 of the content>:<the names it set>``; where it names another content,
none of these fields is this message's. A native publication without that field has the ones it
sets.

A QoS 2 publication also writes ``mqtt-qos`` = ``2``, named by the guard, so that its subscribers
granted QoS 2 get it at QoS 2 (the message's Guaranteed flag says only QoS 0 or more than 0).
"""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Mapping

from migratory import mqtt as m

__all__ = ["GUARD", "QOS_FIELD", "RESERVED", "from_fields", "published_qos", "to_fields"]

GUARD = "mqtt-properties"
QOS_FIELD = "mqtt-qos"
_NAMES = {
    m.P_FORMAT: "mqtt-payload-format",
    m.P_CONTENT_TYPE: "mqtt-content-type",
    m.P_RESPONSE_TOPIC: "mqtt-response-topic",
    m.P_CORRELATION: "mqtt-correlation-data",
}
_IDS = {name: pid for pid, name in _NAMES.items()}
RESERVED = frozenset((*_NAMES.values(), GUARD, QOS_FIELD))
"""Field names a client's user properties cannot set (they would pass for the properties above)."""


def to_fields(props: m.Properties, content: bytes, retained: bool, qos: int = 0) -> dict[str, str]:
    """The fields of a PUBLISH's (or will's) forwarded properties and QoS 2; a retained one's guard even with
    none."""
    fields: dict[str, str] = {}
    for pid, name in _NAMES.items():
        value = props.get(pid)
        if value is None:
            continue
        if isinstance(value, bytes):
            fields[name] = base64.b64encode(value).decode("ascii")
        else:
            fields[name] = str(value)
    if qos == 2:
        fields[QOS_FIELD] = "2"
    if fields or (retained and content):  # (an empty retained message clears the retained one: no guard needed)
        fields[GUARD] = f"{zlib.crc32(content)}:{','.join(fields)}"
    return fields


def published_qos(fields: Mapping[str, str], content: bytes, guaranteed: bool) -> int:
    """The QoS a message was published with: 0 unless Guaranteed; 2 where its own guard says so; else 1
    (a native Guaranteed publication is QoS 1 to MQTT subscribers)."""
    if not guaranteed:
        return 0
    if fields.get(QOS_FIELD) != "2":
        return 1
    names = _guarded(fields, content)
    return 2 if names is not None and QOS_FIELD in names else 1


def _guarded(fields: Mapping[str, str], content: bytes) -> tuple[str, ...] | None:
    """The names a message's guard says are its own: () where the guard names another content; None without
    a guard (a native publication)."""
    guard = fields.get(GUARD)
    if guard is None:
        return None
    crc, _, listed = guard.partition(":")
    if not crc.isdigit() or int(crc) != zlib.crc32(content):
        return ()
    return tuple(listed.split(",")) if listed else ()


def from_fields(fields: Mapping[str, str], content: bytes) -> m.Properties:
    """The properties a delivery carries back to an MQTT 5 subscriber (none that belong to another content)."""
    names = _guarded(fields, content)
    if names is None:
        names = tuple(name for name in _NAMES.values() if name in fields)
    props: m.Properties = {}
    for name in names:
        pid = _IDS.get(name)
        value = fields.get(name)
        if pid is None or value is None:
            continue
        if pid == m.P_CORRELATION:
            try:
                props[pid] = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                continue
        elif pid == m.P_FORMAT:
            if value in ("0", "1"):
                props[pid] = int(value)
        else:
            props[pid] = value
    return dict(sorted(props.items()))
