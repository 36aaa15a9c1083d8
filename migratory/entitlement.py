"""Entitlement: who may subscribe to and publish on which subjects.

``Entitlement = None`` lets everyone do everything. ``Basic`` lets everyone
subscribe and only clients presenting ``EntitlementAllowToken`` publish. ``JWT``
reads the client's token as a JSON Web Token (HS256 with ``EntitlementJwtSecret``,
or RS256/ES256 with the public key in ``EntitlementJwtPublicKey``) whose
``permissions`` claim lists subject patterns: ``{"sub": [...], "pub": [...]}``; an
``exp`` claim is honoured while the client stays connected. ``Custom`` loads the
class named by ``EntitlementCustomClass`` (``module:Class``) with two methods,
``authorize_subscribe(token, subject, address) -> bool`` and
``authorize_publish(token, subject, address) -> bool``; an exception in them denies
the request (and is logged) instead of reaching the server.

Patterns: a segment ``*`` matches any one segment; a last segment ``**`` matches
one or more segments; anything else must be equal. ``/Stocks/*/IBM`` matches
``/Stocks/NYSE/IBM``; ``/Stocks/**`` matches every subject under ``/Stocks``.

Every decision is ``None`` (allowed) or ``(reason_code, reason)``, the same for
WebSocket, HTTP snapshot and HTTP publish. The publish address list
(``PublishAllowFromAddressList``) is checked here too.
"""

from __future__ import annotations

import hmac
import importlib
import inspect
import ipaddress
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = [
    "AddressList",
    "BasicEntitlement",
    "CustomEntitlement",
    "Decision",
    "Entitlement",
    "JwtEntitlement",
    "NoEntitlement",
    "build_entitlement",
    "subject_matches",
]

log = logging.getLogger("migratory.server")

Decision = tuple[str, str] | None

_EXPIRED = "the token has expired"


