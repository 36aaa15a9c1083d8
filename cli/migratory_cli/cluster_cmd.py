"""``migratory cluster init|check|status``: write, compare and watch a cluster's members.

``init`` writes one configuration per member (the same member list, order and
password everywhere), ``check`` proves that several members' files agree and says
what differs, and ``status`` shows a running cluster as one member's monitor sees it.
"""

from __future__ import annotations

import base64
import ipaddress
import secrets
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from migratory.config import Config, DeliveryMode, Endpoint, parse_endpoints
from migratory.preflight import KeyLines, collide, consensus_endpoint, listeners
from migratory_cli.config_cmds import load_or_exit
from migratory_cli.status_cmd import fetch
from migratory_cli.status_cmd import show as show_document

app = typer.Typer(
    help="Cluster commands: write member configurations, compare them, watch a cluster.", no_args_is_help=True
)

EXIT_DIFFER = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

_err = Console(stderr=True, highlight=False, soft_wrap=True)

# keys every member must agree on, with how to show them
AGREED = (
    ("ClusterMembers", lambda c: ", ".join(map(str, c.cluster_members))),
    ("ClusterPassword", lambda c: c.cluster_password),
    ("ClusterDeliveryMode", lambda c: c.cluster_delivery_mode.value),
    ("ClusterSeedMemberCount", lambda c: str(c.seed_count) if c.seed_count else "auto"),
    ("MaxCachedMessagesPerSubject", lambda c: str(c.max_cached_messages_per_subject)),
    ("CacheExpireTime", lambda c: str(c.cache_expire_time)),
    ("ClusterHeartbeatInterval", lambda c: str(c.cluster_heartbeat_interval)),
    ("ClusterHeartbeatTimeout", lambda c: str(c.cluster_heartbeat_timeout)),
    ("ClusterTLS", lambda c: str(c.cluster_tls).lower()),
)


def _fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    _err.print(f"error: {message}", markup=False)
    return typer.Exit(code)


@app.command("init")
def init_cmd(
    members: str = typer.Option(
        ..., "--members", help="Every member's cluster address, in order: host:port,host:port,..."
    ),
    out: Path = typer.Option(..., "--out", help="Folder to write member-1.conf, member-2.conf, ... into."),
    mode: str = typer.Option("Standard", "--mode", help="ClusterDeliveryMode: Standard or Guaranteed."),
    client_port: int = typer.Option(8800, "--client-port", help="Each member's client listener port (on its host)."),
    monitor_port: int = typer.Option(9900, "--monitor-port", help="Each member's monitor port (on its host); 0: none."),
    password: str = typer.Option("", "--password", help="ClusterPassword to use (default: a new random one)."),
    force: bool = typer.Option(False, "--force", help="Overwrite existing files."),
) -> None:
    """Write one migratorydata.conf per member of a new cluster, with a random ClusterPassword."""
    try:
        endpoints = parse_endpoints(members)
    except ValueError as exc:
        raise _fail(f"--members: {exc}") from None
    if len(endpoints) < 2:
        raise _fail("--members: a cluster needs at least two members")
    if any(e.host == "*" for e in endpoints):
        raise _fail("--members: list addresses the members can reach each other on, not *")
    try:
        delivery = next(m for m in DeliveryMode if m.value.lower() == mode.lower())
    except StopIteration:
        raise _fail("--mode: expected Standard or Guaranteed") from None
    if delivery is DeliveryMode.GUARANTEED and len(endpoints) < 3:
        raise _fail("--mode: Guaranteed needs at least three members")
    if password and len(password) < 12:
        raise _fail("--password: at least 12 characters")
    secret = password or base64.urlsafe_b64encode(secrets.token_bytes(24)).decode().rstrip("=")
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"member-{i + 1}.conf" for i in range(len(endpoints))]
    existing = [p for p in paths if p.exists()]
    if existing and not force:
        raise _fail(f"{existing[0]} exists (use --force to overwrite)")
    listed = ", ".join(map(str, endpoints))
    for i, (endpoint, path) in enumerate(zip(endpoints, paths, strict=True)):
        folder = (out / f"member-{i + 1}").resolve()
        lines = [
            f"# Member {i + 1} of {len(endpoints)}, written by `migratory cluster init`.",
            "# Every member's file has the same ClusterMembers (same order) and ClusterPassword;",
            "# check them with `migratory cluster check member-*.conf`.",
            f"Listen = {_host_port(endpoint.host, client_port)}",
        ]
        if monitor_port:
            lines.append(f"MonitorHTTP.Listen = {_host_port(endpoint.host, monitor_port)}")
        lines += [
            f"LogFolder = {folder / 'logs'}",
            f"StateFolder = {folder / 'state'}",
            f"ClusterMembers = {listed}",
            f"ClusterMemberListen = {endpoint}",
            f"ClusterPassword = {secret}",
            f"ClusterDeliveryMode = {delivery.value}",
        ]
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)  # it holds the cluster's password
        load_or_exit(path)  # what we wrote must be valid
    Console(highlight=False).print(f"wrote {len(paths)} member configurations to {out} ({delivery.value} delivery)")


