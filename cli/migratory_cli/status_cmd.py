"""``migratory status URL``: the node's indicators and their windows, from its monitor."""

from __future__ import annotations

import base64
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
SHOWN_WINDOWS = ("1m", "5m", "15m", "1h", "1d", "1mo")

_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _number(value: float) -> str:
    if abs(value) >= 1e6:
        return f"{value / 1e6:.1f}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def table(document: dict[str, Any]) -> Table:
    out = Table(
        title=f"node: {document.get('workers', '?')} worker(s), up {document.get('uptime_s', 0)} s, "
        f"history {document.get('history_s', 0)} s",
        caption="window cells: max / avg (stddev in --json)",
    )
    out.add_column("indicator")
    out.add_column("now", justify="right")
    for window in SHOWN_WINDOWS:
        out.add_column(window, justify="right")
    for name, indicator in document.get("indicators", {}).items():
        windows = indicator.get("windows", {})
        cells = []
        for window in SHOWN_WINDOWS:
            w = windows.get(window, {})
            cells.append(f"{_number(w.get('max', 0))} / {_number(w.get('avg', 0))}" if w.get("samples") else "-")
        out.add_row(name, _number(indicator.get("current", 0)), *cells)
    return out


def fetch(url: str, user: str, password: str, ca: Path | None, path: str = "/stats") -> dict[str, Any]:
    """GET one JSON document of the monitor (``/stats``, ``/cluster``), with Basic auth and a CA when given."""
    target = url.rstrip("/")
    if not target.startswith(("http://", "https://")):
        raise ValueError(f"{url}: expected the monitor's http:// or https:// URL (MonitorHTTP.Listen)")
    request = urllib.request.Request(target + path)
    if user:
        request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    with urllib.request.urlopen(request, timeout=5, context=context) as answer:
        return dict(json.loads(answer.read()))


def show(
    get: Callable[[], dict[str, Any]], url: str, render: Callable[[dict[str, Any]], Table], as_json: bool, watch: bool
) -> None:
    """Print a monitor document once (table or JSON) or refresh it in place; failures are one line and an exit code."""

    def fetch_or_exit() -> dict[str, Any]:
        try:
            return get()
        except ValueError as exc:
            _err.print(f"error: {exc}", markup=False)
            raise typer.Exit(EXIT_USAGE) from None
        except urllib.error.HTTPError as exc:
            _err.print(f"error: {url}: HTTP {exc.code} {exc.reason}", markup=False)
            raise typer.Exit(EXIT_UNREACHABLE) from None
        except (urllib.error.URLError, OSError) as exc:
            _err.print(f"error: {url}: cannot reach the monitor: {getattr(exc, 'reason', exc)}", markup=False)
            raise typer.Exit(EXIT_UNREACHABLE) from None

    document = fetch_or_exit()
    if as_json and not watch:
        typer.echo(json.dumps(document, indent=2, sort_keys=True))
        return
    console = Console()
    if not watch:
        console.print(render(document))
        return
    with Live(render(document), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(1.0)
                document = fetch_or_exit()
                if as_json:
                    live.console.print_json(json.dumps(document))
                else:
                    live.update(render(document))
        except KeyboardInterrupt:
            pass


def status(
    url: str = typer.Argument(..., help="The monitor's URL (MonitorHTTP.Listen), e.g. http://127.0.0.1:9900"),
    as_json: bool = typer.Option(False, "--json", help="Print the /stats document as JSON."),
    watch: bool = typer.Option(False, "--watch", help="Refresh in place every second until interrupted."),
    user: str = typer.Option("", "--user", help="MonitorHTTP.Username, when the monitor requires it."),
    password: str = typer.Option("", "--password", help="MonitorHTTP.Password."),
    ca: Path | None = typer.Option(None, "--ca", help="CA certificate to verify an https:// monitor with."),
) -> None:
    """Show the node's seven indicators, now and over 1 minute ... 1 month (max / avg)."""
    show(lambda: fetch(url, user, password, ca), url, table, as_json, watch)
