"""TLS contexts for the encrypted listeners, and their reload on SIGHUP.

Reloading loads the new certificate and key into the *same* ``SSLContext``: new
handshakes present the new certificate, established connections are untouched.
A reload that fails (a missing file, a key that does not match) leaves the old
certificate in service and says why.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from migratory.certs import CertError, verify_pair
from migratory.config import Config

__all__ = ["build_context", "reload_context"]


def build_context(config: Config) -> ssl.SSLContext:
    """A server context from TLSCertificate/TLSKey/TLSMinVersion/TLSCiphers; raises CertError.

    With ``TLSLeanTransport`` (the default), OpenSSL's own TLS 1.3 suites are served with
    ``TLS_AES_128_GCM_SHA256`` first (:func:`migratory.server.transport.tls.prefer_aes128`);
    ``TLSCiphers`` (TLS 1.2) and ``TLSMinVersion`` are untouched by it.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3 if config.tls_min_version == "TLSv1.3" else ssl.TLSVersion.TLSv1_2
    try:
        context.set_ciphers(config.tls_ciphers)
    except ssl.SSLError:
        raise CertError(f"TLSCiphers: OpenSSL accepts none of {config.tls_ciphers!r}") from None
    context.options |= ssl.OP_NO_COMPRESSION
    context.set_alpn_protocols(["http/1.1"])
    if config.tls_lean_transport:
        # the lean record layer seals every record in Python: the cheaper AES-128 first (bench/tls.md)
        from migratory.server.transport.tls import prefer_aes128

        prefer_aes128(context)
    reload_context(context, config)
    return context


def reload_context(context: ssl.SSLContext, config: Config) -> str:
    """Load the configured certificate chain and key into ``context``; returns a summary."""
    cert, key = Path(config.tls_certificate), Path(config.tls_key)
    info = verify_pair(cert, key, config.tls_key_password or None)
    try:
        context.load_cert_chain(cert, key, password=config.tls_key_password or None)
    except (ssl.SSLError, OSError) as exc:
        raise CertError(f"{cert}: cannot be served: {exc}") from None
    return f"{info.subject}, valid until {info.not_after:%Y-%m-%d} ({info.days_left} days)"