def _host_port(host: str, port: int) -> str:
    return str(Endpoint(host, port))


@app.command("check")
def check_cmd(files: list[Path] = typer.Argument(..., help="The members' migratorydata.conf files.")) -> None:
    """Prove that several members' configurations agree (list, order, password, mode); say what differs.

    Exit codes: 0 they agree, 1 they differ, 2 a file is invalid or a seed's consensus port (its cluster
    port + 1) is another member's listener on the same host.
    """
    configs = [(path, load_or_exit(path)) for path in files]
    problems: list[str] = []
    for path, config in configs:
        if not config.clustered:
            problems.append(f"{path}: ClusterMembers is not set")
    clustered = [(p, c) for p, c in configs if c.clustered]
    for key, show in AGREED:
        values: dict[str, list[str]] = {}
        for path, config in clustered:
            values.setdefault(show(config), []).append(str(path))
        if len(values) > 1:
            shown = "; ".join(
                f"{'(hidden)' if key == 'ClusterPassword' else value!r} in {', '.join(paths)}"
                for value, paths in values.items()
            )
            problems.append(f"{key} differs: {shown}")
    seen: dict[Endpoint | None, Path] = {}
    for path, config in clustered:
        me = config.cluster_member_listen
        if me in seen:
            problems.append(f"{path} and {seen[me]} are both member {me}")
        seen[me] = path
    collisions = consensus_collisions(clustered)
    console = Console(highlight=False)
    if problems or collisions:
        for problem in problems + collisions:
            _err.print(problem, markup=False)
        raise typer.Exit(EXIT_USAGE if collisions else EXIT_DIFFER)
    members = clustered[0][1].cluster_members if clustered else ()
    missing = [str(m) for m in members if m not in seen]
    console.print(
        f"OK: {len(clustered)} member configuration(s) agree ({len(members)} members, "
        f"{clustered[0][1].cluster_delivery_mode.value} delivery)"
        + (f"; not checked here: {', '.join(missing)}" if missing else ""),
        markup=False,
    )


def consensus_collisions(configs: list[tuple[Path, Config]]) -> list[str]:
    """``file:line: ClusterMemberListen: what`` for each seed whose consensus port another member's file listens on.

    Each file alone is checked when loaded; only the files side by side show members sharing a host
    (127.0.0.1, .2, .3 with one port set) where one's Listen or monitor port is a seed's cluster port + 1.
    A wildcard listener counts when both members are on one machine: the same cluster host, or loopback ones.
    """
    out: list[str] = []
    for path, config in configs:
        consensus = consensus_endpoint(config)
        me = config.cluster_member_listen
        if consensus is None or me is None:
            continue
        for other_path, other in configs:
            them = other.cluster_member_listen
            if other_path == path or them is None or them == me:
                continue
            for key_name, endpoint in listeners(other):
                if endpoint.host in ("*", "0.0.0.0", "::") and not _one_machine(them.host, me.host):
                    continue  # perhaps another machine's wildcard
                if collide(consensus, endpoint):
                    line = KeyLines.of_file(path).line("ClusterMemberListen")
                    out.append(
                        f"{path}:{line}: ClusterMemberListen: port {consensus.port} of {consensus.host} (the seed "
                        f"members' consensus port: ClusterMemberListen's port + 1) is also {key_name} {endpoint} "
                        f"in {other_path}"
                    )
    return out


