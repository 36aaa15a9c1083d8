"""``migratory bench``: the benchmark kit from the shell (run one workload, or compare peers)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from migratory.bench import presets
from migratory.bench.runner import BenchConfig, Report, run
from migratory.bench.wire import TARGETS, TLS_TARGETS

app = typer.Typer(
    help="Benchmark kit: N clients, M subjects each, messages of size S at frequency F.", no_args_is_help=True
)

_console = Console(highlight=False)

_PHASES = ("connected", "publishing", "drained", "closed")  # the report's timeline, as hh:mm:ss.mmm


def _pauses(table: dict[str, dict[str, Any]]) -> str:
    """The report's pauses, one phase after another: ``publishing: member 0 worker starved 6 (0.9 s); ...``."""
    return "; ".join(
        f"{phase}: " + ", ".join(f"{who} {e['count']} ({e['longest_s']:.1f} s)" for who, e in sorted(row.items()))
        for phase, row in table.items()
    )


_ROWS: list[tuple[str, Callable[[Report], str]]] = [
    ("connections established", lambda r: f"{r.connected:,} / {r.clients:,}"),
    ("connect rate (conn/s)", lambda r: f"{r.connect_rate:,.0f}"),
    ("upgrades refused 503 and retried", lambda r: f"{r.connect_refused_retried:,}"),
    (
        "server CPU connecting (s), per connection (us)",
        lambda r: f"{r.server_cpu_seconds_connecting:.2f}, {r.server_cpu_us_per_connection:,.1f}",
    ),
    ("messages published", lambda r: f"{r.published:,}"),
    ("messages delivered", lambda r: f"{r.delivered:,} / {r.expected_deliveries:,}"),
    ("deliveries/s", lambda r: f"{r.deliveries_per_second:,.0f}"),
    (
        "latency p50 / p90 / p99 / p99.9 / max (ms)",
        lambda r: " / ".join(f"{r.latency_ms.get(k, 0):g}" for k in ("p50", "p90", "p99", "p99.9", "max")),
    ),
    ("latency mean (ms)", lambda r: f"{r.latency_ms.get('mean', 0):g}"),
    ("server CPU (s), of which system", lambda r: f"{r.server_cpu_seconds:.2f}, {r.server_cpu_system_seconds:.2f}"),
    ("server CPU per delivery (us)", lambda r: f"{r.server_cpu_us_per_delivery:.3f}"),
    (
        "load-generator CPU (s), per delivery (us)",
        lambda r: f"{r.loader_cpu_seconds:.2f}, {r.loader_cpu_us_per_delivery:.3f}",
    ),
    ("server RSS before / connected (MB)", lambda r: f"{r.server_rss_mb_before:.1f} / {r.server_rss_mb_connected:.1f}"),
    ("server memory per connection (B)", lambda r: f"{r.server_bytes_per_connection:,.0f}"),
    (
        "server PSS before / connected (MB), per connection (B)",
        lambda r: (
            f"{r.server_pss_mb_before:.1f} / {r.server_pss_mb_connected:.1f}, {r.server_pss_bytes_per_connection:,.0f}"
        ),
    ),
    (
        "server PSS after publishing (MB), per connection (B)",
        lambda r: f"{r.server_pss_mb_published:.1f}, {r.server_pss_bytes_per_connection_published:,.0f}",
    ),
    (
        "server processes, PSS each before clients (MB)",
        lambda r: f"{r.server_processes}, {r.server_pss_mb_per_process_before:.1f}",
    ),
    (
        "kernel TCP sockets in use / memory (MB), connected",
        lambda r: f"{r.sockstat_connected.get('inuse', 0):,} / {r.sockstat_connected.get('mem', 0) * 4096 / 2**20:.1f}",
    ),
    ("server RSS after disconnect (MB)", lambda r: f"{r.server_rss_mb_after_disconnect:.1f}"),
    ("load average at start (1/5/15 min)", lambda r: " / ".join(f"{v:.2f}" for v in r.load_average) or "-"),
    (
        "timeline (UTC): connected, publishing, drained, closed",
        lambda r: ", ".join(r.timeline[k][11:23] for k in _PHASES if k in r.timeline) or "-",
    ),
    ("failover: displaced clients, reconnect failures", lambda r: _failover(r, "displaced", "reconnect_failures")),
    ("failover: back p50 / p99 / max (ms)", lambda r: _failover_ms(r, "back_ms")),
    ("failover: recovered p50 / p99 / max (ms)", lambda r: _failover_ms(r, "recovered_ms")),
    (
        "failover: messages recovered, skipped, twice, resyncs",
        lambda r: _failover(r, "recovered", "gaps", "duplicates", "resyncs"),
    ),
    (
        "failover: survivors' PSS after the storm (MB), processes",
        lambda r: _failover(r, "survivor_pss_mb", "survivor_processes"),
    ),
    (
        "failover: latency p50 / p99 / max (ms) by phase",
        lambda r: (
            "; ".join(
                f"{phase} " + " / ".join(f"{h.get(k, 0):g}" for k in ("p50", "p99", "max"))
                for phase, h in r.failover.get("latency_ms_by_phase", {}).items()
            )
            or "-"
        ),
    ),
    ("errors", lambda r: escape("; ".join(r.errors)) or "none"),  # server text: never read as markup
    ("cluster members' warnings", lambda r: escape("; ".join(r.member_warnings)) or "none"),
    ("members' pauses by phase (count, longest s)", lambda r: escape(_pauses(r.pauses)) or "none"),
]


