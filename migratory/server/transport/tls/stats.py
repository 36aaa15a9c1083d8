"""What this process's TLS layer counts, and how a record-layer failure is logged.

RFC 8446 section 6 names the alerts (:data:`ALERT_NAMES`). Everything here is per process, in
module-level dictionaries (no memory per connection): the monitor copies them into the worker's
shared slot once a second, and ``/stats`` and ``/metrics`` sum them over the node's workers
(``migratory_tls_*``, docs/security.md). Other modules change them through this module's
attributes (``stats.counters[...]``), so a test may swap them for copies.
"""

from __future__ import annotations

import logging
import time

__all__ = [
    "ALERT_LABELS",
    "ALERT_NAMES",
    "FALLBACK_REASONS",
    "RECORD_LAYERS",
    "WARN_EVERY",
    "alerts_received",
    "alerts_sent",
    "counters",
    "fallbacks",
    "record_layer",
]

log = logging.getLogger("migratory.server.tls")  # one logger for the whole layer, as before the split

fallbacks: dict[str, int] = {}
"""TLS connections of lean listeners left on OpenSSL's record layer, by reason (see :data:`FALLBACK_REASONS`).

Counted for this process since it started; a listener with ``TLSLeanTransport = false`` (or whose
context could not be hooked) counts nothing here: all its connections stay with OpenSSL by design.
"""

FALLBACK_REASONS = {
    "not_tls13": "not TLS 1.3",
    "suite": "a TLS 1.3 suite this record layer does not carry",
    "no_secrets": "its traffic secrets did not reach the keylog hook",
    "unverified": "what it negotiated could not be read from libssl",
    "max_fragment_length": "the client negotiated max_fragment_length (RFC 6066)",
    "early_data": "the client sent early data",
    "buffered": "OpenSSL holds records of it not yet read",
    "tickets": "OpenSSL's last flight was not the expected session tickets",
}
"""Why a connection stays on OpenSSL's record layer: the keys of :data:`fallbacks`, and what each means."""

ALERT_NAMES = {
    0: "close_notify",
    10: "unexpected_message",
    20: "bad_record_mac",
    22: "record_overflow",
    40: "handshake_failure",
    42: "bad_certificate",
    43: "unsupported_certificate",
    44: "certificate_revoked",
    45: "certificate_expired",
    46: "certificate_unknown",
    47: "illegal_parameter",
    48: "unknown_ca",
    49: "access_denied",
    50: "decode_error",
    51: "decrypt_error",
    70: "protocol_version",
    71: "insufficient_security",
    80: "internal_error",
    86: "inappropriate_fallback",
    90: "user_canceled",
    109: "missing_extension",
    110: "unsupported_extension",
    112: "unrecognized_name",
    113: "bad_certificate_status_response",
    115: "unknown_psk_identity",
    116: "certificate_required",
    120: "no_application_protocol",
}
"""The alert descriptions of RFC 8446 6, by code: the ``alert`` label of the alert counters."""
ALERT_LABELS = (*ALERT_NAMES.values(), "other")
"""Every value of the ``alert`` label: an RFC 8446 name, or ``other`` (a code RFC 8446 does not list)."""

counters: dict[str, int] = {"lean_connections": 0, "bad_record_mac": 0, "handshake_failures": 0, "selftest_failures": 0}
"""This process's TLS counters since it started: ``lean_connections``, connections the lean record
layer took over; ``bad_record_mac``, records of the peer whose AEAD tag did not verify;
``handshake_failures``, handshakes that failed (an error from OpenSSL, or ``HandshakeTimeout``
passed); ``selftest_failures``, start-up self-tests that failed (then the lean layer is off)."""
RECORD_LAYERS = ("none", "lean", "openssl", "openssl: outside the supported matrix", "openssl: a self-test failed")
"""What carries this process's TLS records after the handshake, as :data:`record_layer` numbers it: no TLS
listener yet; the lean layer; OpenSSL because ``TLSLeanTransport = false``; OpenSSL because the lean
layer turned itself off (:func:`lean_verdict`) - the last two a fallback an operator must hear of."""
record_layer = [0]
"""An index into :data:`RECORD_LAYERS`, set when this process's first TLS listener starts."""
alerts_sent: dict[str, int] = {}
"""Alerts the lean record layer sent, by name (:data:`ALERT_LABELS`): on OpenSSL's record layer, OpenSSL sends them."""
alerts_received: dict[str, int] = {}
"""Alerts the lean record layer received, by name (:data:`ALERT_LABELS`)."""

WARN_EVERY = 60.0
"""Seconds between two WARNING lines for one cause of record-layer failure (per process)."""
_warned: dict[str, list[float]] = {}  # cause -> [monotonic time of the last WARNING, failures not logged since]


def _alert_name(description: int) -> str:
    return ALERT_NAMES.get(description, "other")


def _warn_limited(cause: str, peer: object) -> None:
    """A record-layer failure: WARNING, at most once per :data:`WARN_EVERY` seconds per cause; DEBUG otherwise."""
    now = time.monotonic()
    state = _warned.get(cause)
    if state is None or now - state[0] >= WARN_EVERY:
        skipped = int(state[1]) if state is not None else 0
        _warned[cause] = [now, 0]
        more = f" ({skipped} more since the last warning)" if skipped else ""
        log.warning("TLS: record-layer failure from %s: sending %s alert%s", peer, cause, more)
    else:
        state[1] += 1
        log.debug("TLS: record-layer failure from %s: sending %s alert", peer, cause)
