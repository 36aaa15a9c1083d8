"""``migratory cert``: a private CA, server certificates, CSRs, and checks of what is configured."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from migratory.certs import CertError, create_ca, create_csr, describe, issue_server_cert, verify_pair
from migratory_cli.config_cmds import load_or_exit

app = typer.Typer(help="Certificates for ListenEncrypted (wss:// and https://).", no_args_is_help=True)
_out = Console(highlight=False, soft_wrap=True)
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(exc: CertError) -> typer.Exit:
    _err.print(f"error: {exc}", markup=False)
    return typer.Exit(1)


@app.command("create-ca")
def create_ca_cmd(
    out: Path = typer.Option(Path("."), "--out", help="Folder for ca.pem and ca.key."),
    name: str = typer.Option("migratory private CA", help="The CA's common name."),
    days: int = typer.Option(3650, help="Validity in days."),
    password: str = typer.Option("", help="Encrypt ca.key with this password."),
) -> None:
    """Create a private certificate authority."""
    cert, key = create_ca(out, name, days, password or None)
    _out.print(f"wrote {cert} and {key}", markup=False)


@app.command("issue")
def issue_cmd(
    names: list[str] = typer.Argument(None, help="DNS names and IP addresses the certificate is for."),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="Also add the addresses of this configuration's ListenEncrypted."
    ),
    ca_cert: Path = typer.Option(..., help="The CA certificate (ca.pem)."),
    ca_key: Path = typer.Option(..., help="The CA key (ca.key)."),
    ca_password: str = typer.Option("", help="Password of the CA key."),
    out: Path = typer.Option(Path("."), "--out", help="Folder for server.pem (with chain) and server.key."),
    days: int = typer.Option(825, help="Validity in days."),
) -> None:
    """Issue a server certificate with these subject alternative names."""
    names = list(names or [])
    if config is not None:
        names += [e.host for e in load_or_exit(config).listen_encrypted if e.host != "*" and e.host not in names]
    try:
        cert, key = issue_server_cert(ca_cert, ca_key, names, out, days=days, ca_password=ca_password or None)
    except CertError as exc:
        raise _fail(exc) from None
    _out.print(f"wrote {cert} and {key}: set TLSCertificate = {cert} and TLSKey = {key}", markup=False)


@app.command("csr")
def csr_cmd(
    names: list[str] = typer.Argument(..., help="DNS names and IP addresses to request."),
    out: Path = typer.Option(Path("."), "--out", help="Folder for server.csr and server.key."),
) -> None:
    """Create a key and a certificate signing request for a public CA."""
    try:
        csr, key = create_csr(names, out)
    except CertError as exc:
        raise _fail(exc) from None
    _out.print(f"wrote {csr} (send it to your CA) and {key}", markup=False)


@app.command("show")
def show_cmd(path: Path = typer.Argument(..., help="A PEM certificate.")) -> None:
    """Show a certificate's subject, issuer, names and expiry."""
    try:
        info = describe(path)
    except CertError as exc:
        raise _fail(exc) from None
    state = "EXPIRED" if info.expired else f"{info.days_left} days left"
    _out.print(
        f"subject: {info.subject}\nissuer:  {info.issuer}\nnames:   {', '.join(info.names) or '-'}", markup=False
    )
    _out.print(f"valid:   {info.not_before:%Y-%m-%d} to {info.not_after:%Y-%m-%d} ({state})", markup=False)
    if info.expired:
        raise typer.Exit(1)


@app.command("check")
def check_cmd(
    config: Path = typer.Option(
        Path("conf/migratorydata.conf"),
        "--config",
        "-c",
        help="The migratorydata.conf whose TLSCertificate, TLSKey and TLSKeyPassword are checked.",
    ),
) -> None:
    """Check that the configured TLSCertificate and TLSKey match and are valid now."""
    cfg = load_or_exit(config)
    if not cfg.tls_certificate or not cfg.tls_key:
        _err.print(f"{config}: TLSCertificate and TLSKey are not set", markup=False)
        raise typer.Exit(1)
    try:
        info = verify_pair(Path(cfg.tls_certificate), Path(cfg.tls_key), cfg.tls_key_password or None)
    except CertError as exc:
        raise _fail(exc) from None
    _out.print(f"OK: {info.subject}, names {', '.join(info.names) or '-'}, {info.days_left} days left", markup=False)
