"""The supported matrix and the start-up self-tests: the lean record layer turns itself off before it is wrong.

Before the first take-over, once per process, :func:`lean_verdict` checks the interpreter and
library (:func:`outside_matrix`: CPython in libssl.LAYOUT_VERSIONS, OpenSSL 3, not in FIPS mode)
and runs :func:`run_selftests`: known answers of RFC 8448 section 3 (HKDF-Expand-Label of RFC 8446
7.1, the traffic key and IV of 7.3, a record of 5.2) and RFC 8439 2.8.2 (ChaCha20-Poly1305), the
transport's own write paths at the top of the sequence space (5.3, 5.5) and its key update (7.2),
and a loopback handshake with OpenSSL as the client. If either fails, every listener keeps OpenSSL's
record layer, said in one WARNING line, a counter and the record-layer metric (stats.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import datetime
import logging
import os
import platform
import socket
import ssl
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from migratory.server.transport.tls import keylog, libssl, stats
from migratory.server.transport.tls.base import _APPLICATION_DATA, _HANDSHAKE, _HEADER, _KEY_UPDATE, _RECORDS, Listener
from migratory.server.transport.tls.keylog import _Capture
from migratory.server.transport.tls.keys import SUITES, Aead
from migratory.server.transport.tls.libssl import _libssl
from migratory.server.transport.tls.records import MAX_PLAINTEXT
from migratory.server.transport.tls.sealer import c_sealer
from migratory.server.transport.tls.transport import TLSTransport

if TYPE_CHECKING:
    from migratory.server.transport._tlsseal import Sealer

__all__ = ["VERIFIED_ON", "lean_verdict", "outside_matrix", "run_selftests", "selftest_seconds"]

log = logging.getLogger("migratory.server.tls")  # one logger for the whole layer, as before the split

SUPPORTED_OPENSSL_MAJOR = 3
"""The OpenSSL major version the lean record layer runs on (its keylog hook, ``SSL_*`` state calls, EVP)."""

VERIFIED_ON = "CPython 3.11.7 with OpenSSL 3.0.19"
"""Where the whole TLS test suite last ran (docs/security.md, "Supported matrix")."""

_verdict: list[str | None] = []  # lean_verdict's answer, once per process
selftest_seconds: list[float] = []
"""How long :func:`lean_verdict` took (matrix check and self-tests), once it has run in this process."""

# RFC 8448 section 3 (TLS_AES_128_GCM_SHA256): the server's application traffic secret, its key and IV,
# and its first application data record (50 bytes 00 01 ... 31, sequence number 1); the secret after
# one KeyUpdate is Botan's (src/tests/test_tls_cipher_state.cpp). Also in tests/test_tls_rfc8448.py.
_RFC8448_SECRET = bytes.fromhex("a11af9f05531f856ad47116b45a950328204b4f44bfb6b3a4b4f1f3fcb631643")
_RFC8448_KEY = bytes.fromhex("9f02283b6c9c07efc26bb9f2ac92e356")
_RFC8448_IV = bytes.fromhex("cf782b88dd83549aadf1e984")
_RFC8448_SECRET_1 = bytes.fromhex("51921b8aa3001976eb401d0a4319a8516416a6c56001a357e5d162031e84f916")
# RFC 8439 section 2.8.2: ChaCha20-Poly1305 of "Ladies and Gentlemen of the class of '99: ..." (its tag last)
_RFC8439_KEY = bytes(range(0x80, 0xA0))
_RFC8439_NONCE = bytes.fromhex("070000004041424344454647")
_RFC8439_AAD = bytes.fromhex("50515253c0c1c2c3c4c5c6c7")
_RFC8439_PLAINTEXT = b" ".join(
    (
        b"Ladies and Gentlemen of the class of '99:",
        b"If I could offer you only one tip for the future,",
        b"sunscreen would be it.",
    )
)
_RFC8439_SEALED = bytes.fromhex(
    "d31a8d34648e60db7b86afbc53ef7ec2a4aded51296e08fea9e2b5a736ee62d63dbea45e8ca9671282fafb69da92728b1a71de0a9e060b29"
    "05d6a5b67ecd3b3692ddbd7f2d778b8c9803aee328091b58fab324e4fad675945585808b4831d7bc3ff4def08e4b7a9de576d26586cec64b"
    "61161ae10b594f09e26a7e902ecbd0600691"
)
_RFC8448_RECORD = bytes.fromhex(
    "1703030043"
    "2e937e11ef4ac740e538ad36005fc4a46932fc3225d05f82aa1b36e30efaf97d90e6dffc602dcb501a59a8fcc49c4bf2e5f0a21c0047c2ab"
    "f332540dd032e167c2955d"
)


def lean_verdict() -> str | None:
    """Why the lean record layer is off in this process, or None: checked once, before the first take-over.

    Off outside the supported matrix (:func:`outside_matrix`) and when a start-up self-test
    fails (:func:`run_selftests`); either is logged as one WARNING line, once per process, and
    every listener then keeps OpenSSL's record layer for all its connections (the keylog hook is
    not even set). The answer is cached: the self-tests cost a few milliseconds, once.
    """
    if not _verdict:
        started = time.perf_counter()
        reason = outside_matrix()
        if reason is None:
            failed = run_selftests()
            if failed is not None:
                reason = f"its start-up self-test {failed} failed"
                stats.counters["selftest_failures"] += 1
        selftest_seconds[:] = [time.perf_counter() - started]
        _verdict.append(reason)
        if reason is None:
            log.debug("TLS: lean record layer self-tests passed in %.1f ms", selftest_seconds[0] * 1000)
        else:
            log.warning("TLS: lean record layer off: %s; every connection keeps OpenSSL's record layer", reason)
    return _verdict[0]


def outside_matrix() -> str | None:
    """Why this interpreter and library are outside the supported matrix, or None.

    The lean record layer runs on CPython versions whose ``_SSLContext`` layout is known
    (:data:`libssl.LAYOUT_VERSIONS`) with OpenSSL 3 (not LibreSSL, BoringSSL or another major), and
    not in FIPS mode: there the records must stay with OpenSSL's FIPS provider, while the lean
    layer's AEAD and HKDF are ``cryptography``'s and ``hmac``'s.
    """
    if not libssl.layout_known():
        low, high = libssl.LAYOUT_VERSIONS
        return (
            f"{platform.python_implementation()} {platform.python_version()} is outside the supported matrix "
            f"(CPython {low[0]}.{low[1]} to {high[0]}.{high[1]})"
        )
    if not ssl.OPENSSL_VERSION.startswith("OpenSSL ") or ssl.OPENSSL_VERSION_INFO[0] != SUPPORTED_OPENSSL_MAJOR:
        return f"{ssl.OPENSSL_VERSION} is outside the supported matrix (OpenSSL {SUPPORTED_OPENSSL_MAJOR})"
    if fips_mode():
        return f"{ssl.OPENSSL_VERSION} is in FIPS mode"
    return None


def fips_mode() -> bool:
    """Whether libcrypto (the ``ssl`` module's) fetches FIPS algorithms by default (OpenSSL 3)."""
    lib = _libssl()
    function = getattr(lib, "EVP_default_properties_is_fips_enabled", None) if lib is not None else None
    if function is None:
        return False
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p]
    return bool(function(None))


