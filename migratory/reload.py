"""What a SIGHUP may change in a running node, and what needs a restart.

The NATS server's rule: a reload applies what can change without dropping a connection
(entitlement tokens and keys, the publish address list, log levels, slow-consumer limits,
the TLS certificate), and refuses the rest (listeners, workers, the cluster, folders),
naming each refused key, while the node keeps its old value. ``migratory config check
--diff OLD NEW`` reports the same verdicts before anything is sent.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from migratory.config import Config

__all__ = ["LIVE", "Change", "diff", "merged"]

LIVE = frozenset(
    {
        "EntitlementAllowToken",
        "EntitlementJwtSecret",
        "EntitlementJwtPublicKey",
        "PublishAllowFromAddressList",
        "LogLevel",
        "MaxPendingOutput",
        "SlowConsumerPolicy",
        "MqttSessionExpiry",
        "TLSCertificate",
        "TLSKey",
        "TLSKeyPassword",
    }
)
"""The keys a reload applies to a running node (the certificate: to connections made after it)."""


@dataclass(frozen=True, slots=True)
class Change:
    key: str  # as written in migratorydata.conf
    old: Any
    new: Any

    @property
    def live(self) -> bool:
        return self.key in LIVE


_FIELDS = {f.metadata["key"]: f.name for f in dataclasses.fields(Config)}


def diff(old: Config, new: Config) -> list[Change]:
    """Every key whose value differs, in the order of the configuration reference."""
    out = []
    for key, name in _FIELDS.items():
        before, after = getattr(old, name), getattr(new, name)
        if before != after:
            out.append(Change(key, before, after))
    return out


def merged(old: Config, new: Config) -> tuple[Config, list[Change], list[Change]]:
    """``old`` with ``new``'s live changes applied; (config, applied, refused)."""
    changes = diff(old, new)
    applied = [c for c in changes if c.live]
    refused = [c for c in changes if not c.live]
    config = dataclasses.replace(old, **{_FIELDS[c.key]: c.new for c in applied})
    return config, applied, refused
