"""Differential fuzzing of the lean TLS 1.3 record layer against OpenSSL's (issue 31, item 4).

The same random client record streams go to two connections of the same server: one on the lean
record layer (``TLSServer(..., lean=True)``), one on OpenSSL's (``lean=False``, as with
``TLSLeanTransport = false``), each with a real OpenSSL client (``Pair`` of test_tlstransport)
whose traffic secret (from its key log) seals the stream: data with and without padding, empty
records, alerts (close_notify, user_canceled, fatal ones, malformed ones), KeyUpdates (requested or
not, split over records), other handshake messages, bad MACs, records over the size limits, records
with the wrong outer type, inner type or legacy version, records shorter than a tag, and garbage,
all cut in random chunks. Both must then show the same outcome:

* the same application bytes delivered, in order (so up to the same point);
* the connection closed or not, and the application told of a close_notify or not;
* the same class of what the server answered, as the real client reads it: nothing, close_notify,
  or a fatal alert; and, if the connection is still open, the server's next data read by the client
  (so the two followed the client's KeyUpdates and answered them in a way the client follows).

Known deviations, compared by class only or left out of the comparison (docs/security.md):

* **alert codes**: only the class is compared. Seen to differ (lean / OpenSSL 3.0): a malformed
  alert, not 2 bytes (``decode_error`` / ``unexpected_message``, documented in docs/security.md); a
  KeyUpdate longer than 1 byte (``decode_error`` / ``illegal_parameter``: OpenSSL checks the
  message's maximum size first); an undecryptable record whose legacy_record_version is not 0x0303
  (``bad_record_mac`` / ``decode_error``); a handshake message other than KeyUpdate, which the lean
  layer refuses at its first byte (``unexpected_message``) where OpenSSL waits for the whole message
  and may fail on a later record first (hence every stream ends with a data record: a partial
  handshake message then gets a fatal alert from both).
* **how the server closes after sending a fatal alert**: the lean layer closes TCP once the alert
  is written (``close``), OpenSSL's record layer aborts it (``_fail``); ``aborted`` is not compared.
* **KeyUpdate answers**: the lean layer sends one answer for all the requests of one read (RFC 8446
  4.6.3), OpenSSL's record layer may send several (two for three requests in one read, with OpenSSL
  3.0.19); the number is not compared, only that the client reads the server's next data.
* **legacy_record_version** (:func:`test_legacy_record_version_is_ignored_by_lean_refused_by_openssl`):
  RFC 8446 5.1 says to ignore it; the lean layer does, OpenSSL 3.0 answers anything but 0x0303 with
  a fatal alert. Streams with another version are compared on what comes before that record only.
* **padding past 2^14 + 1 bytes of TLSInnerPlaintext**
  (:func:`test_padding_past_the_inner_plaintext_limit`): RFC 8446 5.4 caps the whole inner
  plaintext, padding included; the lean layer answers ``record_overflow``, OpenSSL 3.0 checks only
  the content after the padding is stripped and accepts it. Compared on what comes before only.
* **a fifth warning alert in a row that is not user_canceled**
  (:func:`test_a_fifth_warning_alert_in_a_row`): OpenSSL 3.0 counts every alert of level warning
  (and user_canceled) towards its limit of five and answers the fifth with ``unexpected_message``,
  even a close_notify or an error alert; the lean layer counts user_canceled only (RFC 8446 6: in
  TLS 1.3 the level is implicit in the alert), so it closes cleanly after a close_notify and says
  nothing after an error alert (the peer's alert was fatal). Compared up to that alert.
* **a close_notify of level fatal after a warning alert** (:func:`test_a_fatal_close_notify_after_a_warning`):
  OpenSSL 3.0 takes it for a close_notify only if the last warning it got was one (``warn_alert``),
  so after a user_canceled it reports a truncation (``SSLEOFError``: the application is not told of
  a close_notify and the connection is aborted); the lean layer ignores the level (RFC 8446 6).
  Compared up to that alert.

:func:`first_deviation` finds where a stream meets one of the last four. The fuzzer is bounded
(1,000 examples of two in-memory handshakes each: about 5 s here, 12 s with both cores busy);
each deviation has its own deterministic test below, which pins both sides.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from migratory.server.transport.tls import SUITES, TLSServer
from tests.test_tlstransport import App, pki, server_context
from tests.tls_fuzz_support import (
    AFTER,
    ALERT,
    APPLICATION_DATA,
    HANDSHAKE,
    MAX_CIPHERTEXT,
    MAX_INNER,
    Outcome,
    Rec,
    WireOf,
    client_context_for,
    run,
)
from tests.tls_interop_support import isolate_tallies

__all__ = ["pki"]  # the module-scoped certificate fixture, shared with test_tlstransport

SUITE_NAMES = sorted(SUITES)


class Servers:
    """One lean and one OpenSSL-record-layer server on the same certificate, and a client context per suite."""

    def __init__(self, pki: dict[str, Path], folder: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.lean = TLSServer(server_context(pki), App, 5.0, self.loop)
        self.openssl = TLSServer(server_context(pki), App, 5.0, self.loop, lean=False)
        assert self.lean.lean and not self.openssl.lean
        self.keylog = folder / "client-keys.log"
        self.contexts = {suite: client_context_for(pki, suite, self.keylog) for suite in SUITE_NAMES}

    def both(self, suite: str, records: list[Rec], chunks: list[int]) -> tuple[Outcome, Outcome]:
        wire_of = WireOf(records)
        context = self.contexts[suite]
        lean = run(self.lean, context, self.keylog, suite, wire_of, chunks)
        openssl = run(self.openssl, context, self.keylog, suite, wire_of, chunks)
        return lean, openssl


@pytest.fixture(scope="module")
def servers(pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    with pytest.MonkeyPatch.context() as patch:
        isolate_tallies(patch)  # thousands of alerts here: the process-wide counts and log limits left as they were
        both = Servers(pki, tmp_path_factory.mktemp("fuzz"))
        yield both
        both.loop.close()


# --- the streams ---------------------------------------------------------------------------------

payloads = st.one_of(st.binary(min_size=1, max_size=64), st.binary(min_size=65, max_size=2000))
small_padding = st.one_of(st.just(0), st.integers(1, 32), st.integers(33, 300))


def data(payload: bytes, padding: int = 0) -> list[Rec]:
    return [Rec(payload, APPLICATION_DATA, padding)]


def alert(level: int, description: int, padding: int = 0) -> list[Rec]:
    return [Rec(bytes((level, description)), ALERT, padding)]


def key_update(requested: int, cuts: list[int]) -> list[Rec]:
    """A valid KeyUpdate, in as many records as ``cuts`` make (the client's key moves after the last)."""
    message = bytes((0x18, 0, 0, 1, requested))
    points = sorted({c for c in cuts if 0 < c < len(message)})
    parts = [message[a:b] for a, b in zip([0, *points], [*points, len(message)], strict=True)]
    return [Rec(part, HANDSHAKE, next_key=i == len(parts) - 1) for i, part in enumerate(parts)]


def header(kind: int, version: int, length: int) -> bytes:
    return bytes((kind,)) + version.to_bytes(2, "big") + length.to_bytes(2, "big")


BAD_HANDSHAKES = [
    b"",  # empty handshake record
    b"\x04\x00\x00\x04\x00\x00\x00\x00",  # NewSessionTicket from a client
    b"\x0b\x00\x00\x00",  # Certificate nobody asked for
    b"\x14\x00\x00\x20" + bytes(32),  # Finished
    b"\x18\x00\x00\x01\x02",  # KeyUpdate with request 2
    b"\x18\x00\x00\x02\x00\x00",  # KeyUpdate of 2 bytes
    b"\x18\x00\x00\x00",  # KeyUpdate of 0 bytes
    b"\x18\x00\x00\x01\x00\x18",  # a KeyUpdate not ending its record
    b"\x01\x00\x00\x00",  # ClientHello
]

benign = st.one_of(
    st.builds(data, payloads, small_padding),
    st.builds(data, st.just(b""), small_padding),  # an empty record
    st.builds(lambda n: [Rec(b"", APPLICATION_DATA)] * n, st.integers(2, 40)),  # empties in a row (limit 32)
    st.builds(lambda: alert(1, 90)),  # user_canceled (skipped, five in a row are fatal)
    st.builds(lambda n: alert(1, 90) * n, st.integers(2, 6)),
    st.builds(key_update, st.sampled_from([0, 1]), st.lists(st.integers(1, 4), max_size=3)),
    st.builds(data, st.just(bytes(range(256)) * 64)),  # 16,384 bytes: the largest record
)

hostile = st.one_of(
    st.builds(lambda level: alert(level, 0), st.sampled_from([1, 2])),  # close_notify (then more records)
    st.builds(alert, st.sampled_from([1, 2]), st.sampled_from([10, 20, 40, 42, 47, 50, 80, 109, 120, 255])),
    st.builds(lambda body: [Rec(body, ALERT)], st.sampled_from([b"", b"\x01", b"\x01\x00\x00", b"\x02\x28\x00\x00"])),
    st.builds(lambda body: [Rec(body, HANDSHAKE)], st.sampled_from(BAD_HANDSHAKES)),
    st.builds(lambda body: [Rec(body, HANDSHAKE)], st.binary(min_size=1, max_size=12)),
    st.builds(lambda p: [Rec(p, APPLICATION_DATA, tamper=True)], payloads),  # bad MAC
    st.builds(lambda t, p: [Rec(p, t)], st.sampled_from([0x14, 0x18, 0x63, 0xFF]), payloads),  # unknown inner type
    st.builds(lambda n: [Rec(b"", None, n)], st.integers(0, 40)),  # no content type at all (only zeros)
    st.builds(lambda t, p: [Rec(p, APPLICATION_DATA, outer=t)], st.sampled_from([20, 21, 22, 24, 0]), payloads),
    st.builds(  # ciphertext over 2^14 + 256 (sealed for real: data plus padding)
        lambda n: [Rec(b"o" * (1 << 14), APPLICATION_DATA, MAX_CIPHERTEXT - 16 - (1 << 14) - 1 + n)],
        st.integers(1, 64),
    ),
    st.builds(
        lambda n: [Rec(raw=header(23, 0x0303, MAX_CIPHERTEXT + n) + bytes(MAX_CIPHERTEXT + n))], st.integers(1, 300)
    ),
    st.builds(lambda n: [Rec(b"d" * ((1 << 14) + n), APPLICATION_DATA)], st.integers(1, 200)),  # data over 2^14
    st.builds(lambda n: [Rec(raw=header(23, 0x0303, n) + bytes(n))], st.integers(0, 16)),  # shorter than a tag
    st.builds(lambda: [Rec(raw=b"\x14\x03\x03\x00\x01\x01")]),  # ChangeCipherSpec after the handshake
    st.builds(
        lambda kind, version, body: [Rec(raw=header(kind, version, len(body)) + body)],
        st.sampled_from([0, 20, 21, 22, 23, 24, 255]),
        st.sampled_from([0x0303, 0x0301]),
        st.binary(max_size=64),
    ),
)

operations = st.one_of(benign, benign, benign, benign, hostile)  # mostly streams a connection survives a while
streams = st.lists(operations, min_size=1, max_size=10).map(lambda ops: [rec for op in ops for rec in op])
chunkings: st.SearchStrategy[list[int]] = st.one_of(
    st.just([]),  # all at once
    st.lists(st.integers(1, 7), min_size=1, max_size=4),  # a few bytes at a time
    st.lists(st.integers(1, 20000), min_size=1, max_size=6),
)


def first_deviation(records: list[Rec]) -> tuple[int, str] | None:
    """Where the stream meets a deviation by design (see the docstring), and which; None if it does not.

    Follows OpenSSL 3.0's count of warning alerts (``alert_count``: alerts of level warning and
    ``user_canceled`` ones, reset by a non-empty record of another type) and its last warning
    (``warn_alert``, which decides whether a close_notify is a clean end).
    """
    warnings = 0
    last_warning = 0  # close_notify, OpenSSL's initial value
    for index, rec in enumerate(records):
        if rec.raw is not None:
            continue
        if rec.version != 0x0303:
            return index, "legacy_record_version"
        inner = len(rec.content) + (rec.content_type is not None) + rec.padding
        if inner > MAX_INNER and len(rec.content) <= (1 << 14) and inner + 16 <= MAX_CIPHERTEXT:
            return index, "padding past the inner plaintext limit"
        if rec.content_type == ALERT and len(rec.content) == 2 and not rec.tamper and rec.outer == APPLICATION_DATA:
            level, description = rec.content
            if level == 1 or description == 90:
                warnings += 1
                last_warning = description
                if warnings >= 5 and description != 90:
                    return index, "a fifth warning alert in a row that is not user_canceled"
            elif description == 0 and last_warning != 0:
                return index, "a fatal-level close_notify after a warning alert"
        elif rec.content and rec.content_type not in (ALERT, None):
            warnings = 0
    return None


def compare(lean: Outcome, openssl: Outcome) -> None:
    assert lean.delivered == openssl.delivered, "different application data delivered"
    assert (lean.closed, lean.eof) == (openssl.closed, openssl.eof), "closed (and told of close_notify) or not"
    assert lean.alert_class == openssl.alert_class, f"lean answered {lean.answer}, OpenSSL {openssl.answer}"
    assert not lean.answer.startswith("client error") and not openssl.answer.startswith("client error")
    assert lean.client_read == openssl.client_read
    if not lean.closed:
        assert lean.client_read == AFTER and lean.answer == "none"


@settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(suite=st.sampled_from(SUITE_NAMES), records=streams, chunks=chunkings)
@example(suite="TLS_AES_128_GCM_SHA256", records=alert(1, 90) * 4 + data(b"x") + alert(1, 90) * 5, chunks=[])
@example(suite="TLS_CHACHA20_POLY1305_SHA256", records=[*key_update(1, [1, 3]), *data(b"after")], chunks=[3])
@example(suite="TLS_AES_256_GCM_SHA384", records=[Rec(b"\x01", ALERT), *data(b"dropped")], chunks=[])
@example(suite="TLS_AES_128_GCM_SHA256", records=[*data(b"a"), *alert(1, 0), *data(b"ignored")], chunks=[])
@example(suite="TLS_AES_128_GCM_SHA256", records=[Rec(b"", APPLICATION_DATA)] * 33, chunks=[])
def test_lean_and_openssl_record_layers_agree(
    servers: Servers, suite: str, records: list[Rec], chunks: list[int]
) -> None:
    deviation = first_deviation(records)
    if deviation is not None:
        records = records[: deviation[0]]  # compared up to the record where they differ by design
    lean, openssl = servers.both(suite, [*records, *data(b"probe")], chunks)
    event(f"outcome: {lean.answer} / {openssl.answer}")
    if deviation is not None:
        event(f"cut at a deviation: {deviation[1]}")
    compare(lean, openssl)


# --- the deviations by design, pinned on both sides --------------------------------------------------

SUITE = "TLS_AES_128_GCM_SHA256"


def survived(outcome: Outcome, delivered: bytes) -> bool:
    """Still open, ``delivered`` given to the application, the server's next data read by the client."""
    return outcome.delivered == delivered and not outcome.closed and outcome.client_read == AFTER


def test_legacy_record_version_is_ignored_by_lean_refused_by_openssl(servers: Servers) -> None:
    """RFC 8446 5.1: legacy_record_version "MUST be ignored for all purposes" (it is in the AEAD's data)."""
    for version, openssl_alert in ((0x0301, "decode_error"), (0x0304, "decode_error"), (0x0203, "protocol_version")):
        records = [Rec(b"v", APPLICATION_DATA, version=version), *data(b"probe")]
        assert first_deviation(records) == (0, "legacy_record_version")
        lean, openssl = servers.both(SUITE, records, [])
        assert survived(lean, b"vprobe")
        assert openssl.delivered == b"" and openssl.closed and openssl.answer == openssl_alert


def test_padding_past_the_inner_plaintext_limit(servers: Servers) -> None:
    """RFC 8446 5.4: "the full encoded TLSInnerPlaintext MUST NOT exceed 2^14 + 1 octets", padding included."""
    over = [Rec(b"p" * 100, APPLICATION_DATA, MAX_INNER - 100), *data(b"probe")]  # inner: 2^14 + 2 bytes
    assert first_deviation(over) == (0, "padding past the inner plaintext limit")
    lean, openssl = servers.both(SUITE, over, [])
    assert lean.delivered == b"" and lean.closed and lean.answer == "record_overflow"
    assert survived(openssl, b"p" * 100 + b"probe")
    # one byte less: both take it
    at_limit = [Rec(b"p" * 100, APPLICATION_DATA, MAX_INNER - 101), *data(b"probe")]
    assert first_deviation(at_limit) is None
    for outcome in servers.both(SUITE, at_limit, []):
        assert survived(outcome, b"p" * 100 + b"probe")


def test_a_fifth_warning_alert_in_a_row(servers: Servers) -> None:
    canceled = alert(1, 90) * 4
    # a fifth user_canceled: fatal unexpected_message from both (no deviation)
    records = [*canceled, *alert(1, 90), *data(b"probe")]
    assert first_deviation(records) is None
    for outcome in servers.both(SUITE, records, []):
        assert outcome.closed and outcome.answer == "unexpected_message" and outcome.delivered == b""
    # a fifth that is a close_notify of level warning: lean ends cleanly, OpenSSL counts it
    records = [*canceled, *alert(1, 0), *data(b"probe")]
    assert first_deviation(records) == (4, "a fifth warning alert in a row that is not user_canceled")
    lean, openssl = servers.both(SUITE, records, [])
    assert lean.closed and lean.eof and lean.answer == "close_notify"
    assert openssl.closed and not openssl.eof and openssl.answer == "unexpected_message"
    # a fifth that is an error alert of level warning: the lean layer closes without a word (it is fatal)
    lean, openssl = servers.both(SUITE, [*canceled, *alert(1, 20), *data(b"probe")], [])
    assert lean.closed and lean.aborted and lean.answer == "none"
    assert openssl.closed and openssl.answer == "unexpected_message"
    # data between them starts the count again, in both: then the close_notify is the fourth
    records = [*canceled, *data(b"x"), *alert(1, 90) * 3, *alert(1, 0)]
    assert first_deviation(records) is None
    for outcome in servers.both(SUITE, records, []):
        assert outcome.delivered == b"x" and outcome.eof and outcome.answer == "close_notify"


def test_a_fatal_close_notify_after_a_warning(servers: Servers) -> None:
    # alone (OpenSSL's warn_alert is still close_notify, its initial value): a clean end in both
    records = [*data(b"before"), *alert(2, 0), *data(b"ignored")]
    assert first_deviation(records) is None
    for outcome in servers.both(SUITE, records, []):
        assert outcome.delivered == b"before" and outcome.eof and outcome.answer == "close_notify"
    # after a user_canceled: OpenSSL 3.0 sees a truncation, the lean layer a close_notify
    records = [*alert(1, 90), *data(b"before"), *alert(2, 0), *data(b"ignored")]
    assert first_deviation(records) == (2, "a fatal-level close_notify after a warning alert")
    lean, openssl = servers.both(SUITE, records, [])
    assert lean.delivered == openssl.delivered == b"before"
    assert lean.eof and lean.answer == "close_notify" and not lean.aborted
    assert not openssl.eof and openssl.aborted and openssl.answer == "none"


def test_a_malformed_alert_differs_in_its_code_only(servers: Servers) -> None:
    """docs/security.md: "an alert of one byte or of more than two gets decode_error (OpenSSL 3.0 answers
    unexpected_message there)"; an empty one gets unexpected_message in both (issue 52, N1)."""
    for body in (b"\x01", b"\x01\x00\x00"):
        lean, openssl = servers.both(SUITE, [*data(b"kept"), Rec(body, ALERT), *data(b"dropped")], [])
        assert lean.delivered == openssl.delivered == b"kept" and lean.closed and openssl.closed
        assert (lean.answer, openssl.answer) == ("decode_error", "unexpected_message")
    lean, openssl = servers.both(SUITE, [*data(b"kept"), Rec(b"", ALERT), *data(b"dropped")], [])
    assert lean.delivered == openssl.delivered == b"kept" and lean.closed and openssl.closed
    assert lean.answer == openssl.answer == "unexpected_message"


# --- the C sealer under AddressSanitizer and UBSan -----------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
PROBE = """
#include <stdlib.h>
int probe(int n) { char *p = malloc(8); p[n] = 1; int v = p[0]; free(p); return v; }
"""


def libasan() -> str | None:
    """libasan.so as gcc links it, or None (``-print-file-name`` echoes the bare name when it has none)."""
    if shutil.which("gcc") is None:
        return None
    found = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30)
    path = found.stdout.strip()
    return path if found.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