def _failover(report: Report, *keys: str) -> str:
    return ", ".join(f"{report.failover.get(k, 0):,}" for k in keys) if report.failover else "-"


def _failover_ms(report: Report, key: str) -> str:
    h = report.failover.get(key, {}) if report.failover else {}
    return " / ".join(f"{h.get(k, 0):g}" for k in ("p50", "p99", "max")) if h else "-"


def _table(reports: list[Report]) -> Table:
    table = Table(title="migratory bench")
    table.add_column("measure")
    for report in reports:
        table.add_column(report.target, justify="right")
    for name, render in _ROWS:
        table.add_row(name, *(render(r) for r in reports))
    return table


def _run_with_progress(config: BenchConfig) -> Report:
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=_console,
        transient=True,
    ) as progress:
        task = progress.add_task(f"{config.target}: connecting", total=None, info="")

        def notify(phase: str, values: dict[str, float]) -> None:
            if phase == "connect":
                progress.update(
                    task,
                    description=f"{config.target}: connecting",
                    total=values["clients"],
                    completed=values["connected"],
                    info=f"{values['connected']:,.0f} connected",
                )
            elif phase == "publish":
                progress.update(
                    task,
                    description=f"{config.target}: publishing",
                    total=values["messages"],
                    completed=values["published"],
                    info=f"{values['published']:,.0f} published",
                )
            elif phase == "drain":
                progress.update(
                    task,
                    description=f"{config.target}: delivering",
                    total=values["expected"],
                    completed=values["delivered"],
                    info=f"{values['delivered']:,.0f} delivered",
                )

        return run(config, notify)


def _sources(text: str) -> list[str]:
    """``127.0.0.2-127.0.0.9`` or a comma-separated list."""
    if "-" in text:
        first, last = text.split("-", 1)
        base, start = first.rsplit(".", 1)
        end = last.rsplit(".", 1)[1]
        return [f"{base}.{i}" for i in range(int(start), int(end) + 1)]
    return [s.strip() for s in text.split(",") if s.strip()]


def _config(**options: object) -> BenchConfig:
    sources = _sources(str(options.pop("sources")))
    config = BenchConfig(**options)  # type: ignore[arg-type]
    config.sources = sources
    if config.target not in TARGETS:
        raise typer.BadParameter(f"--target must be one of {', '.join(TARGETS)}")
    return config


_RUN_DEFAULTS: dict[str, object] = {
    "clients": 1000,
    "subjects": 1,
    "subjects_per_client": 1,
    "size": 64,
    "rate": 0.0,
    "messages": 100,
    "processes": 2,
    "sources": "127.0.0.1",
    "workers": 1,
    "loader_poll": 0.0,
}