def run_selftests() -> str | None:
    """The start-up self-tests of the lean record layer; the name of the first that fails, or None.

    Known answers of the sealers (the C extension's, if built, and the Python one): RFC 8448's
    key, IV, KeyUpdate secret and record byte for byte; then, for every suite and sealer, the
    transport's own write paths at sequence numbers 2^64-2 and 2^64-1, the key update that
    follows (new key and IV from sequence number 0) and a write of two records, against records
    sealed here with ``cryptography``; the C sealer's socket write. Then a loopback: a lean
    :class:`TLSTransport` and an OpenSSL client (``ssl.SSLObject`` over memory BIOs) through a
    handshake whose ``Finished`` carries application data with it, data both ways, a KeyUpdate
    both ways (ours asks for the client's), close_notify both ways, and the secrets wiped after.
    """
    sealer = c_sealer()
    server = Listener(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), _Recorder, 10.0, _CLOCK, lean=False)
    server.sealer = sealer
    aes128, chacha = SUITES["TLS_AES_128_GCM_SHA256"], SUITES["TLS_CHACHA20_POLY1305_SHA256"]
    checks: list[tuple[str, Callable[[], bool]]] = [
        ("hkdf-rfc8448", _kat_hkdf),
        ("seal-rfc8448-python", lambda: _kat_rfc8448(_python_seal(aes128.aead(_RFC8448_KEY), _RFC8448_IV))),
        (
            "chacha20-poly1305-rfc8439",
            lambda: (
                chacha.aead(_RFC8439_KEY).encrypt(_RFC8439_NONCE, _RFC8439_PLAINTEXT, _RFC8439_AAD) == _RFC8439_SEALED
            ),
        ),
    ]
    if sealer is not None:
        checks.append(("seal-rfc8448-c", lambda: _kat_rfc8448(sealer(_RFC8448_KEY, _RFC8448_IV).seal)))
        checks.append(("send-c", lambda: _kat_send(sealer)))
    for name, suite in SUITES.items():
        for use_c in (False, True) if suite.aead is AESGCM and sealer is not None else (False,):
            label = f"seal-{name}-{'c' if use_c else 'python'}"
            checks.append((label, lambda name=name, use_c=use_c: _kat_records(server, name, use_c)))  # type: ignore[misc]
    checks.append(("loopback", lambda: _loopback(sealer)))
    tallies = (dict(stats.counters), dict(stats.alerts_sent), dict(stats.alerts_received))
    try:
        for name, check in checks:
            try:
                passed = check()
            except Exception as exc:  # any failure is one: the lean layer stays off
                return f"{name} ({type(exc).__name__}: {exc})"
            if not passed:
                return name
    finally:
        for tally, before in zip((stats.counters, stats.alerts_sent, stats.alerts_received), tallies, strict=True):
            tally.clear()  # what the self-tests' own transports did is not counted
            tally.update(before)
    return None