class Entitlement(Protocol):
    def authenticate(self, token: str) -> Decision:
        """Whether a client presenting ``token`` may connect at all (MQTT's CONNECT): a token the entitlement
        can tell is bad (a JWT badly signed, malformed or expired) is refused there, not at its first request.
        The reason code is ``bad_credentials`` or ``expired``."""
        ...

    def check_subscribe(self, token: str, subject: str, address: str) -> Decision: ...

    def check_publish(self, token: str, subject: str, address: str) -> Decision: ...

    def expires_at(self, token: str) -> float | None: ...


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` matches ``pattern`` (``*`` one segment, trailing ``**`` one or more)."""
    want = pattern.split("/")
    have = subject.split("/")
    for index, part in enumerate(want):
        if part == "**" and index == len(want) - 1:
            return len(have) > index
        if index >= len(have) or (part != "*" and part != have[index]):
            return False
    return len(have) == len(want)


class NoEntitlement:
    def authenticate(self, token: str) -> Decision:
        return None

    def check_subscribe(self, token: str, subject: str, address: str) -> Decision:
        return None

    def check_publish(self, token: str, subject: str, address: str) -> Decision:
        return None

    def expires_at(self, token: str) -> float | None:
        return None


class BasicEntitlement(NoEntitlement):
    """Everyone subscribes; only the holder of the allow token publishes."""

    def __init__(self, allow_token: str) -> None:
        self.allow_token = allow_token.encode()

    def check_publish(self, token: str, subject: str, address: str) -> Decision:
        if token and hmac.compare_digest(token.encode(), self.allow_token):
            return None
        return ("entitlement", "publishing needs the token of EntitlementAllowToken")


class JwtEntitlement:
    """Permissions from a signed JSON Web Token (claims cached per token)."""

    def __init__(self, key: str, algorithms: Sequence[str]) -> None:
        self.key = key
        self.algorithms = list(algorithms)
        self._cache: dict[str, dict[str, Any] | str] = {}

    def _claims(self, token: str) -> dict[str, Any] | str:
        cached = self._cache.get(token)
        if cached is not None:
            if isinstance(cached, dict) and "exp" in cached and cached["exp"] < time.time():
                return _EXPIRED
            return cached
        import jwt

        try:
            claims: dict[str, Any] | str = jwt.decode(token, self.key, algorithms=self.algorithms)
        except jwt.ExpiredSignatureError:
            claims = _EXPIRED
        except jwt.InvalidTokenError as exc:
            claims = f"invalid token: {exc}"
        if len(self._cache) > 10000:
            self._cache.clear()
        self._cache[token] = claims
        return claims

    def _check(self, token: str, subject: str, kind: str) -> Decision:
        if not token:
            return ("entitlement", "no entitlement token")
        claims = self._claims(token)
        if isinstance(claims, str):
            return ("entitlement", claims)
        permissions = claims.get("permissions", {})
        patterns = permissions.get(kind, []) if isinstance(permissions, dict) else []
        if isinstance(patterns, list) and any(isinstance(p, str) and subject_matches(p, subject) for p in patterns):
            return None
        verb = "subscribe to" if kind == "sub" else "publish on"
        return ("entitlement", f"the token does not allow to {verb} {subject}")

    def authenticate(self, token: str) -> Decision:
        claims = self._claims(token) if token else {}
        if not isinstance(claims, str):
            return None
        return ("expired" if claims == _EXPIRED else "bad_credentials", claims)

    def check_subscribe(self, token: str, subject: str, address: str) -> Decision:
        return self._check(token, subject, "sub")

    def check_publish(self, token: str, subject: str, address: str) -> Decision:
        return self._check(token, subject, "pub")

    def expires_at(self, token: str) -> float | None:
        claims = self._claims(token) if token else None
        if isinstance(claims, dict) and isinstance(claims.get("exp"), int | float):
            return float(claims["exp"])
        return None


class CustomEntitlement:
    """A user class; its exceptions deny the request rather than reach the server.

    Its methods may be plain or ``async``; with ``async`` ones (``is_async``) the
    server awaits each decision, keeping every client's requests in order.
    """

    def __init__(self, spec: str) -> None:
        module_name, _, class_name = spec.partition(":")
        module = importlib.import_module(module_name)
        self.impl = getattr(module, class_name)()
        for method in ("authorize_subscribe", "authorize_publish"):
            if not callable(getattr(self.impl, method, None)):
                raise TypeError(f"{spec} has no method {method}(token, subject, address)")
        self.is_async = any(
            inspect.iscoroutinefunction(getattr(self.impl, m)) for m in ("authorize_subscribe", "authorize_publish")
        )

    @staticmethod
    def verdict(method: str, allowed: object) -> Decision:
        """Turn what the class answered (or raised) into a decision."""
        if isinstance(allowed, BaseException):
            log.error("custom entitlement %s failed: %r", method, allowed)
            return ("entitlement", f"custom entitlement failed: {type(allowed).__name__}")
        if allowed is True:
            return None
        return ("entitlement", "refused by the custom entitlement")

    def _ask(self, method: str, token: str, subject: str, address: str) -> Decision:
        try:
            allowed = getattr(self.impl, method)(token, subject, address)
        except Exception as exc:
            return self.verdict(method, exc)
        if inspect.isawaitable(allowed):
            close = getattr(allowed, "close", None)
            if callable(close):
                close()  # an async class is awaited by the server (is_async), never here
            return ("entitlement", "custom entitlement is asynchronous: awaited by the server")
        return self.verdict(method, allowed)

    def authenticate(self, token: str) -> Decision:
        return None  # the class decides per request only

    def check_subscribe(self, token: str, subject: str, address: str) -> Decision:
        return self._ask("authorize_subscribe", token, subject, address)

    def check_publish(self, token: str, subject: str, address: str) -> Decision:
        return self._ask("authorize_publish", token, subject, address)

    def expires_at(self, token: str) -> float | None:
        return None


class AddressList:
    """``PublishAllowFromAddressList``: addresses and CIDR blocks allowed to publish."""

    def __init__(self, entries: Sequence[str]) -> None:
        self.networks = [ipaddress.ip_network(e, strict=False) for e in entries]

    def allows(self, address: str) -> bool:
        if not self.networks:
            return True
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == net.version and ip in net for net in self.networks)


def build_entitlement(kind: str, allow_token: str, jwt_secret: str, jwt_public_key: str, custom: str) -> Entitlement:
    """The configured entitlement (arguments already validated by the configuration)."""
    if kind == "Basic":
        return BasicEntitlement(allow_token)
    if kind == "JWT":
        if jwt_public_key:
            from pathlib import Path

            return JwtEntitlement(Path(jwt_public_key).read_text(), ["RS256", "ES256"])
        return JwtEntitlement(jwt_secret, ["HS256"])
    if kind == "Custom":
        return CustomEntitlement(custom)
    return NoEntitlement()