@app.command("run")
def run_cmd(
    target: str = typer.Option("migratory", help=f"Server kind: {', '.join(TARGETS)}."),
    host: str = typer.Option("127.0.0.1", help="Server address."),
    port: int = typer.Option(8800, help="Server port (ignored with --spawn)."),
    preset: str | None = typer.Option(
        None,
        help="A named workload: seed-10m (1,000,000 clients, one subject of 10,000 each, a 512-byte message a "
        "minute each, held 10 minutes; with --clients N, the same shape for N); seed-10m-failover (the same "
        "over 2 Guaranteed members, one SIGKILLed and restarted under the load, every client's sequence "
        "checked). Other options override it.",
    ),
    clients: int | None = typer.Option(None, help="Concurrent client connections [default: 1000]."),
    subjects: int | None = typer.Option(None, help="Distinct subjects [default: 1]."),
    subjects_per_client: int | None = typer.Option(None, help="Subjects each client subscribes to [default: 1]."),
    size: int | None = typer.Option(None, help="Message size in bytes, at least 8: the send time [default: 64]."),
    rate: float | None = typer.Option(
        None, help="Messages per second in total; 0 = closed-loop bursts (saturation) [default: 0]."
    ),
    messages: int | None = typer.Option(
        None, help="Messages to publish; 0 = connect only: idle memory [default: 100]."
    ),
    hold: float | None = typer.Option(None, help="Seconds to publish at --rate (sets --messages to rate x hold)."),
    burst: int = typer.Option(50, help="Burst size in closed-loop mode."),
    kill_after: float | None = typer.Option(
        None, help="Failover: seconds into publishing to SIGKILL member 1 (its clients fail over) [preset's]."
    ),
    restart_after: float | None = typer.Option(
        None, help="Failover: seconds into publishing to restart member 1 (0: never) [preset's]."
    ),
    processes: int | None = typer.Option(None, help="Load-generator processes [default: 2]."),
    sources: str | None = typer.Option(None, help="Source addresses, e.g. 127.0.0.2-127.0.0.8 [default: 127.0.0.1]."),
    server_pid: int = typer.Option(0, help="PID of the server to measure (its children too)."),
    spawn: bool = typer.Option(False, help="Start the server (and its peers' servers) on a free port."),
    workers: int | None = typer.Option(None, help="Workers of a spawned migratory server [default: 1]."),
    members: int = typer.Option(
        1,
        min=1,
        help="With --spawn: a local cluster of this many members. The publisher is alone on the last member, "
        "the clients and --workers workers on each of the others: every delivery crosses a member link.",
    ),
    mode: str | None = typer.Option(
        None, help="With --members: the cluster's ClusterDeliveryMode [default: Standard; a failover preset's]."
    ),
    disconnect: bool = typer.Option(False, help="Connection storm: measure memory after everyone left."),
    idle: float = typer.Option(0.0, help="Seconds to leave the connections idle before measuring memory."),
    setting: list[str] = typer.Option(
        [], "--set", help="KEY=VALUE for the spawned migratory server's configuration (repeatable)."
    ),
    drain: float = typer.Option(60.0, help="Seconds to wait for the last deliveries after publishing."),
    loader_poll: float | None = typer.Option(
        None,
        min=0.0,
        help="Seconds between the load generators' reads once subscribed (0: wake on every message) "
        "[default: 0]. The latency includes the wait.",
    ),
    ca: Path | None = typer.Option(
        None, help="TLS targets without --spawn: the CA file the server's certificate is checked against."
    ),
    tls_client: str = typer.Option(
        "lean",
        help="TLS targets: the load generators' TLS client, lean (TLS 1.3 on a small record layer, a few hundred "
        "bytes a connection) or openssl (the event loop's TLS transport, about 25 KB a connection).",
    ),
    as_json: Path | None = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
    logs: Path | None = typer.Option(
        None, help="A spawned cluster (--members 2+): copy every member's logs into this folder after the run."
    ),
) -> None:
    """Run one workload and print the report (TLS targets: migratory-wss, nats-tls, mqtt-tls; MQTT
    targets: migratory-mqtt, mqtt, nats-mqtt)."""
    given = {
        "clients": clients,
        "subjects": subjects,
        "subjects_per_client": subjects_per_client,
        "size": size,
        "rate": rate,
        "messages": messages,
        "processes": processes,
        "sources": sources,
        "workers": workers,
        "loader_poll": loader_poll,
        "kill_after": kill_after,
        "restart_after": restart_after,
    }
    options = dict(_RUN_DEFAULTS)
    if preset is not None:
        try:
            options.update(presets.preset(preset, clients))
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--preset") from None
    members = max(members, int(str(options.pop("members", 1))))
    mode = mode or str(options.pop("mode", "Standard"))
    options.pop("mode", None)
    options.update({k: v for k, v in given.items() if v is not None})
    if hold is not None:
        options["messages"] = max(1, round(float(str(options["rate"])) * hold))
    config = _config(
        target=target,
        host=host,
        port=port,
        burst=burst,
        server_pid=server_pid,
        spawn=spawn,
        disconnect=disconnect,
        idle_seconds=idle,
        drain_timeout=drain,
        ca=str(ca) if ca is not None else "",
        tls_client=tls_client,
        **options,
    )
    config.size = max(8, config.size)
    if config.tls_client not in ("lean", "openssl"):
        raise typer.BadParameter("expected lean or openssl", param_hint="--tls-client")
    if config.target in TLS_TARGETS and config.tls_client == "lean":
        from migratory.bench.leantls import unavailable

        problem = unavailable()
        if problem:
            raise typer.BadParameter(problem, param_hint="--tls-client")
    for item in setting:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint="--set")
        config.settings[key.strip()] = value.strip()
    if logs is not None:
        if members < 2:
            raise typer.BadParameter("--logs keeps a spawned cluster's logs: use it with --members 2 or more")
        config.logs = str(logs)
    if config.target in TLS_TARGETS and not spawn and not config.ca:
        raise typer.BadParameter("--ca is needed for a TLS target that --spawn does not start")
    publishing = config.messages / config.rate if config.rate else 0.0
    if config.kill_after and not config.kill_after < publishing:
        raise typer.BadParameter(
            f"--kill-after {config.kill_after:g} s must come before publishing ends ({publishing:g} s)",
            param_hint="--kill-after",
        )
    if config.restart_after and not config.kill_after < config.restart_after < publishing:
        raise typer.BadParameter(
            f"--restart-after {config.restart_after:g} s must come after --kill-after and before publishing ends",
            param_hint="--restart-after",
        )
    if config.kill_after and members < 3:
        raise typer.BadParameter("a failover run needs --members 3 or more (and --spawn)", param_hint="--preset")
    if members > 1:
        if not spawn or config.target not in ("migratory", "migratory-wss"):
            raise typer.BadParameter(
                "a cluster is spawned for the migratory and migratory-wss targets only", param_hint="--members"
            )
        import tempfile

        from migratory.bench import clusterbench

        with tempfile.TemporaryDirectory(prefix="migratory-bench-cluster-") as folder:
            try:
                if config.kill_after:
                    report = clusterbench.failover_at_scale(Path(folder), config, members, mode)
                else:
                    report = clusterbench.on_cluster(Path(folder), config, members, mode, publisher_apart=True)
            except (RuntimeError, TimeoutError) as exc:  # a member that would not start or join: one line
                _console.print(f"the local cluster failed: {exc}", markup=False)
                raise typer.Exit(1) from None
    else:
        report = _run_with_progress(config)
    _console.print(_table([report]))
    if as_json is not None:
        as_json.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    if report.errors:
        raise typer.Exit(1)


