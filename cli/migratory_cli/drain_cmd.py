"""``migratory drain URL``: stop a server of this machine as a lame duck (docs/operations.md, "Draining").

It finds the server's supervisor from the ``pid`` of the worker that answers ``/health``, sends it SIGTERM
(what ``systemctl stop`` does), and follows the drain until the server is gone.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NOT_HERE = 4
EXIT_STILL_RUNNING = 5

_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _health(url: str) -> dict[str, Any]:
    """The /health document (a 503 while draining or synchronising carries one too)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        return dict(json.loads(exc.read()))


def _supervisor(worker: int) -> int:
    """The ``migratory serve`` process of a worker: its parent (a forked worker is named migratory-wN), or the
    worker itself (a server of one worker serves in its own process); 0 if it is no such process here."""
    try:
        stat = Path(f"/proc/{worker}/stat").read_text()
        name, rest = stat.split("(", 1)[1].rsplit(")", 1)
        pid = int(rest.split()[1]) if name.startswith("migratory-w") else worker
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return 0
    return pid if b"serve" in command else 0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def drain(
    url: str = typer.Argument(..., help="A URL answering /health: the server's (Listen) or its monitor's."),
    timeout: float = typer.Option(60.0, help="Seconds to wait for the server to stop."),
) -> None:
    """Drain a server of this machine and stop it: no new clients, /health 503, its clients sent elsewhere."""
    if not url.startswith(("http://", "https://")):
        _err.print(f"error: {url}: expected an http:// or https:// URL", markup=False)
        raise typer.Exit(EXIT_USAGE)
    try:
        worker = int(_health(url).get("pid", 0))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        _err.print(f"error: {url}: cannot reach the server: {getattr(exc, 'reason', exc)}", markup=False)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    supervisor = _supervisor(worker) if worker else 0
    if not supervisor:
        _err.print(f"error: {url}: the server is not on this machine (worker pid {worker or '?'})", markup=False)
        raise typer.Exit(EXIT_NOT_HERE)
    try:
        os.kill(supervisor, signal.SIGTERM)
    except PermissionError:
        _err.print(f"error: not allowed to signal the server (pid {supervisor}): run as its user or root")
        raise typer.Exit(EXIT_NOT_HERE) from None
    started = time.monotonic()
    typer.echo(f"draining the server (pid {supervisor})")
    while _alive(supervisor):
        if time.monotonic() - started > timeout:
            _err.print(f"error: the server (pid {supervisor}) is still running after {timeout:.0f} s", markup=False)
            raise typer.Exit(EXIT_STILL_RUNNING)
        time.sleep(0.2)
    typer.echo(f"drained and stopped in {time.monotonic() - started:.1f} s")