def _one_machine(a: str, b: str) -> bool:
    """Whether two member hosts are surely one machine: the same host, or both loopback (127.0.0.2, ...)."""
    if a == b:
        return True
    try:
        return ipaddress.ip_address(a).is_loopback and ipaddress.ip_address(b).is_loopback
    except ValueError:
        return False


def status_table(document: dict[str, Any]) -> Table:
    me = document.get("member")
    table = Table(title=f"the cluster as member {me + 1 if isinstance(me, int) else '?'} sees it")
    for column in ("member", "address", "state", "rtt ms", "groups", "subjects", "snapshots", "clients"):
        table.add_column(column, justify="right" if column not in ("address", "state") else "left")
    for row in document.get("members", []):
        rtt = row.get("rtt_ms")
        table.add_row(
            str(row.get("index", 0) + 1),
            str(row.get("address", "")),
            str(row.get("state", "")),
            "-" if rtt is None or rtt < 0 else f"{rtt:.1f}",
            str(row.get("groups", "-")),
            str(row.get("subjects", "-")),
            str(row.get("snapshots", "-")),
            str(row.get("clients", "-")),
        )
    guaranteed = document.get("mode") == "Guaranteed"
    leader = document.get("leader", -1)
    healthy = document.get("healthy", document.get("ready"))
    table.caption = (
        f"{document.get('mode', '?')} delivery; "
        + (f"quorum {'yes' if document.get('quorum') else 'NO'}; " if guaranteed else "")
        + (f"leader member {leader + 1}, term {document.get('term', 0)}; " if guaranteed and leader >= 0 else "")
        + ("this member ready" if healthy else f"this member NOT ready: {document.get('reason') or 'synchronising'}")
    )
    return table


@app.command("status")
def status_cmd(
    url: str = typer.Argument(..., help="Any member's monitor URL, e.g. http://10.0.0.1:9900"),
    as_json: bool = typer.Option(False, "--json", help="Print the /cluster document as JSON."),
    watch: bool = typer.Option(False, "--watch", help="Refresh every second until interrupted."),
    user: str = typer.Option("", "--user", help="MonitorHTTP.Username, when the monitor requires it."),
    password: str = typer.Option("", "--password", help="MonitorHTTP.Password."),
    ca: Path | None = typer.Option(None, "--ca", help="CA certificate to verify an https:// monitor with."),
) -> None:
    """Show every member with its state, link round-trip time, groups, subjects, snapshots and clients."""
    show_document(lambda: fetch(url, user, password, ca, "/cluster"), url, status_table, as_json, watch)


def firewall_rules(path: Path) -> list[str]:
    """nftables rules (for an input chain) opening this member's cluster ports to the other members only."""
    import socket

    config = load_or_exit(path)
    if not config.clustered or config.cluster_member_listen is None:
        raise _fail(f"{path}: ClusterMembers is not set; there is no cluster port to open")
    me = config.cluster_member_listen
    sources: dict[str, set[str]] = {"ip": set(), "ip6": set()}
    seeds: dict[str, set[str]] = {"ip": set(), "ip6": set()}
    for index, member in enumerate(config.cluster_members):
        if member == me:
            continue
        try:
            infos = socket.getaddrinfo(member.host, member.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise _fail(f"{path}: ClusterMembers: cannot resolve {member.host}: {exc}") from None
        for family, *_, address in infos:
            key = "ip6" if family == socket.AF_INET6 else "ip"
            sources[key].add(str(address[0]))
            if index < config.seed_count:
                seeds[key].add(str(address[0]))
    rules = [f"# cluster port of member {me}: the other members only (migratory cluster firewall)"]
    for key in ("ip", "ip6"):
        if sources[key]:
            rules.append(f"{key} saddr {{ {', '.join(sorted(sources[key]))} }} tcp dport {me.port} accept")
    if config.member_index < config.seed_count:  # Guaranteed mode: the seeds' consensus on port + 1
        for key in ("ip", "ip6"):
            if seeds[key]:
                rules.append(f"{key} saddr {{ {', '.join(sorted(seeds[key]))} }} tcp dport {me.port + 1} accept")
    return rules


@app.command("firewall")
def firewall_cmd(path: Path = typer.Argument(..., help="This member's migratorydata.conf.")) -> None:
    """Print nftables rules that open this member's cluster port(s) to the listed members only."""
    for rule in firewall_rules(path):
        typer.echo(rule)