@app.command("peers")
def peers_cmd(
    targets: str = typer.Option("migratory,nats,mqtt,ws-broadcast,websockets", help="Targets to compare, in order."),
    clients: int = typer.Option(1000, help="Concurrent client connections."),
    subjects: int = typer.Option(1, help="Distinct subjects."),
    size: int = typer.Option(64, help="Message size in bytes."),
    rate: float = typer.Option(0.0, help="Messages per second; 0 = closed-loop bursts."),
    messages: int = typer.Option(100, help="Messages to publish."),
    burst: int = typer.Option(50, help="Burst size in closed-loop mode."),
    processes: int = typer.Option(2, help="Load-generator processes."),
    sources: str = typer.Option("127.0.0.1", help="Source addresses, e.g. 127.0.0.2-127.0.0.8."),
    workers: int = typer.Option(1, help="Workers of the migratory server (every migratory-* target)."),
    idle: float = typer.Option(0.0, help="Seconds to leave the connections idle before measuring memory."),
    as_json: Path | None = typer.Option(None, "--json", help="Write every report as a JSON list."),
) -> None:
    """The same workload against each server, spawned in turn, side by side in one run.

    TLS: ``--targets migratory,migratory-wss,nats-tls,mqtt-tls`` (each TLS server gets a
    certificate from a test CA made for the run, which the load generators trust).

    MQTT: ``--targets migratory-mqtt,mqtt,nats-mqtt`` (this server's ListenMqtt, Mosquitto,
    nats-server's MQTT listener with JetStream), driven by the same MQTT 3.1.1 QoS 0 clients.
    """
    reports = []
    for target in [t.strip() for t in targets.split(",") if t.strip()]:
        config = _config(
            target=target,
            clients=clients,
            subjects=subjects,
            size=max(8, size),
            rate=rate,
            messages=messages,
            burst=burst,
            processes=processes,
            sources=sources,
            spawn=True,
            workers=workers,
            idle_seconds=idle,
        )
        reports.append(_run_with_progress(config))
    _console.print(_table(reports))
    if as_json is not None:
        as_json.write_text(json.dumps([r.as_dict() for r in reports], indent=2) + "\n")