def sanitized_env() -> dict[str, str]:
    asan = libasan()
    assert asan is not None
    return dict(
        os.environ,
        LD_PRELOAD=asan,
        ASAN_OPTIONS="detect_leaks=0:halt_on_error=1",
        UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
        PYTHONPATH=str(ROOT),
    )


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed: the sanitizer build needs it")
@pytest.mark.skipif(libasan() is None, reason="gcc has no libasan (AddressSanitizer's runtime): install libasan")
def test_the_c_sealer_under_address_and_undefined_behaviour_sanitizers(tmp_path: Path) -> None:
    """_tlsseal.c built as setuptools builds it (pyproject.toml's ext-modules: Python's headers, no OpenSSL's),
    with ``-fsanitize=address,undefined``, then driven by tests/tls_asan_check.py under libasan.

    First a probe library with a deliberate heap overflow shows the sanitizer is live in such a process
    (LD_PRELOAD of libasan into an uninstrumented Python)."""
    include = {sysconfig.get_paths()["include"], sysconfig.get_paths()["platinclude"]}
    if not any((Path(folder) / "Python.h").exists() for folder in include):
        pytest.skip("Python's headers (Python.h) are not installed: the extension cannot be built")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    built = tmp_path / f"_tlsseal{suffix}"
    command = ["gcc", "-shared", "-fPIC", "-O1", "-g", "-Wall", *SANITIZERS]
    command += [f"-I{folder}" for folder in sorted(include)]
    command += [str(ROOT / "migratory" / "server" / "transport" / "_tlsseal.c"), "-o", str(built)]
    compiled = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert compiled.returncode == 0, compiled.stderr
    assert "warning" not in compiled.stderr, compiled.stderr
    # the sanitizer is live in such a process: a deliberate overflow in a probe library is reported
    (tmp_path / "probe.c").write_text(PROBE)
    probe = tmp_path / "probe.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-g", *SANITIZERS, str(tmp_path / "probe.c"), "-o", str(probe)], check=True
    )
    overflow = subprocess.run(
        [sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(probe)!r}).probe(8)"],
        env=sanitized_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert overflow.returncode != 0 and "heap-buffer-overflow" in overflow.stderr, overflow.stderr[-2000:]
    # and the sealer
    checked = subprocess.run(
        [sys.executable, "-m", "tests.tls_asan_check", str(tmp_path)],
        cwd=ROOT,
        env=sanitized_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    report = checked.stderr[-4000:]
    assert checked.returncode == 0, report
    assert "AddressSanitizer" not in checked.stderr and "runtime error" not in checked.stderr, report
    assert checked.stdout.startswith("ok "), checked.stdout + report
