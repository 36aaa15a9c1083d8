"""Which TLS suite a client gets: AES-128-GCM first when nobody chose the TLS 1.3 suites, TLSCiphers as before."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from migratory.config import Config
from migratory.server.transport.context import build_context
from migratory.server.transport.tls import libssl as tls_libssl
from migratory.server.transport.tls import prefer_aes128
from migratory.server.transport.tls.libssl import OPENSSL_TLS13_SUITES, PREFERRED_TLS13_SUITES, tls13_suites
from tests.test_tlstransport import client_context, pki

__all__ = ["pki"]  # the module-scoped certificate fixture, shared with test_tlstransport


def context_of(pki: dict[str, Path], extra: str = "") -> ssl.SSLContext:
    """The server context ``migratory serve`` builds from a configuration."""
    text = f"ListenEncrypted = 127.0.0.1:1\nTLSCertificate = {pki['cert']}\nTLSKey = {pki['key']}\n{extra}"
    return build_context(Config.from_text(text, "c.conf"))


def negotiate(server: ssl.SSLContext, client: ssl.SSLContext) -> tuple[str, str]:
    """Run a handshake over memory BIOs: (version, suite); raises ssl.SSLError when it fails."""
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    server_side = server.wrap_bio(s_in, s_out, server_side=True)
    client_side = client.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    done = [False, False]
    for _ in range(10):
        for i, (end, outgoing, other_in) in enumerate(((client_side, c_out, s_in), (server_side, s_out, c_in))):
            if not done[i]:
                try:
                    end.do_handshake()
                    done[i] = True
                except ssl.SSLWantReadError:
                    pass
                finally:
                    other_in.write(outgoing.read())
        if all(done):
            break
    cipher = client_side.cipher()
    version = client_side.version()
    assert all(done) and cipher is not None and version is not None
    return version, cipher[0]


def with_tls13_suites(context: ssl.SSLContext, suites: str) -> ssl.SSLContext:
    """``context`` offering ``suites`` for TLS 1.3 (what an openssl.cnf ``Ciphersuites`` line does)."""
    lib = tls_libssl._libssl()
    assert lib is not None
    pointer = tls_libssl.ssl_ctx_pointer(context, lib)
    assert pointer is not None and lib.SSL_CTX_set_ciphersuites(pointer, suites.encode("ascii")) == 1
    return context


def test_a_default_python_client_gets_aes_128(pki: dict[str, Path]) -> None:
    client = client_context(pki)
    assert tls13_suites(client)[0] == "TLS_AES_256_GCM_SHA384"  # what CPython clients ask for first
    server = context_of(pki)
    assert tls13_suites(server) == PREFERRED_TLS13_SUITES
    assert server.options & ssl.OP_CIPHER_SERVER_PREFERENCE and server.options & tls_libssl.OP_PRIORITIZE_CHACHA
    assert negotiate(server, client) == ("TLSv1.3", "TLS_AES_128_GCM_SHA256")
    assert prefer_aes128(server)  # idempotent


def test_every_suite_stays_offered_and_chacha_first_clients_keep_it(pki: dict[str, Path]) -> None:
    server = context_of(pki)
    only_256 = with_tls13_suites(client_context(pki), "TLS_AES_256_GCM_SHA384")
    assert negotiate(server, only_256)[1] == "TLS_AES_256_GCM_SHA384"
    # a client without AES instructions lists ChaCha20 first: it gets it (SSL_OP_PRIORITIZE_CHACHA)
    chacha_first = with_tls13_suites(client_context(pki), "TLS_CHACHA20_POLY1305_SHA256:TLS_AES_128_GCM_SHA256")
    assert negotiate(server, chacha_first)[1] == "TLS_CHACHA20_POLY1305_SHA256"


def test_tls_ciphers_still_restricts_tls12(pki: dict[str, Path]) -> None:
    server = context_of(pki, "TLSCiphers = ECDHE+CHACHA20\n")
    assert tls13_suites(server) == PREFERRED_TLS13_SUITES
    tls12 = client_context(pki, ssl.TLSVersion.TLSv1_2)
    assert negotiate(server, tls12) == ("TLSv1.2", "ECDHE-ECDSA-CHACHA20-POLY1305")
    aes_only = client_context(pki, ssl.TLSVersion.TLSv1_2)
    aes_only.set_ciphers("ECDHE+AESGCM")
    with pytest.raises(ssl.SSLError):
        negotiate(server, aes_only)
    # the server's order counts for TLS 1.2 (as CPython always had it): TLSCiphers lists AES-128 first here
    ordered = context_of(pki, "TLSCiphers = ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384\n")
    assert negotiate(ordered, client_context(pki, ssl.TLSVersion.TLSv1_2))[1] == "ECDHE-ECDSA-AES128-GCM-SHA256"


def test_tls_min_version_still_refuses_tls12(pki: dict[str, Path]) -> None:
    server = context_of(pki, "TLSMinVersion = TLSv1.3\n")
    assert negotiate(server, client_context(pki)) == ("TLSv1.3", "TLS_AES_128_GCM_SHA256")
    with pytest.raises(ssl.SSLError):
        negotiate(server, client_context(pki, ssl.TLSVersion.TLSv1_2))


def test_suites_chosen_for_openssl_are_left_alone(pki: dict[str, Path]) -> None:
    chosen = "TLS_CHACHA20_POLY1305_SHA256:TLS_AES_256_GCM_SHA384"
    server = with_tls13_suites(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), chosen)
    server.load_cert_chain(pki["cert"], pki["key"])
    assert not prefer_aes128(server)
    assert tls13_suites(server) == tuple(chosen.split(":"))
    assert not server.options & tls_libssl.OP_PRIORITIZE_CHACHA
    assert negotiate(server, client_context(pki))[1] == "TLS_CHACHA20_POLY1305_SHA256"  # the chosen order


def test_tls_lean_transport_false_leaves_openssls_order(pki: dict[str, Path]) -> None:
    server = context_of(pki, "TLSLeanTransport = false\n")
    assert tls13_suites(server) == OPENSSL_TLS13_SUITES
    assert not server.options & tls_libssl.OP_PRIORITIZE_CHACHA
    assert negotiate(server, client_context(pki))[1] == "TLS_AES_256_GCM_SHA384"
