"""``migratory config ...``: check a configuration file without starting the server."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from migratory import reload
from migratory.config import Config, ConfigError
from migratory.preflight import check_file

app = typer.Typer(help="Configuration file commands.", no_args_is_help=True)

EXIT_CONFIG = 2


def load_or_exit(path: Path) -> Config:
    """Load ``path``; on errors print each as ``file:line: Key: what`` and exit 2."""
    try:
        return Config.from_file(path)
    except ConfigError as exc:
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        for line in exc.errors:
            # a file that cannot be read has no line to point at: say line 1, never 0
            err.print(line.replace(f"{path}:0: ", f"{path}:1: ", 1), markup=False)
        raise typer.Exit(EXIT_CONFIG) from None


def _listeners(config: Config) -> str:
    monitor_tls = getattr(config, "monitor_listen_encrypted", ())
    groups = [
        ("ws/http", config.listen),
        ("wss/https", config.listen_encrypted),
        ("mqtt", config.listen_mqtt),
        ("mqtts", config.listen_mqtt_encrypted),
        ("monitor", config.monitor_listen),
        ("monitor https", monitor_tls),
        ("cluster", (config.cluster_member_listen,) if config.cluster_member_listen else ()),
    ]
    return "; ".join(f"{kind} {', '.join(str(e) for e in endpoints)}" for kind, endpoints in groups if endpoints)


@app.command("check")
def check(
    path: Path = typer.Argument(
        ..., metavar="FILE", help="The migratorydata.conf to check, e.g. /etc/migratorydata/migratorydata.conf."
    ),
    diff: Path | None = typer.Option(
        None,
        "--diff",
        metavar="OLD",
        help="Also list what changed from OLD to FILE, each key as 'reload' (SIGHUP applies it) or 'restart'.",
    ),
) -> None:
    """Check FILE as `migratory serve` checks it at start, without starting anything.

    Every problem at once, each as file:line: Key: what. Exit codes: 0 serve would start, 2 it would refuse.

    Checked: values, key rules, TLS certificate and key, RunAsUser, log and state folders, listeners, entitlement.

    Warned about (exit 0): anyone may publish, monitoring open to all, a certificate near expiry, a port in use now.

    With --diff OLD: each key that differs between OLD and FILE, and whether `systemctl reload` (SIGHUP) applies
    it to the running node or it needs a restart (the node keeps the old value until then).
    """
    old = load_or_exit(diff) if diff is not None else None
    report = check_file(path, in_use="warning")
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in report.errors + report.warnings:
        err.print(line, markup=False)
    if not report.ok or report.config is None:
        raise typer.Exit(EXIT_CONFIG)
    warnings = f", {len(report.warnings)} warning(s)" if report.warnings else ""
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"{path}: OK (listeners: {_listeners(report.config)}{warnings})", markup=False)
    if old is not None:
        changes = reload.diff(old, report.config)
        for change in changes:  # values are not printed: tokens, secrets and passwords are among them
            kind = "reload: SIGHUP applies it" if change.live else "restart: the running node keeps the old value"
            out.print(f"{change.key}: {kind}", markup=False)
        if not changes:
            out.print(f"no key differs from {diff}", markup=False)
