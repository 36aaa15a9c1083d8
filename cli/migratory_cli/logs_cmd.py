"""``migratory logs analyze``: the PySpark log analytics (spark/migratory_spark) from the command line.

PySpark is an optional extra (``pip install 'migratorydata-py[spark]'``) so the
server's package stays small; it is imported only when this command runs.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

app = typer.Typer(help="Analyse the server's access and message logs with Spark.", no_args_is_help=True)

_STEPS_OUTSIDE_TABLES = 5  # reading, counting, summary, charts, html


def _time(value: str | None) -> datetime | None:
    if value is None:
        return None
    from migratory_spark.times import parse_time

    try:
        return parse_time(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _confs(pairs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{pair!r}: expected KEY=VALUE, e.g. spark.driver.memory=4g")
        out[key.strip()] = value.strip()
    return out


@app.command("analyze")
def analyze(
    logdirs: Annotated[
        list[str], typer.Argument(help="Log folders (LogFolder), one per server node; hdfs:// and s3a:// too")
    ],
    since: Annotated[
        str | None, typer.Option(help="First instant included, ISO 8601 (UTC unless an offset is given)")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="First instant excluded, ISO 8601 (UTC unless an offset is given)")
    ] = None,
    master: Annotated[
        str, typer.Option(help="Spark master: local[*] (embedded, default), spark://host:7077, yarn")
    ] = "local[*]",
    out: Annotated[
        str, typer.Option(help="Output folder: parquet/, summary.json, charts/, report.html")
    ] = "migratory-report",
    top: Annotated[int, typer.Option(min=1, help="Rows in the top-N tables")] = 20,
    storm_window: Annotated[int, typer.Option(min=2, help="Reconnect storm window, seconds")] = 60,
    storm_threshold: Annotated[
        int, typer.Option(min=2, help="Connects from one address within the window that make a storm")
    ] = 20,
    conf: Annotated[list[str] | None, typer.Option("--conf", help="Extra Spark setting KEY=VALUE (repeatable)")] = None,
    charts: Annotated[bool, typer.Option("--charts/--no-charts", help="Draw PNG charts and the HTML report")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON summary instead of tables")] = False,
) -> None:
    """Traffic, subjects, sessions, security audit and latency from the logs: tables, Parquet, charts, HTML."""
    console = Console(stderr=as_json)
    start, end = _time(since), _time(until)
    if start is not None and end is not None and start >= end:
        raise typer.BadParameter("--since must be before --until")
    settings = _confs(conf or [])
    for folder in logdirs:  # local folders are checked before a JVM is started for nothing
        local = folder.removeprefix("file://")
        if "://" not in local and not os.path.isdir(local):
            typer.echo(f"error: {folder}: not a directory", err=True)
            raise typer.Exit(2)
    try:
        from migratory_spark.console import render
        from migratory_spark.report import TABLES, Options, run
        from migratory_spark.session import build_session, input_bytes
    except ImportError as exc:
        console.print(
            rf"[red]error:[/] PySpark is not installed ({exc}); "
            r"install the extra: pip install 'migratorydata-py\[spark]'"
        )
        raise typer.Exit(2) from None
    options = Options(
        dirs=logdirs,
        out=out,
        since=start,
        until=end,
        top=top,
        storm_window=storm_window,
        storm_threshold=storm_threshold,
        charts=charts,
    )
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    )
    summary: dict[str, Any]
    with progress:
        task = progress.add_task("starting Spark", total=len(TABLES) + _STEPS_OUTSIDE_TABLES)
        try:
            spark = build_session(master, conf=settings, input_size=input_bytes(logdirs))
        except Exception as exc:  # no Java, bad master URL: the JVM gateway's own message says which
            typer.echo(f"error: cannot start Spark on {master}: {exc}", err=True)
            raise typer.Exit(2) from None

        def step(name: str) -> None:
            progress.update(task, description=name, advance=1)

        try:
            summary = run(spark, options, step)
        except FileNotFoundError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        finally:
            spark.stop()
        progress.update(task, description="done", completed=len(TABLES) + _STEPS_OUTSIDE_TABLES)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        render(summary, console, top=top)


@app.command("generate")
def generate_cmd(
    out: Annotated[str, typer.Argument(help="Folder to write node-0, node-1, ... log folders into")],
    size: Annotated[str, typer.Option(help="Total bytes of logs (K, M, G suffixes)")] = "50M",
    nodes: Annotated[int, typer.Option(min=1, help="Server nodes, one log folder each")] = 1,
    seed: Annotated[int, typer.Option(help="Random seed (same seed, same logs)")] = 7,
) -> None:
    """Write realistic synthetic logs in the server's schema, to try the report or measure it."""
    from migratory.config import parse_size

    try:
        size_bytes = parse_size(size)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    from migratory_spark.generate import generate

    made = generate(out, size_bytes, nodes=nodes, seed=seed)
    typer.echo(
        f"{made.bytes:,} bytes: {made.access_lines:,} access, {made.message_lines:,} message and "
        f"{made.corrupt_lines} corrupt lines from {made.first:%Y-%m-%dT%H:%M:%SZ} to {made.last:%Y-%m-%dT%H:%M:%SZ} "
        f"in {', '.join(made.folders)}"
    )
