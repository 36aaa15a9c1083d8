"""Interoperability of the lean TLS 1.3 record layer with clients that are not Python's ``ssl`` (issue 31, item 4).

Two independent TLS 1.3 clients: tlslite-ng (pure Python, none of OpenSSL's code) and
``openssl s_client`` (its own process, driven through stdin and stdout). Against the real server
code (``migratory.server.process.app.serve`` on a thread of this process, :class:`tests.tls_interop_support.LiveServer`:
Engine, Connection, the TLS listener on the worker's epoll transport, the context of
``migratory.server.transport.context.build_context``), each test exchanges real application data: a WebSocket upgrade
then a native CONNECT, SUBSCRIBE, PUBLISH and the MESSAGE back (or a ``GET /health``), and checks
which record layer carried it: the server's transport for that connection (``lean``), what it
negotiated (suite, resumption), the KeyUpdates it followed and sent, and
``tls_stats.fallbacks``.

Covered: the three TLS 1.3 suites; KeyUpdate both ways (the client's, with and without
update_requested, and the server's own before its key's limit, made small here); max_fragment_length
(s_client ``-maxfraglen``: the connection stays on OpenSSL's record layer, counted, and works with
records no larger than agreed) and record_size_limit (tlslite-ng: OpenSSL never agrees to it, the
lean layer carries the connection with full-size records, which the client takes); HelloRetryRequest
(tlslite-ng offering a key share the server does not support, or none; s_client against a server
whose only group is P-384); session resumption (tlslite-ng's session, s_client ``-sess_out`` and
``-sess_in``).

Not covered: early data. The server never allows it (CPython's contexts leave ``max_early_data`` at 0,
so its tickets allow none and s_client ``-early_data`` sends nothing); the refusal of a connection
whose early data state is not "not sent" is tested in process (test_tls_review.py).
"""

from __future__ import annotations

import importlib.util
import itertools
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from migratory.server.transport.tls import SUITES
from migratory.server.transport.tls import records as tls_records
from migratory.server.transport.tls import stats as tls_stats
from tests.test_tlstransport import pki
from tests.tls_interop_support import (
    HRR_RANDOM,
    LiveServer,
    Observer,
    SClient,
    Seen,
    TlsliteClient,
    closing,
    health,
    isolate_tallies,
    pub_sub,
    wait_for,
)

__all__ = ["pki"]  # the module-scoped certificate fixture, shared with test_tlstransport

needs_tlslite = pytest.mark.skipif(
    importlib.util.find_spec("tlslite") is None, reason="tlslite-ng is not installed (pip install -e '.[dev]')"
)
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command is not installed")
pytestmark = pytest.mark.filterwarnings("ignore:The asyncore module is deprecated:DeprecationWarning")  # tlslite-ng's

TLSLITE_NAMES = {
    "TLS_AES_128_GCM_SHA256": "aes128gcm",
    "TLS_AES_256_GCM_SHA384": "aes256gcm",
    "TLS_CHACHA20_POLY1305_SHA256": "chacha20-poly1305",
}
BIG = bytes(range(256)) * 160  # 40,960 bytes: three records each way


@pytest.fixture(scope="module")
def observer() -> Iterator[Observer]:
    with pytest.MonkeyPatch.context() as patch:
        isolate_tallies(patch)  # this module's own fallbacks count (and the rest), the process-wide left as they were
        seen = Observer()
        seen.install(patch)
        yield seen


