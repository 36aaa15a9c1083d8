"""Certificates for the TLS listeners, with ``cryptography``: a private CA, server
certificates with subject alternative names, CSRs for a public CA, and checks.

Kept apart from the server so ``migratory cert`` and the tests use the same code.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CertError",
    "CertInfo",
    "create_ca",
    "create_csr",
    "describe",
    "issue_server_cert",
    "load_key",
    "verify_pair",
]


class CertError(Exception):
    """A certificate or key problem, worded for the operator."""


@dataclass(frozen=True)
class CertInfo:
    subject: str
    issuer: str
    not_before: datetime.datetime
    not_after: datetime.datetime
    names: tuple[str, ...]
    expired: bool
    days_left: int


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path, password: str | None) -> None:
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
    )
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    path.chmod(0o600)


def load_key(path: Path, password: str | None = None) -> ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey:
    """Load a PEM private key; a wrong or missing password is a clear :class:`CertError`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CertError(f"{path}: cannot read the key: {exc.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password.encode() if password else None)
    except TypeError:
        raise CertError(
            f"{path}: the key is encrypted: give its password"
            if not password
            else f"{path}: the key is not encrypted: give no password"
        ) from None
    except ValueError:
        raise CertError(f"{path}: wrong password, or not a PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise CertError(f"{path}: expected an EC or RSA private key")
    return key


def _load_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except OSError as exc:
        raise CertError(f"{path}: cannot read the certificate: {exc.strerror}") from None
    except ValueError:
        raise CertError(f"{path}: not a PEM certificate") from None


def create_ca(
    folder: Path, name: str = "migratory private CA", days: int = 3650, password: str | None = None
) -> tuple[Path, Path]:
    """A self-signed CA: ``ca.pem`` and ``ca.key`` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "ca.pem", folder / "ca.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path, password)
    return cert_path, key_path


def _alt_names(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def issue_server_cert(
    ca_cert: Path,
    ca_key: Path,
    names: Sequence[str],
    folder: Path,
    *,
    days: int = 825,
    ca_password: str | None = None,
    stem: str = "server",
    not_before: datetime.datetime | None = None,
) -> tuple[Path, Path]:
    """A server certificate for ``names`` (DNS names or IP addresses), signed by the CA.

    Writes ``<stem>.pem`` (the certificate followed by the CA: the chain to serve)
    and ``<stem>.key``.
    """
    if not names:
        raise CertError("give at least one name or address for the certificate")
    authority = _load_cert(ca_cert)
    authority_key = load_key(ca_key, ca_password)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or (_now() - datetime.timedelta(minutes=5))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0]))
        .issuer_name(authority.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(_alt_names(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(authority_key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / f"{stem}.pem", folder / f"{stem}.key"
    cert_path.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM) + authority.public_bytes(serialization.Encoding.PEM)
    )
    _write_key(key, key_path, None)
    return cert_path, key_path


def create_csr(names: Sequence[str], folder: Path, stem: str = "server") -> tuple[Path, Path]:
    """A key and a certificate signing request for a public CA."""
    if not names:
        raise CertError("give at least one name or address for the request")
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_name(names[0]))
        .add_extension(_alt_names(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    csr_path, key_path = folder / f"{stem}.csr", folder / f"{stem}.key"
    csr_path.write_bytes(csr.public_bytes(serialization.Encoding.PEM))
    _write_key(key, key_path, None)
    return csr_path, key_path


def describe(path: Path) -> CertInfo:
    """Subject, issuer, validity and names of the first certificate in ``path``."""
    cert = _load_cert(path)
    try:
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = tuple(str(v) for v in alt.get_values_for_type(x509.DNSName)) + tuple(
            str(v) for v in alt.get_values_for_type(x509.IPAddress)
        )
    except x509.ExtensionNotFound:
        names = ()
    now = _now()
    after = cert.not_valid_after_utc
    return CertInfo(
        cert.subject.rfc4514_string(),
        cert.issuer.rfc4514_string(),
        cert.not_valid_before_utc,
        after,
        names,
        after < now,
        (after - now).days,
    )


def verify_pair(cert_path: Path, key_path: Path, password: str | None = None) -> CertInfo:
    """Check that the key matches the certificate and that it is valid now."""
    info = describe(cert_path)
    key = load_key(key_path, password)
    cert = _load_cert(cert_path)
    if cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo):
        raise CertError(f"{key_path}: this key does not match the certificate {cert_path}")
    if info.expired:
        raise CertError(f"{cert_path}: expired on {info.not_after:%Y-%m-%d %H:%M} UTC")
    if info.not_before > _now():
        raise CertError(f"{cert_path}: not valid before {info.not_before:%Y-%m-%d %H:%M} UTC")
    return info
