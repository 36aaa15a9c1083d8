"""Entry point of the ``migratory`` command; each command group lives in its own module."""

from __future__ import annotations

import typer

from migratory_cli import bench_cmd, cert_cmd, client_cmds, cluster_cmd, config_cmds, logs_cmd, serve_cmd, status_cmd

app = typer.Typer(
    name="migratory",
    help="MigratoryData-class real-time publish/subscribe server: run it, check its "
    "configuration, publish, subscribe and fetch snapshots.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command("serve")(serve_cmd.serve)
app.command("status")(status_cmd.status)
app.add_typer(config_cmds.app, name="config")
app.add_typer(bench_cmd.app, name="bench")
app.add_typer(cert_cmd.app, name="cert")
app.add_typer(logs_cmd.app, name="logs")
app.add_typer(cluster_cmd.app, name="cluster")
client_cmds.register(app)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
