"""Entry point of the ``migratory`` command; each command group lives in its own module."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version

import typer

from migratory_cli import (
    bench_cmd,
    cert_cmd,
    client_cmds,
    cluster_cmd,
    config_cmds,
    drain_cmd,
    logs_cmd,
    publish_file_cmd,
    serve_cmd,
    status_cmd,
)

app = typer.Typer(
    name="migratory",
    help="MigratoryData-class real-time publish/subscribe server: run it, check its "
    "configuration, publish, subscribe and fetch snapshots.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def version() -> str:
    """The installed migratorydata-py version (the package's, in /opt/migratorydata)."""
    try:
        return distribution_version("migratorydata-py")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"migratory {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """MigratoryData-class real-time publish/subscribe server."""


app.command("serve")(serve_cmd.serve)
app.command("status")(status_cmd.status)
app.command("drain")(drain_cmd.drain)
app.add_typer(config_cmds.app, name="config")
app.add_typer(bench_cmd.app, name="bench")
app.add_typer(cert_cmd.app, name="cert")
app.add_typer(logs_cmd.app, name="logs")
app.add_typer(cluster_cmd.app, name="cluster")
client_cmds.register(app)
publish_file_cmd.register(app)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