@app.command("tls-storm")
def tls_storm_cmd(
    clients: int = typer.Option(20_000, min=1, help="Clients in each storm."),
    workers: int = typer.Option(2, min=1, help="Workers of the spawned wss:// server."),
    processes: int = typer.Option(2, min=1, help="Client processes."),
    concurrency: int = typer.Option(200, min=1, help="Handshakes in flight per client process."),
    sources: str = typer.Option(
        "", help="Source addresses, 127.0.2.1-127.0.2.8 or a comma list [default: two a client process from 127.0.2.1]."
    ),
    as_json: Path | None = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
) -> None:
    """Storms of connections: plain ws://, then full TLS 1.3 handshakes, then the same clients resuming
    with their session tickets: the server's CPU per connection for each, and how many resumed."""
    from migratory.bench.tlsstorm import storm

    report = storm(clients, workers, processes, concurrency, _sources(sources))
    table = Table(show_header=True)
    table.add_column("storm")
    for name in ("connected", "resumed", "wall (s)", "server CPU (s)", "server CPU a connection (us)"):
        table.add_column(name, justify="right")
    for label, wave in (("plain ws://", "plain"), ("full handshakes", "full"), ("with tickets", "resumed")):
        table.add_row(
            label,
            f"{getattr(report, f'{wave}_connected'):,}",
            f"{report.resumed_reused:,}" if wave == "resumed" else "-",
            f"{getattr(report, f'{wave}_seconds'):.2f}",
            f"{getattr(report, f'{wave}_server_cpu_seconds'):.2f}",
            f"{getattr(report, f'{wave}_server_cpu_us_per_connection'):,.1f}",
        )
    _console.print(table)
    _console.print(
        f"cipher {report.cipher}; the handshake's server CPU a connection (over plain): full "
        f"{report.handshake_us_full:,.1f} us, resumed {report.handshake_us_resumed:,.1f} us "
        f"(resumed / full {report.saved_ratio:.3f})",
        markup=False,
    )
    for error in report.errors:
        _console.print(f"error: {error}", markup=False)
    if as_json is not None:
        as_json.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    if report.errors:
        raise typer.Exit(1)


@app.command("logs")
def logs_cmd(
    size: str = typer.Option("1G", help="Bytes of logs to generate (K, M, G suffixes)."),
    nodes: int = typer.Option(2, min=1, help="Server nodes (one log folder each)."),
    master: str = typer.Option("local[*]", help="Spark master."),
    driver_memory: str = typer.Option("4g", help="spark.driver.memory (local mode runs in the driver)."),
    workdir: Path = typer.Option(Path("bench/work-logs"), help="Scratch folder for the logs and the report."),
    keep: bool = typer.Option(False, help="Keep the generated logs."),
    duckdb: bool = typer.Option(
        True, "--duckdb/--no-duckdb", help="Also time DuckDB computing the traffic and subject tables."
    ),
    as_json: Path | None = typer.Option(None, "--json", help="Also write the measurements as JSON to this file."),
    against: str | None = typer.Option(
        None,
        "--against",
        help="Also run this earlier commit's report and this one's in turn on the same logs (needs a git checkout).",
    ),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Pairs of runs with --against."),
) -> None:
    """Log analytics: generate SIZE of realistic logs, run the whole Spark report (and DuckDB), print the times."""
    from migratory.config import parse_size

    try:
        size_bytes = parse_size(size)
        from migratory_spark.against import AgainstError, resolve_commit
        from migratory_spark.bench import run_bench
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    except ImportError as exc:
        typer.echo(f"error: PySpark is not installed ({exc}); pip install 'migratorydata-py[spark]'", err=True)
        raise typer.Exit(2) from None
    if against is not None:
        try:
            resolve_commit(against)  # before minutes of generating and analysing
        except AgainstError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    with Progress(TextColumn("[bold]{task.description}"), TimeElapsedColumn(), console=_console) as progress:
        task = progress.add_task("starting", total=None)
        try:
            result = run_bench(
                size_bytes,
                str(workdir),
                nodes=nodes,
                master=master,
                driver_memory=driver_memory,
                keep=keep,
                step=lambda name: progress.update(task, description=name),
                duckdb=duckdb,
                against=against,
                rounds=rounds,
            )
        except AgainstError as exc:
            progress.stop()
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
    table = Table(title="migratory bench logs")
    table.add_column("measure")
    table.add_column("value", justify="right")
    data = result["input"]
    table.add_row("input", f"{data['bytes'] / 1e6:,.0f} MB, {nodes} nodes")
    table.add_row("lines", f"{data['access_lines'] + data['message_lines'] + data['corrupt_lines']:,}")
    table.add_row("generate (s)", f"{result['generate_seconds']:,.1f}")
    table.add_row("start Spark (s)", f"{result['spark_start_seconds']:,.1f}")
    table.add_row("analyze, whole report (s)", f"{result['analyze_seconds']:,.1f}")
    table.add_row("start + analyze (s)", f"{result['total_seconds']:,.1f}")
    table.add_row("rows/s", f"{result['rows_per_second']:,}")
    table.add_row("MB/s", f"{result['megabytes_per_second']:,.2f}")
    if "duckdb" in result:
        table.add_row("DuckDB traffic + subject tables (s)", f"{result['duckdb']['seconds']:,.1f}")
    load = result["machine"].get("load_average_before")
    if load:
        table.add_row("load average before (1/5/15 min)", " / ".join(f"{v:.2f}" for v in load))
    if "against" in result:
        side = result["against"]
        for index, pair in enumerate(side["rounds"], 1):
            table.add_row(
                f"round {index}: {side['commit'][:9]} / this tree, start + analyze (s)",
                f"{pair['baseline']['total']:,.1f} / {pair['current']['total']:,.1f} = {pair['ratio_total']:.2f}",
            )
        table.add_row(
            "ratio, start + analyze (median, max)",
            f"{side['ratio_total']['median']:.2f}, {side['ratio_total']['max']:.2f}",
        )
        table.add_row(
            "ratio, analyze (median, max)", f"{side['ratio_analyze']['median']:.2f}, {side['ratio_analyze']['max']:.2f}"
        )
    _console.print(table)
    if as_json is not None:
        as_json.parent.mkdir(parents=True, exist_ok=True)
        as_json.write_text(json.dumps(result, indent=2) + "\n")


