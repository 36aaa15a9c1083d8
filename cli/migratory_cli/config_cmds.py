"""``migratory config ...``: check a configuration file without starting the server."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from migratory.config import Config, ConfigError

app = typer.Typer(help="Configuration file commands.", no_args_is_help=True)

EXIT_CONFIG = 2


def load_or_exit(path: Path) -> Config:
    """Load ``path``; on errors print each as ``file:line: Key: what`` and exit 2."""
    try:
        return Config.from_file(path)
    except ConfigError as exc:
        err = Console(stderr=True, highlight=False, soft_wrap=True)
        for line in exc.errors:
            err.print(line, markup=False)
        raise typer.Exit(EXIT_CONFIG) from None


@app.command("check")
def check(path: Path = typer.Argument(..., help="The migratorydata.conf to check.")) -> None:
    """Validate FILE exactly as the server would; exit 2 with file:line errors if it is wrong."""
    config = load_or_exit(path)
    Console(highlight=False).print(
        f"{path}: OK ({len(config.listen)} listener(s): {', '.join(str(e) for e in config.listen)})"
    )