class _Clock:
    """The self-tests' event loop: a clock, and timers that never fire (the tests run synchronously)."""

    def time(self) -> float:
        return time.monotonic()

    def call_later(self, delay: float, callback: Callable[..., object], *args: object) -> _Never:
        return _Never()


class _Never:
    def cancel(self) -> None:
        pass


_CLOCK = cast(asyncio.AbstractEventLoop, _Clock())


class _Wire:
    """The self-tests' TCP transport: what is written is kept for the other side."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += data

    def take(self) -> bytes:
        data = bytes(self.out)
        self.out.clear()
        return data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def get_write_buffer_size(self) -> int:
        return len(self.out)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_reading(self) -> bool:
        return not self.closed


class _Recorder(asyncio.Protocol):
    """The self-tests' application: keeps what it receives."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.eof = False

    def data_received(self, data: bytes) -> None:
        self.received += data

    def eof_received(self) -> bool | None:
        self.eof = True
        return None


def _kat_hkdf() -> bool:
    suite = SUITES["TLS_AES_128_GCM_SHA256"]
    key, iv = suite.keys(_RFC8448_SECRET)
    return (
        key == _RFC8448_KEY
        and iv == int.from_bytes(_RFC8448_IV, "big")
        and suite.next_secret(_RFC8448_SECRET) == _RFC8448_SECRET_1
    )


def _kat_rfc8448(seal: Callable[[int, bytes, bytes], bytes]) -> bool:
    """RFC 8448's server application record (sequence number 1), from ``seal(seq, inner, header)``."""
    return seal(1, bytes(range(50)) + b"\x17", _RFC8448_RECORD[:5]) == _RFC8448_RECORD


def _python_seal(aead: Aead, iv: bytes) -> Callable[[int, bytes, bytes], bytes]:
    """A record sealed as the transport does it in Python (nonce = IV xor sequence number)."""

    def seal(seq: int, inner: bytes, header: bytes) -> bytes:
        return header + aead.encrypt((int.from_bytes(iv, "big") ^ seq).to_bytes(12, "big"), inner, header)

    return seal


def _kat_send(sealer: type[Sealer]) -> bool:
    """``Sealer.send``: the record it writes to a socket is the one ``seal`` returns."""
    inner = b"sent in one call\x17"
    header = _HEADER.pack(_APPLICATION_DATA, 0x0303, len(inner) + 16)
    one = sealer(_RFC8448_KEY, _RFC8448_IV)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.setblocking(False)
        if one.send(ours.fileno(), (1 << 64) - 1, inner, header) is not None:
            return False
        expected = one.seal((1 << 64) - 1, inner, header)
        return theirs.recv(len(expected) + 1) == expected


def _kat_records(server: Listener, name: str, use_c: bool) -> bool:
    """The transport's writes at the top of the sequence space, its key update and a two-record write."""
    suite = SUITES[name]
    secret = bytes(range(1, suite.hash_len + 1))
    transport = TLSTransport(server, _Recorder())
    wire = _Wire()
    transport._tcp = cast(asyncio.Transport, wire)
    transport._suite = suite
    transport._state = _RECORDS
    transport._made = True
    transport._wsecret = bytearray(secret)
    key, iv = suite.keys(secret)
    transport._wkey, transport._wiv = bytearray(key), iv
    transport._c = use_c
    transport._wseq = (1 << 64) - 2
    last = b"the last record under the first key"
    first = b"the first record under the next key"
    big = bytes(range(256)) * 65  # 16,640 bytes: two records
    try:
        transport.write(last)  # sequence number 2^64-2, then our KeyUpdate at 2^64-1
        transport.write(first)
        transport.write(big)
        got = wire.take()
    finally:
        transport.connection_lost(None)
        server._active.clear()

    reference = ChaCha20Poly1305 if "CHACHA20" in name else AESGCM  # cryptography's, whatever suite.aead is

    def record(key: bytes, iv: int, seq: int, inner: bytes) -> bytes:
        header = _HEADER.pack(_APPLICATION_DATA, 0x0303, len(inner) + 16)
        return header + reference(key).encrypt((iv ^ seq).to_bytes(12, "big"), inner, header)

    next_key, next_iv = suite.keys(suite.next_secret(secret))
    expected = b"".join(
        (
            record(key, iv, (1 << 64) - 2, last + b"\x17"),
            record(key, iv, (1 << 64) - 1, bytes((_KEY_UPDATE, 0, 0, 1, 0, _HANDSHAKE))),
            record(next_key, next_iv, 0, first + b"\x17"),
            record(next_key, next_iv, 1, big[:MAX_PLAINTEXT] + b"\x17"),
            record(next_key, next_iv, 2, big[MAX_PLAINTEXT:] + b"\x17"),
        )
    )
    return got == expected