@app.command("failover")
def failover_cmd(
    rounds: int = typer.Option(1, "--rounds", min=1, help="Rounds per fault."),
    first: int = typer.Option(
        1, "--first-round", min=1, help="Number (and seed) of the first round: runs split over processes."
    ),
    fault: list[str] = typer.Option(
        [], "--fault", help="Faults to inject (repeatable; default: all but the partitions without root)."
    ),
    size: int = typer.Option(3, "--members", min=3, help="Cluster members."),
    mode: list[str] = typer.Option(
        ["Guaranteed"], "--mode", help="ClusterDeliveryMode: Guaranteed or Standard (repeatable: both in turn)."
    ),
    folder: Path = typer.Option(Path("bench/failover-runs"), "--folder", help="Where the rounds' members keep files."),
    json_out: Path | None = typer.Option(None, "--json", help="Write every round and the summary here."),
    keep_going: bool = typer.Option(False, "--keep-going", help="Run every round even after one failed."),
    defaults: bool = typer.Option(
        False,
        "--defaults",
        help="The default member configuration (heartbeat 500/3000 ms, Workers = 2) instead of the fast 200/1000 ms.",
    ),
    prefill: str = typer.Option(
        "0x0", "--prefill", help="SUBJECTSxMESSAGES published before each round (e.g. 200x60: every cache over 4 KB)."
    ),
) -> None:
    """Fault-injection rounds against a local cluster; exit 1 if any history breaks a rule."""
    import asyncio
    import shutil

    from migratory.bench import failover as fo
    from migratory.bench.netns import available

    faults = fault or [f for f in fo.FAULTS if f not in fo.PARTITIONS or available()]
    unknown = [f for f in faults if f not in fo.FAULTS]
    if unknown:
        _console.print(f"unknown fault(s) {', '.join(unknown)}; choose from {', '.join(fo.FAULTS)}", markup=False)
        raise typer.Exit(2)
    modes = [m.capitalize() for m in mode]
    if any(m not in ("Guaranteed", "Standard") for m in modes):
        _console.print(f"--mode: Guaranteed or Standard, not {', '.join(mode)}", markup=False)
        raise typer.Exit(2)
    try:
        fill_subjects, fill_messages = (int(part) for part in prefill.lower().split("x"))
    except ValueError:
        _console.print(f"--prefill: SUBJECTSxMESSAGES, for example 200x60, not {prefill!r}", markup=False)
        raise typer.Exit(2) from None
    settings: dict[str, Any] = dict(fo.DEFAULTS) if defaults else {}
    if set(faults) & set(fo.PARTITIONS) and not available():
        _console.print("the partitions need root, iproute2 and nftables", markup=False)
        raise typer.Exit(2)
    results: list[fo.RoundResult] = []
    failed = False
    kinds = [(m, name) for m in modes for name in faults if m == "Guaranteed" or name not in fo.GUARANTEED_ONLY]
    for n in range(first - 1, first - 1 + rounds):
        for round_mode, name in kinds:
            place = folder / f"round-{n + 1}-{round_mode}-{name}"
            shutil.rmtree(place, ignore_errors=True)
            try:
                result = asyncio.run(
                    fo.run_round(
                        place,
                        name,
                        size=size,
                        mode=round_mode,
                        seed=n,
                        prefill=(fill_subjects, fill_messages),
                        **settings,
                    )
                )
            except Exception as exc:  # a round that could not even run is a failed round, with the reason
                result = fo.RoundResult(
                    name, round_mode, size, [f"the round could not run: {type(exc).__name__}: {exc}"]
                )
                result.history = str(place)
            results.append(result)
            if json_out is not None:  # after every round: a long run stopped early keeps what it found
                _write_failover_json(json_out, fo, results)
            mark = "[green]ok[/]" if result.ok else "[red]VIOLATION[/]"
            _console.print(
                f"round {n + 1} {round_mode:10} {name:20} {mark} acked {result.acked:5} unacked {result.unacked:3} "
                f"gap max {max(result.gaps, default=0):.3f} s ack gap max {max(result.ack_gaps, default=0):.3f} s "
                f"victim's clients {max(result.victim_gaps, default=0):.3f} s "
                f"recovered {sum(result.recovered):4} mqtt {result.mqtt_received}/{result.mqtt_reconnections} "
                f"({result.seconds:.1f} s)"
            )
            if not result.ok:
                failed = True
                for violation in result.violations[:10]:
                    _console.print(f"  {violation}", markup=False)
                _console.print(f"  history and member logs kept in {result.history or place}", markup=False)
                if not keep_going:
                    break
            else:
                shutil.rmtree(place, ignore_errors=True)
        if failed and not keep_going:
            break
    summary = fo.summary(results)
    by_fault = fo.summary_by_fault(results)
    for kind, figures in by_fault.items():
        _console.print(f"{kind}: {figures}", markup=False)
    _console.print(summary)
    if json_out is not None:
        _write_failover_json(json_out, fo, results)
    raise typer.Exit(1 if failed else 0)


