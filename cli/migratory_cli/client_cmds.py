"""``migratory publish|subscribe|snapshot``: client commands (filled in with the client library)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach the client commands to ``app``."""
