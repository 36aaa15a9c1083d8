"""``migratory serve``: run the server in the foreground until SIGTERM or SIGINT."""

from __future__ import annotations

from pathlib import Path

import typer

from migratory_cli.config_cmds import load_or_exit


def serve(
    config: Path = typer.Option(
        Path("conf/migratorydata.conf"),
        "--config",
        "-c",
        help="The migratorydata.conf to run with.",
    ),
) -> None:
    """Run the server with the configuration file given by --config/-c, in the foreground.

    It first checks the file and the machine as `migratory config check FILE` does: exit 2 with every problem.

    SIGTERM or SIGINT shut it down cleanly; SIGHUP reloads the TLS certificate.
    """
    from migratory.server.process.app import run

    cfg = load_or_exit(config)
    raise typer.Exit(run(cfg, config_path=str(config)))