def _selftest_context() -> ssl.SSLContext:
    """A TLS 1.3 server context with a throwaway self-signed certificate (P-256), for the loopback only."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "migratory TLS self-test")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.TemporaryDirectory(prefix="migratory-tls-selftest-") as folder:  # mode 0700, removed at once
        path = os.path.join(folder, "selftest.pem")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            out.write(pem_key + certificate.public_bytes(serialization.Encoding.PEM))
        context.load_cert_chain(path)
    return context


def _loopback(sealer: type[Sealer] | None) -> bool:
    """A lean TLSTransport and an OpenSSL client, in memory: take-over, data, KeyUpdates, close_notify."""
    context = _selftest_context()
    problem = keylog._hook(context)
    if problem:
        raise RuntimeError(problem)
    counted = dict(stats.fallbacks)
    tallies = (dict(stats.counters), dict(stats.alerts_sent), dict(stats.alerts_received))
    server = Listener(context, _Recorder, 10.0, _CLOCK, lean=False)
    server.lean = True
    server.sealer = sealer
    app = _Recorder()
    transport = TLSTransport(server, app)
    wire = _Wire()
    client_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_context.check_hostname = False
    client_context.verify_mode = ssl.CERT_NONE
    client_context.minimum_version = ssl.TLSVersion.TLSv1_3
    into_client, from_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(into_client, from_client)

    def client_reads() -> bytes:
        into_client.write(wire.take())
        out = b""
        with contextlib.suppress(ssl.SSLWantReadError):
            while chunk := client.read(65536):
                out += chunk
        return out

    try:
        transport.connection_made(cast(asyncio.Transport, wire))
        early = b"with the client's Finished"
        sent = False
        for _ in range(10):
            with contextlib.suppress(ssl.SSLWantReadError):
                client.do_handshake()
                if not sent:
                    client.write(early)  # in the same flight as the Finished
                    sent = True
            flight = from_client.read()
            if flight:
                transport.data_received(flight)
            answer = wire.take()
            if answer:
                into_client.write(answer)
            if not flight and not answer:
                break
        if not (transport.lean and transport._state == _RECORDS and bytes(app.received) == early):
            raise RuntimeError("not taken over after the handshake")
        transport.write(b"from the server")
        if client_reads() != b"from the server":
            raise RuntimeError("data to the client")
        read_secret = transport._rsecret
        wire.write(transport._update_write_key(requested=True))  # ours, asking for the client's
        transport.write(b"under our next key")
        if client_reads() != b"under our next key":
            raise RuntimeError("KeyUpdate to the client")
        client.write(b"under the client's next key")
        transport.data_received(from_client.read())
        if not app.received.endswith(b"under the client's next key") or transport._rsecret is read_secret:
            raise RuntimeError("KeyUpdate from the client")
        secrets = [transport._wsecret, transport._rsecret, transport._wkey, transport._rkey]
        with contextlib.suppress(ssl.SSLWantReadError):
            client.unwrap()  # the client's close_notify: ours answers it
        transport.data_received(from_client.read())
        into_client.write(wire.take())
        client.unwrap()
        if not (app.eof and wire.closed):
            raise RuntimeError("close_notify")
        transport.connection_lost(None)
        if any(any(buffer) for buffer in secrets) or transport._wsecret or transport._rsecret:
            raise RuntimeError("secrets not wiped")
    finally:
        _Capture.target = None
        keylog._enabled.pop(id(context), None)
        stats.fallbacks.clear()
        stats.fallbacks.update(counted)
        for tally, before in zip((stats.counters, stats.alerts_sent, stats.alerts_received), tallies, strict=True):
            tally.clear()  # the self-test's own connection is not counted
            tally.update(before)
        server._active.clear()
    return True
