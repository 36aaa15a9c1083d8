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
    """Run the server on CONFIG in the foreground; SIGTERM or SIGINT shut it down cleanly."""
    from migratory.server.app import run

    cfg = load_or_exit(config)
    raise typer.Exit(run(cfg, config_path=str(config)))