@pytest.fixture(scope="module")
def live(pki: dict[str, Path], observer: Observer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    server = LiveServer(tmp_path_factory.mktemp("live"), pki).start()
    assert observer.seen and observer.seen[-1].lean  # its own probe: a lean connection
    yield server
    server.stop()


def connections(observer: Observer, mark: int, count: int = 1) -> list[Seen]:
    """The server's connections since ``mark``: ``count`` of them, each with its handshake done."""
    wait_for(lambda: len(observer.since(mark)) >= count and all(s.version for s in observer.since(mark)), "handshakes")
    seen = observer.since(mark)
    assert len(seen) == count, [s.peer for s in seen]
    return seen


def unchanged(before: dict[str, int]) -> bool:
    return tls_stats.fallbacks == before


# --- every suite -------------------------------------------------------------------------------


@needs_tlslite
@pytest.mark.parametrize("suite", sorted(SUITES))
def test_tlslite_ng_every_suite(live: LiveServer, observer: Observer, suite: str) -> None:
    before, mark = dict(tls_stats.fallbacks), observer.mark()
    with closing(TlsliteClient(live.port, ciphers=[TLSLITE_NAMES[suite]])) as client:
        assert client.version == (3, 4) and client.cipher == TLSLITE_NAMES[suite]
        pub_sub(client, f"/interop/tlslite/{suite}", [b"small", BIG])
    (seen,) = connections(observer, mark)
    assert seen.lean and seen.cipher == suite and seen.version == "TLSv1.3" and unchanged(before)


@needs_openssl
@pytest.mark.parametrize("suite", sorted(SUITES))
def test_s_client_every_suite(live: LiveServer, observer: Observer, pki: dict[str, Path], suite: str) -> None:
    before, mark = dict(tls_stats.fallbacks), observer.mark()
    with closing(SClient(live.port, pki["ca"], "-ciphersuites", suite)) as client:
        assert f"Ciphersuite: {suite}" in client.stderr
        pub_sub(client, f"/interop/s_client/{suite}", [b"small", BIG])
    (seen,) = connections(observer, mark)
    assert seen.lean and seen.cipher == suite and unchanged(before)


@needs_tlslite
@needs_openssl
def test_health_over_both_clients(live: LiveServer, observer: Observer, pki: dict[str, Path]) -> None:
    before, mark = dict(tls_stats.fallbacks), observer.mark()
    with closing(TlsliteClient(live.port)) as client:
        assert b'"status"' in health(client)
    with closing(SClient(live.port, pki["ca"])) as client:
        assert b'"status"' in health(client)
    seen = connections(observer, mark, 2)
    assert all(s.lean for s in seen) and unchanged(before)


# --- KeyUpdate both ways -------------------------------------------------------------------------


def key_updates_both_ways(
    client: TlsliteClient | SClient,
    seen_of: Callable[[], Seen],
    subject: str,
    monkeypatch: pytest.MonkeyPatch,
    big: bytes,
) -> Seen:
    session = pub_sub(client, subject, [b"before"])
    seen = seen_of()
    assert (seen.client_key_updates, seen.server_key_updates) == (0, 0)
    client.key_update(requested=False)  # the client's next key; no answer asked
    session.round_trip(subject, b"after update_not_requested")
    assert (seen.client_key_updates, seen.server_key_updates) == (1, 0)
    client.key_update(requested=True)  # the client's next key, and the server's (RFC 8446 4.6.3)
    session.round_trip(subject, b"after update_requested " + big)
    assert (seen.client_key_updates, seen.server_key_updates) == (2, 1)
    # the server's own KeyUpdates, before its key's limit (made 3 records here instead of 2^24)
    monkeypatch.setattr(tls_records, "KEY_UPDATE_AFTER", 3)
    for n in range(12):  # about one or two records each
        session.round_trip(subject, b"under the server's key number %d" % n)
    assert seen.server_key_updates >= 1 + 3 and seen.client_key_updates == 2
    return seen


@needs_tlslite
def test_tlslite_ng_key_updates_both_ways(
    live: LiveServer, observer: Observer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, mark = dict(tls_stats.fallbacks), observer.mark()

    def seen_of() -> Seen:
        return connections(observer, mark)[0]

    with closing(TlsliteClient(live.port)) as client:
        seen = key_updates_both_ways(client, seen_of, "/interop/ku/tlslite", monkeypatch, BIG)
    assert seen.lean and unchanged(before)


@needs_openssl
def test_s_client_key_updates_both_ways(
    live: LiveServer, observer: Observer, pki: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    before, mark = dict(tls_stats.fallbacks), observer.mark()

    def seen_of() -> Seen:
        return connections(observer, mark)[0]

    with closing(SClient(live.port, pki["ca"], commands=True)) as client:
        # messages of up to 3,900 bytes: each write one read of s_client's (SClient.key_update)
        seen = key_updates_both_ways(client, seen_of, "/interop/ku/s_client", monkeypatch, b"u" * 3900)
        assert client.stderr.count("KEYUPDATE") == 2  # its k and K commands
    assert seen.lean and unchanged(before)


# --- max_fragment_length, record_size_limit --------------------------------------------------------


def received_record_lengths(msgfile: Path) -> list[int]:
    """The lengths of the records s_client received, from its ``-msg`` log (record headers in hex)."""
    lines = msgfile.read_text().splitlines()
    lengths = []
    for line, following in itertools.pairwise(lines):
        if line.startswith("<<< ") and "RecordHeader" in line:
            header = bytes.fromhex(following.strip())
            lengths.append(int.from_bytes(header[3:5], "big"))
    return lengths


def record_lengths(stream: bytes) -> list[int]:
    """The lengths of the records in a TLS byte stream, from its first byte."""
    lengths, pos = [], 0
    while pos + 5 <= len(stream):
        length = int.from_bytes(stream[pos + 3 : pos + 5], "big")
        lengths.append(length)
        pos += 5 + length
    return lengths


@needs_openssl
@pytest.mark.parametrize("fragment", [512, 4096])
def test_s_client_max_fragment_length_stays_on_openssls_records(
    live: LiveServer, observer: Observer, pki: dict[str, Path], tmp_path: Path, fragment: int
) -> None:
    before, mark = dict(tls_stats.fallbacks), observer.mark()
    msgfile = tmp_path / "msg.log"
    subject = f"/interop/mfl/{fragment}"
    with closing(SClient(live.port, pki["ca"], "-maxfraglen", str(fragment), msgfile=msgfile)) as client:
        pub_sub(client, subject, [b"m" * 5000, BIG])
    lengths = received_record_lengths(msgfile)
    # every record the server sent fits the agreed fragment (plus content type and tag); BIG needed many
    assert lengths and max(lengths) <= fragment + 1 + 16 and len(lengths) > len(BIG) // fragment, lengths
    # a KeyUpdate both ways on OpenSSL's record layer (small messages: SClient.key_update)
    with closing(SClient(live.port, pki["ca"], "-maxfraglen", str(fragment), commands=True)) as client:
        session = pub_sub(client, subject, [b"m" * 3900])
        client.key_update(requested=True)
        session.round_trip(subject, b"after a KeyUpdate " + b"m" * 3800)
    seen = connections(observer, mark, 2)
    assert all(not s.lean and s.transport._suite is None and s.cipher in SUITES for s in seen)
    assert tls_stats.fallbacks["max_fragment_length"] == before.get("max_fragment_length", 0) + 2
    assert {k: v for k, v in tls_stats.fallbacks.items() if k != "max_fragment_length"} == {
        k: v for k, v in before.items() if k != "max_fragment_length"
    }


@needs_tlslite
def test_tlslite_ng_record_size_limit_is_not_agreed_and_lean_carries_full_records(
    live: LiveServer, observer: Observer
) -> None:
    """OpenSSL implements no RFC 8449 record_size_limit, so it never acknowledges one (docs/security.md):
    the lean layer takes the connection over and may send 16 KB records, which the client must accept."""
    before, mark = dict(tls_stats.fallbacks), observer.mark()
    with closing(TlsliteClient(live.port, record_size_limit=64)) as client:
        pub_sub(client, "/interop/record-size-limit/1", [BIG])
        assert max(record_lengths(bytes(client.raw.received))) > (1 << 14)  # full-size records, unrefused
    (seen,) = connections(observer, mark)
    assert seen.lean and unchanged(before)


# --- HelloRetryRequest -------------------------------------------------------------------------------


def server_hellos(msgfile: Path) -> list[bytes]:
    """The ServerHello messages (HelloRetryRequests included) in s_client's ``-msg`` log."""
    hellos: list[bytes] = []
    current: list[str] | None = None
    for line in msgfile.read_text().splitlines():
        if line.startswith(("<<< ", ">>> ")):
            if current is not None:
                hellos.append(bytes.fromhex("".join(current)))
            current = [] if line.startswith("<<< ") and line.endswith(", ServerHello") else None
        elif current is not None:
            current.append(line.strip())
    if current is not None:
        hellos.append(bytes.fromhex("".join(current)))
    return hellos


@needs_tlslite
@pytest.mark.parametrize(
    ("groups", "key_shares"),
    [
        pytest.param(["brainpoolP256r1tls13", "x25519"], ["brainpoolP256r1tls13"], id="unsupported-key-share"),
        pytest.param(None, [], id="no-key-share"),
    ],
)
def test_tlslite_ng_hello_retry_request(
    live: LiveServer, observer: Observer, groups: list[str] | None, key_shares: list[str]
) -> None:
    before, mark = dict(tls_stats.fallbacks), observer.mark()
    with closing(TlsliteClient(live.port, groups=groups, key_shares=key_shares)) as client:
        assert client.hello_retry_request
        pub_sub(client, f"/interop/hrr/{len(key_shares)}", [b"after a HelloRetryRequest", BIG])
    (seen,) = connections(observer, mark)
    assert seen.lean and unchanged(before)


@needs_openssl
@needs_tlslite
def test_hello_retry_request_from_a_server_with_one_group(
    pki: dict[str, Path], observer: Observer, tmp_path: Path
) -> None:
    """A server whose only group is P-384 (as an openssl.cnf ``Groups`` line could make it): both clients'
    first key share (X25519 for s_client, P-256 and X25519 for tlslite-ng) gets a HelloRetryRequest."""
    server = LiveServer(tmp_path / "p384", pki, context_hook=lambda context: context.set_ecdh_curve("secp384r1"))
    server.start()
    try:
        before, mark = dict(tls_stats.fallbacks), observer.mark()
        msgfile = tmp_path / "msg.log"
        with closing(SClient(server.port, pki["ca"], msgfile=msgfile)) as client:
            assert "Server Temp Key: ECDH, secp384r1" in client.stderr
            pub_sub(client, "/interop/hrr/s_client", [b"after a HelloRetryRequest", BIG])
        hellos = server_hellos(msgfile)
        assert len(hellos) == 2 and hellos[0][6:38] == HRR_RANDOM and hellos[1][6:38] != HRR_RANDOM
        with closing(TlsliteClient(server.port)) as tlslite:
            assert tlslite.hello_retry_request
            pub_sub(tlslite, "/interop/hrr/tlslite", [b"after a HelloRetryRequest", BIG])
        seen = connections(observer, mark, 2)
        assert all(s.lean for s in seen) and unchanged(before)
    finally:
        server.stop()


# --- session resumption ----------------------------------------------------------------------------


@needs_tlslite
def test_tlslite_ng_session_resumption(live: LiveServer, observer: Observer) -> None:
    before, mark = dict(tls_stats.fallbacks), observer.mark()
    with closing(TlsliteClient(live.port)) as first:
        pub_sub(first, "/interop/resume/tlslite", [b"first"])  # reading takes the server's tickets in
        session = first.session
    with closing(TlsliteClient(live.port, session=session)) as second:
        assert second.conn.resumed
        pub_sub(second, "/interop/resume/tlslite", [b"second", BIG])
    seen = connections(observer, mark, 2)
    assert [s.reused for s in seen] == [False, True] and all(s.lean for s in seen) and unchanged(before)


@needs_openssl
def test_s_client_session_resumption(
    live: LiveServer, observer: Observer, pki: dict[str, Path], tmp_path: Path
) -> None:
    before, mark = dict(tls_stats.fallbacks), observer.mark()
    saved = tmp_path / "session.pem"
    with closing(SClient(live.port, pki["ca"], "-sess_out", str(saved))) as first:
        pub_sub(first, "/interop/resume/s_client", [b"first"])
    assert saved.exists()
    with closing(SClient(live.port, pki["ca"], "-sess_in", str(saved), commands=True)) as second:
        session = pub_sub(second, "/interop/resume/s_client", [b"second", b"r" * 3900])
        second.key_update(requested=True)  # and a KeyUpdate on the resumed connection
        session.round_trip("/interop/resume/s_client", b"third")
    seen = connections(observer, mark, 2)
    assert [s.reused for s in seen] == [False, True] and all(s.lean for s in seen) and unchanged(before)
    assert (seen[1].client_key_updates, seen[1].server_key_updates) == (1, 1)
