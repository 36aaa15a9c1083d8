"""Who may connect, subscribe and publish: the entitlement and the publish address list behind
one hook (:class:`Gatekeeper`, replaceable through :class:`Authorizer`), the per-address
connection rate limit, and the bounded, ordered calls of an asynchronous custom entitlement.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Coroutine
from typing import Any, Protocol

from migratory.entitlement import AddressList, CustomEntitlement, Decision, Entitlement
from migratory.server.engine.types import Origin

__all__ = [
    "CUSTOM_ENTITLEMENT_TIMEOUT",
    "MAX_RETRY_AFTER",
    "Authorizer",
    "ConnectionRate",
    "Gatekeeper",
    "InOrder",
    "SessionAdmission",
    "custom_decision",
]

CUSTOM_ENTITLEMENT_TIMEOUT = 5.0


class Authorizer(Protocol):
    """Entitlement hook: return ``None`` to allow, or ``(reason_code, reason)`` to deny."""

    def check_subscribe(self, origin: Origin, subject: str) -> tuple[str, str] | None: ...

    def check_publish(self, origin: Origin, subject: str) -> tuple[str, str] | None: ...


class Gatekeeper:
    """The configured entitlement plus the publish address list, for every interface."""

    def __init__(self, entitlement: Entitlement, addresses: AddressList) -> None:
        self.entitlement = entitlement
        self.addresses = addresses

    def check_subscribe(self, origin: Origin, subject: str) -> tuple[str, str] | None:
        return self.entitlement.check_subscribe(origin.token, subject, origin.addr)

    def check_publish(self, origin: Origin, subject: str) -> tuple[str, str] | None:
        if not self.addresses.allows(origin.addr):
            return ("address_not_allowed", f"{origin.addr} is not in PublishAllowFromAddressList")
        return self.entitlement.check_publish(origin.token, subject, origin.addr)


class ConnectionRate:
    """Token bucket per client address (``MaxConnectionsPerSecondPerAddress``; 0: no limit)."""

    __slots__ = ("_buckets", "rate")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._buckets: dict[str, tuple[float, float]] = {}

    def admit(self, address: str, now: float) -> bool:
        rate = self.rate
        if not rate:
            return True
        tokens, last = self._buckets.get(address, (2.0 * rate, now))
        tokens = min(2.0 * rate, tokens + (now - last) * rate)
        if tokens < 1.0:
            self._buckets[address] = (tokens, now)
            return False
        self._buckets[address] = (tokens - 1.0, now)
        if len(self._buckets) > 100_000:  # forget idle addresses (full buckets)
            self._buckets = {a: v for a, v in self._buckets.items() if now - v[1] < 2.0}
        return True


MAX_RETRY_AFTER = 60
"""Seconds a refused client is told to wait at most."""


class SessionAdmission:
    """New sessions a worker admits per second (``AdmissionRate``; 0: no limit), so that a reconnect storm
    does not take the loop from the clients already here (issue 51).

    A token bucket of one second's worth; a session refused is given a turn: the next free slot of a
    schedule that advances by ``1 / rate`` per refusal, so a crowd told to come back is told to come back
    spread at the rate it can be taken, not all after the same second.
    """

    __slots__ = ("_last", "_next", "_tokens", "rate", "refused")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._tokens = rate
        self._last = 0.0
        self._next = 0.0  # the slot given to the last refused session
        self.refused = 0

    def admit(self, now: float) -> int:
        """0 to admit a session now, else the seconds it should wait (its Retry-After)."""
        rate = self.rate
        if not rate:
            return 0
        self._tokens = min(rate, self._tokens + (now - self._last) * rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0
        self.refused += 1
        self._next = max(self._next, now) + 1.0 / rate
        return max(1, min(MAX_RETRY_AFTER, int(-(-(self._next - now) // 1))))


async def custom_decision(entitlement: CustomEntitlement, method: str, origin: Origin, subject: str) -> Decision:
    """Await an async custom entitlement method (bounded, its failures denied)."""
    try:
        answer = getattr(entitlement.impl, method)(origin.token, subject, origin.addr)
        if inspect.isawaitable(answer):
            answer = await asyncio.wait_for(answer, CUSTOM_ENTITLEMENT_TIMEOUT)
    except Exception as exc:
        return CustomEntitlement.verdict(method, exc)
    return CustomEntitlement.verdict(method, answer)


class InOrder:
    """Steps of one client run one after the other (its requests keep their order while an
    asynchronous entitlement decides), whatever each one's decision time."""

    __slots__ = ("_chains", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._chains: dict[str, asyncio.Task[None]] = {}

    def run(self, key: str, step: Coroutine[Any, Any, None]) -> None:
        previous = self._chains.get(key)

        async def chained() -> None:
            if previous is not None:
                with contextlib.suppress(Exception):
                    await previous
            await step

        task = self.loop.create_task(chained())
        self._chains[key] = task
        task.add_done_callback(lambda done: self._chains.pop(key, None) if self._chains.get(key) is done else None)