def _write_failover_json(path: Path, fo: Any, results: list[Any]) -> None:
    """Every round so far and their summaries, replaced whole (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "summary": fo.summary(results),
        "by_fault": fo.summary_by_fault(results),
        "rounds": [r.as_dict() for r in results],
    }
    partial = path.with_suffix(path.suffix + ".part")
    partial.write_text(json.dumps(document, indent=1))
    partial.replace(path)


@app.command("cluster")
def cluster_cmd(
    members: list[int] = typer.Option([1, 3], "--members", help="Cluster sizes to compare (1: a single server)."),
    mode: str = typer.Option("Standard", "--mode", help="ClusterDeliveryMode: Standard or Guaranteed."),
    compare_modes: bool = typer.Option(False, "--compare-modes", help="Also run the largest size in the other mode."),
    workers: int = typer.Option(1, "--workers", help="Workers per member."),
    clients: int = typer.Option(1000, "--clients", help="Subscribers in the fan-out workload."),
    subjects: int = typer.Option(10, "--subjects", help="Subjects (each client subscribes to one)."),
    size: int = typer.Option(64, "--size", help="Message size in bytes."),
    rate: float = typer.Option(0.0, "--rate", help="Messages per second (0: saturation, closed loop)."),
    messages: int = typer.Option(2000, "--messages", help="Messages published."),
    failover_clients: int = typer.Option(
        1000, "--failover-clients", help="Clients for the SIGKILL failover (0: skip)."
    ),
    folder: Path = typer.Option(Path("bench/cluster-runs"), "--folder", help="Where the members keep their files."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the reports here."),
) -> None:
    """The same fan-out on 1 server and on N members in one run, then client failover time after SIGKILL."""
    import shutil

    from migratory.bench import clusterbench

    reports: list[Report] = []
    runs = [(n, mode) for n in members]
    if compare_modes:
        other = "Guaranteed" if mode == "Standard" else "Standard"
        runs.append((max(members), other))
    for n, run_mode in runs:
        place = folder / f"fanout-{n}-{run_mode}"
        shutil.rmtree(place, ignore_errors=True)
        report = clusterbench.fanout(
            place,
            n,
            mode=run_mode,
            workers=workers,
            clients=clients,
            subjects=subjects,
            size=size,
            rate=rate,
            messages=messages,
        )
        reports.append(report)
        shutil.rmtree(place, ignore_errors=True)
    _console.print(_table(reports))
    document: dict[str, object] = {"fanout": [r.as_dict() for r in reports]}
    latencies = []
    for run_mode in sorted({m for _, m in runs}):
        place = folder / f"latency-{run_mode}"
        shutil.rmtree(place, ignore_errors=True)
        latencies.append(clusterbench.publish_latency(place, members=max(3, max(members)), mode=run_mode))
        shutil.rmtree(place, ignore_errors=True)
        _console.print(f"publish to PUBLISH_OK: {latencies[-1]}")
    document["publish_latency"] = latencies
    if failover_clients:
        place = folder / "failover"
        shutil.rmtree(place, ignore_errors=True)
        times = clusterbench.failover(place, members=max(3, max(members)), clients=failover_clients, mode=mode)
        summary = times.summary()
        document["failover"] = summary
        _console.print(f"failover after SIGKILL: {summary}")
        shutil.rmtree(place, ignore_errors=True)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(document, indent=1))


@app.command("ingest")
def ingest_cmd(
    targets: str = typer.Option(
        "migratory,migratory-standard,migratory-guaranteed,jetstream-r1,jetstream-r3,mosquitto",
        help="Targets, in order: migratory (one node), migratory-standard and migratory-guaranteed (3 members), "
        "jetstream-r1, jetstream-r3 (nats-server, file storage), mosquitto (QoS 1).",
    ),
    windows: str = typer.Option("1,16,128", help="Outstanding publications per publisher, one run each."),
    publishers: int = typer.Option(3, help="Publisher processes (one connection each)."),
    subjects: int = typer.Option(1000, help="Subjects, one subscriber connection each."),
    size: int = typer.Option(128, help="Payload bytes."),
    duration: float = typer.Option(10.0, help="Seconds measured, after the warm-up."),
    warmup: float = typer.Option(2.0, help="Seconds of publishing before the measurement."),
    workers: int = typer.Option(1, help="Workers per node or member of this server."),
    rounds: int = typer.Option(1, help="Every target and window this many times, interleaved."),
    profile: Path | None = typer.Option(None, "--profile", help="py-spy every server process into this folder."),
    as_json: Path | None = typer.Option(None, "--json", help="Write every result as a JSON list."),
) -> None:
    """Acknowledged publications per second and server CPU per publication, each target in turn, one run.

    Every acknowledged publication is looked for at its subscriber: one missing fails the run (exit 1).
    """
    from migratory.bench.ingest import INGEST_TARGETS, IngestConfig, run_ingest

    chosen = [t.strip() for t in targets.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in INGEST_TARGETS]
    try:
        sizes = [int(w) for w in windows.split(",") if w.strip()]
    except ValueError:
        sizes = []
    if unknown or not sizes or min(sizes) < 1:
        _console.print(
            f"bench ingest: unknown target {', '.join(unknown)} (choose from {', '.join(INGEST_TARGETS)})"
            if unknown
            else f"bench ingest: --windows {windows!r}: a comma-separated list of positive integers"
        )
        raise typer.Exit(2)
    results = []
    table = Table("target", "K", "acked/s", "server CPU %", "us/ack", "ack p50 ms", "p99 ms", "publisher CPU %",
                  "server RSS MB", "checked")  # fmt: skip
    for _ in range(rounds):
        for window in sizes:
            for target in chosen:
                result = run_ingest(
                    IngestConfig(
                        target=target,
                        window=window,
                        publishers=publishers,
                        subjects=subjects,
                        size=size,
                        duration=duration,
                        warmup=warmup,
                        workers=workers,
                        profile=profile,
                    )
                )
                results.append(result)
                checked = (
                    f"{result.delivered}/{result.acked_total}"
                    if not result.errors
                    else escape("; ".join(result.errors))[:120]
                )
                _console.print(
                    f"{target} K={window}: {result.per_second:,.0f}/s, {result.server_cpu_us_per_ack} us/ack, "
                    f"p99 {result.ack_p99_ms} ms, {checked}"
                )
                if result.by_role:
                    hops = ", ".join(f"{role} {us} us {w} wake-ups" for role, (us, w) in result.by_role.items())
                    _console.print(f"  per acknowledged publication: {hops}")
                table.add_row(
                    target,
                    str(window),
                    f"{result.per_second:,.0f}",
                    f"{result.server_cpu_percent}",
                    f"{result.server_cpu_us_per_ack}",
                    f"{result.ack_p50_ms}",
                    f"{result.ack_p99_ms}",
                    "/".join(f"{c:.0f}" for c in result.publisher_cpu_percent),
                    f"{result.server_rss_mb}",
                    checked,
                )
    Console(highlight=False, width=max(_console.width, 150)).print(table)
    if as_json is not None:
        as_json.parent.mkdir(parents=True, exist_ok=True)
        as_json.write_text(json.dumps([r.as_dict() for r in results], indent=1) + "\n")
    if any(r.errors for r in results):
        raise typer.Exit(1)
