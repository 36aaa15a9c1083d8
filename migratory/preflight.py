"""Start-up checks: everything ``migratory serve`` would refuse at start, found without starting.

``migratory config check`` and the server's own start (:func:`migratory.server.process.app.run`) call
the same functions, so a file that passes the check does not fail at start for a reason the
check could have seen: certificate and key files readable, matching, decrypted by the
password and valid now; the log and state folders writable by the user the server runs as
(``RunAsUser`` when started as root); ``RunAsUser``/``RunAsGroup`` existing; every listener's
address present on this machine, its port allowed (below the unprivileged port start only as
root or with ``CAP_NET_BIND_SERVICE``) and not shared with another listener; the
entitlement's key file or class loadable; and the cross-key rules of
:meth:`migratory.config.Config.problems`. All problems are collected, none stops the others,
and each is reported as ``file:line: Key: what`` with the line of the key in the file (or of
the key it depends on; line 1 when the file does not set either).

Warnings do not stop the server: a configuration that lets every address publish, a
monitoring service open to everyone without a password, a certificate about to expire, a
port that some process (perhaps the running server itself) holds right now.

Plain blocking code, no asyncio: it runs before any event loop exists.
"""

from __future__ import annotations

import datetime
import errno
import grp
import ipaddress
import os
import pwd
import re
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from migratory.certs import CertError, describe, load_key
from migratory.config import Config, ConfigError, DeliveryMode, Endpoint, key_specs
from migratory.entitlement import CustomEntitlement

__all__ = [
    "Finding",
    "KeyLines",
    "Report",
    "check",
    "check_file",
    "check_text",
    "collide",
    "consensus_endpoint",
    "listeners",
]

CAP_NET_BIND_SERVICE = 10
EXPIRY_WARNING_DAYS = 14
LOG_FILES = ("server.log", "access.log", "message.log", "stats.log")

InUse = Literal["error", "warning", "skip"]


@dataclass(frozen=True)
class Finding:
    """One problem (or warning) about one key, at one line of the file."""

    line: int
    key: str
    what: str
    warning: bool = False


@dataclass
class Report:
    """What a check found in ``path``; ``config`` is the parsed file (None when it could not be read)."""

    path: str
    config: Config | None = None
    findings: list[Finding] = field(default_factory=list)

    def _lines(self, warning: bool) -> list[str]:
        chosen = sorted((f for f in self.findings if f.warning is warning), key=lambda f: f.line)
        label = "warning: " if warning else ""
        return [f"{self.path}:{f.line}: {f.key}: {label}{f.what}" for f in chosen]

    @property
    def errors(self) -> list[str]:
        """Every problem the server would refuse to start with, ``file:line: Key: what``, in line order."""
        return self._lines(False)

    @property
    def warnings(self) -> list[str]:
        """``file:line: Key: warning: what``: worth knowing, not fatal."""
        return self._lines(True)

    @property
    def ok(self) -> bool:
        return not any(not f.warning for f in self.findings)


class KeyLines:
    """The line of each key set in a configuration text, for messages about checks made after parsing."""

    def __init__(self, text: str = "") -> None:
        self.lines: dict[str, int] = {}
        for start, _end, line in logical_lines(text):
            name, sep, _ = line.partition("=")
            if sep:
                self.lines.setdefault(name.strip(), start)

    @classmethod
    def of_file(cls, path: str | os.PathLike[str]) -> KeyLines:
        try:
            return cls(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return cls()

    def line(self, key: str, *related: str) -> int:
        """The line of ``key``; else of the first related key the file sets; else 1 (never 0)."""
        for name in (key, *related):
            if name in self.lines:
                return self.lines[name]
        return 1

    def of_problem(self, problem: str) -> int:
        """The line to blame for a ``Key: what`` problem: the key's, else the first key it names."""
        culprit = problem.partition(":")[0]
        if culprit in self.lines:
            return self.lines[culprit]
        named = [line for name, line in self.lines.items() if names_key(problem, name)]
        return min(named) if named else 1


def names_key(text: str, key_name: str) -> bool:
    """Whether ``text`` names ``key_name`` as a whole word (Listen is not named by ListenEncrypted)."""
    return re.search(rf"(?<![\w.]){re.escape(key_name)}(?!\w|\.\w)", text) is not None


def logical_lines(text: str) -> Iterator[tuple[int, int, str]]:
    """(first line, last line, text) of each logical line: comments dropped, continuations joined."""
    pending: list[str] = []
    start = 0
    lineno = 0
    for lineno, physical in enumerate(text.splitlines(), 1):
        stripped = physical.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = lineno
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        yield start, lineno, " ".join(part for part in pending if part)
        pending = []
    if pending:
        yield start, lineno, " ".join(part for part in pending if part)


# --- the file: parse errors, cross-key problems, then the checks of the machine -----------------------------


def check_file(path: str | os.PathLike[str], *, in_use: InUse = "warning") -> Report:
    """Everything wrong with the configuration file ``path`` and the machine it would run on."""
    name = os.fspath(path)
    try:
        text = Path(name).read_text(encoding="utf-8")
    except OSError as exc:
        return Report(name, None, [Finding(1, "(file)", f"cannot read: {exc.strerror or exc}")])
    except UnicodeDecodeError as exc:
        return Report(name, None, [Finding(1, "(file)", f"not UTF-8 text: {exc.reason}")])
    return check_text(text, name, in_use=in_use)


def check_text(text: str, name: str, *, in_use: InUse = "warning") -> Report:
    """:func:`check_file` on text already read; ``name`` is the file name used in messages."""
    lines = KeyLines(text)
    report = Report(name)
    bad_keys: set[str] = set()
    try:
        config = Config.from_text(text, name)
    except ConfigError as exc:
        config, bad_keys = _lenient(text)
        problems = set(config.problems())
        for error in exc.errors:
            finding = _parse_finding(error, name)
            if f"{finding.key}: {finding.what}" not in problems:
                report.findings.append(finding)
        # cross-key problems too, except those that only follow from a value already reported as wrong
        for problem in config.problems():
            if not any(names_key(problem, bad) for bad in bad_keys):
                report.findings.append(_problem_finding(problem, lines))
    report.config = config
    report.findings += check(config, name, lines=lines, in_use=in_use, skip=bad_keys).findings
    return report


def _parse_finding(error: str, name: str) -> Finding:
    """``name:line: Key: what`` (as Config writes them) back into a Finding; line 0 becomes 1."""
    rest = error.removeprefix(f"{name}:")
    number, _, rest = rest.partition(": ")
    key_name, _, what = rest.partition(": ")
    line = int(number) if number.isdigit() else 1
    return Finding(max(line, 1), key_name, what)


def _problem_finding(problem: str, lines: KeyLines) -> Finding:
    key_name, _, what = problem.partition(": ")
    return Finding(lines.of_problem(problem), key_name, what)


def _lenient(text: str) -> tuple[Config, set[str]]:
    """A Config of every value that parses (the others at their defaults), and the keys that did not."""
    specs = key_specs()
    values: dict[str, object] = {}
    bad: set[str] = set()
    for _start, _end, line in logical_lines(text):
        key_name, sep, raw = line.partition("=")
        key_name = key_name.strip()
        if not sep or key_name not in specs:
            continue
        attr, parse = specs[key_name]
        if attr in values:
            continue
        try:
            values[attr] = parse(raw.strip())
        except ValueError:
            bad.add(key_name)
    return Config(**values), bad  # type: ignore[arg-type]


def check(
    config: Config,
    path: str | os.PathLike[str] | None = None,
    *,
    lines: KeyLines | None = None,
    in_use: InUse = "skip",
    skip: set[str] | None = None,
    import_classes: bool = True,
) -> Report:
    """The checks of the machine for a parsed ``config`` read from ``path``: files, folders, users, ports, exposure.

    ``lines`` gives the line numbers (read from ``path`` when not given). ``in_use``: what a port that
    some process listens on now is: "skip" where the caller binds right after, as the server does
    (except a seed's consensus port, bound later by the member agent: in use, it is an error then).
    ``import_classes``: import EntitlementCustomClass to see that it loads; the server leaves that to
    its workers, so that the user's module is never imported in the process that forks them.
    """
    name = os.fspath(path) if path else "<config>"
    where = lines if lines is not None else KeyLines.of_file(name) if path else KeyLines()
    checker = _Checker(config, where, skip or set(), import_classes)
    checker.run(in_use)
    return Report(name, config, checker.findings)


# --- the checks -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _User:
    """Whom the server runs as: the current process (``os.access`` decides) or RunAsUser (mode bits do)."""

    name: str
    uid: int
    groups: frozenset[int]
    current: bool


class _Checker:
    def __init__(self, config: Config, lines: KeyLines, skip: set[str], import_classes: bool) -> None:
        self.config = config
        self.lines = lines
        self.skip = skip
        self.import_classes = import_classes
        self.findings: list[Finding] = []

    def error(self, key_name: str, what: str, *related: str) -> None:
        self.findings.append(Finding(self.lines.line(key_name, *related), key_name, what))

    def warn(self, key_name: str, what: str, *related: str) -> None:
        self.findings.append(Finding(self.lines.line(key_name, *related), key_name, what, warning=True))

    def run(self, in_use: InUse) -> None:
        user = self.service_user()
        self.folder("LogFolder", self.config.log_folder, user)
        self.log_files(user)
        self.folder("StateFolder", self.config.state_folder, user)
        self.epoch_file()
        self.tls()
        self.cluster_tls()
        self.entitlement()
        self.ports(in_use)
        self.exposure()

    # -- who runs the server, and its folders

    def service_user(self) -> _User:
        """RunAsUser when the server would switch to it (started as root); else this process's user."""
        config = self.config
        started_as_root = os.geteuid() == 0
        report = self.error if started_as_root else self.warn
        note = "" if started_as_root else " (ignored: the server switches users only when started as root)"
        entry: pwd.struct_passwd | None = None
        if config.run_as_user:
            try:
                entry = pwd.getpwnam(config.run_as_user)
            except KeyError:
                report("RunAsUser", f"no such user {config.run_as_user!r}{note}")
        if config.run_as_group:
            try:
                grp.getgrnam(config.run_as_group)
            except KeyError:
                report("RunAsGroup", f"no such group {config.run_as_group!r}{note}", "RunAsUser")
        if entry is not None and started_as_root:
            gid = grp.getgrnam(config.run_as_group).gr_gid if _group_exists(config.run_as_group) else entry.pw_gid
            return _User(entry.pw_name, entry.pw_uid, frozenset({gid}), current=False)
        uid = os.geteuid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = f"uid {uid}"
        return _User(name, uid, frozenset(os.getgroups()) | {os.getegid()}, current=True)

    def folder(self, key_name: str, folder: str, user: _User) -> None:
        """The folder exists and is writable by the user, or can be created by the one who starts the server."""
        if key_name in self.skip:
            return
        path = Path(folder).absolute()
        shown = folder if folder == str(path) else f"{folder} ({path})"
        if path.exists() and not path.is_dir():
            self.error(key_name, f"{shown} exists and is not a folder")
            return
        if not user.current:
            # started as root: root creates the folder and hands it to RunAsUser, who must reach it
            for parent in reversed(path.parents):
                if parent.exists() and not _mode_allows(parent, user, os.X_OK):
                    self.error(key_name, f"{shown}: {user.name} (RunAsUser) cannot enter {parent}", "RunAsUser")
                    return
            return
        existing = path
        while not existing.exists():
            existing = existing.parent
        if existing != path and not existing.is_dir():
            self.error(key_name, f"{shown} cannot be created: {existing} is not a folder")
        elif not os.access(existing, os.W_OK | os.X_OK):
            why = "" if existing == path else f": {existing} is not writable"
            self.error(
                key_name, f"{shown} cannot be {'written' if existing == path else 'created'} by {user.name}{why}"
            )

    def log_files(self, user: _User) -> None:
        if "LogFolder" in self.skip:
            return
        folder = Path(self.config.log_folder)
        for name in LOG_FILES:
            path = folder / name
            if not path.exists() and not path.is_symlink():
                continue
            if not path.is_file():
                self.error("LogFolder", f"the server cannot start: {path} is not a regular file")
            elif user.current and not os.access(path, os.W_OK):
                self.error("LogFolder", f"{path} is not writable by {user.name}")

    def epoch_file(self) -> None:
        if "StateFolder" in self.skip:
            return
        path = Path(self.config.state_folder) / "epoch"
        if not path.exists():
            return
        try:
            text = path.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            self.error("StateFolder", f"{path} cannot be read: {getattr(exc, 'strerror', None) or exc}")
            return
        if text and not text.isdigit():
            self.error("StateFolder", f"{path} does not hold an epoch number (remove it to start again from 1)")

    # -- certificates and keys

    def tls(self) -> None:
        config = self.config
        monitor_tls: tuple[Endpoint, ...] = getattr(config, "monitor_listen_encrypted", ())
        mqtt_tls: tuple[Endpoint, ...] = getattr(config, "listen_mqtt_encrypted", ())
        if not (config.listen_encrypted or monitor_tls or mqtt_tls) or not (config.tls_certificate and config.tls_key):
            return  # not used, or missing (a cross-key problem already says so)
        if not self.pair("TLSCertificate", config.tls_certificate, "TLSKey", config.tls_key):
            return
        try:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(config.tls_certificate, config.tls_key, password=config.tls_key_password or None)
        except (ssl.SSLError, OSError) as exc:
            self.error("TLSCertificate", f"{config.tls_certificate} cannot be served: {exc}")
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(config.tls_ciphers)
        except ssl.SSLError:
            self.error("TLSCiphers", f"OpenSSL accepts none of {config.tls_ciphers!r}")

    def cluster_tls(self) -> None:
        config = self.config
        if not (config.cluster_members and config.cluster_tls):
            return
        cert_key = "ClusterTLSCertificate" if config.cluster_tls_certificate else "TLSCertificate"
        key_key = "ClusterTLSKey" if config.cluster_tls_key else "TLSKey"
        cert = config.cluster_tls_certificate or config.tls_certificate
        key_file = config.cluster_tls_key or config.tls_key
        if cert and key_file:
            self.pair(cert_key, cert, key_key, key_file)
        if config.cluster_tls_ca:
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=config.cluster_tls_ca)
            except (ssl.SSLError, OSError) as exc:
                self.error("ClusterTLSCA", f"{config.cluster_tls_ca}: not a usable CA file: {exc}")

    def pair(self, cert_key: str, cert: str, key_key: str, key_file: str) -> bool:
        """Certificate readable and valid now, key readable with the password, the two matching."""
        password = self.config.tls_key_password or None
        good = True
        certificate: x509.Certificate | None = None
        try:
            info = describe(Path(cert))
            certificate = x509.load_pem_x509_certificate(Path(cert).read_bytes())
        except (CertError, OSError, ValueError) as exc:
            self.error(cert_key, str(exc))
            good = False
        else:
            now = datetime.datetime.now(datetime.UTC)
            if info.expired:
                self.error(cert_key, f"{cert} expired on {info.not_after:%Y-%m-%d %H:%M} UTC")
                good = False
            elif info.not_before > now:
                self.error(cert_key, f"{cert} is not valid before {info.not_before:%Y-%m-%d %H:%M} UTC")
                good = False
            elif info.days_left < EXPIRY_WARNING_DAYS:
                self.warn(cert_key, f"{cert} expires in {info.days_left} day(s), on {info.not_after:%Y-%m-%d} UTC")
        try:
            private = load_key(Path(key_file), password)
        except CertError as exc:
            text = str(exc)
            blame = "TLSKeyPassword" if "password" in text and (password or "encrypted" in text) else key_key
            self.error(blame, text, key_key)
            return False
        if certificate is None:
            return False
        der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        if certificate.public_key().public_bytes(*der) != private.public_key().public_bytes(*der):
            self.error(key_key, f"{key_file} does not match {cert_key} {cert}")
            return False
        return good

    def entitlement(self) -> None:
        config = self.config
        if config.entitlement == "JWT" and config.entitlement_jwt_public_key:
            path = Path(config.entitlement_jwt_public_key)
            try:
                serialization.load_pem_public_key(path.read_bytes())
            except OSError as exc:
                self.error("EntitlementJwtPublicKey", f"{path} cannot be read: {exc.strerror or exc}")
            except (ValueError, TypeError):
                self.error("EntitlementJwtPublicKey", f"{path} is not a PEM public key")
        if config.entitlement == "Custom" and config.entitlement_custom_class and self.import_classes:
            try:
                CustomEntitlement(config.entitlement_custom_class)
            except Exception as exc:  # the user's module: anything it raises is the reason
                self.error("EntitlementCustomClass", f"{config.entitlement_custom_class}: cannot load: {exc!r}")

    # -- listeners

    def endpoints(self) -> list[tuple[str, Endpoint]]:
        return [(k, e) for k, e in listeners(self.config) if k not in self.skip]

    def _consensus_endpoint(self) -> tuple[str, Endpoint] | None:
        consensus = consensus_endpoint(self.config)
        return None if consensus is None else ("ClusterMemberListen", consensus)

    def ports(self, in_use: InUse) -> None:
        endpoints = self.endpoints()
        for index, (key_name, endpoint) in enumerate(endpoints):
            for other_key, other in endpoints[:index]:
                if "ClusterMemberListen" in (key_name, other_key):
                    continue  # Config.problems() compares the cluster port with the others
                if collide(endpoint, other):
                    first = str(other) if other_key == key_name else f"{other_key} {other}"
                    self.error(key_name, f"{endpoint} overlaps {first}: one listener per address and port")
        probed: set[Endpoint] = set()
        for key_name, endpoint in endpoints:
            if endpoint in probed:
                continue
            probed.add(endpoint)
            problem = _probe(endpoint)
            if problem is None:
                continue
            code, detail = problem
            if code == errno.EACCES:
                self.error(key_name, f"cannot listen on {endpoint}: {detail}: {_privileged_hint(endpoint.port)}")
            elif code == errno.EADDRINUSE:
                what = f"port {endpoint.port} of {endpoint.host} is in use now"
                consensus = (key_name, endpoint) == self._consensus_endpoint()
                if consensus:
                    what += " (the seed members' consensus port: ClusterMemberListen's port + 1)"
                if in_use == "error" or (consensus and in_use == "skip"):
                    # "skip": the server binds its listeners right after and says so; the consensus port
                    # is bound later, by the member agent, so the start refuses it here
                    self.error(key_name, what)
                elif in_use == "warning":
                    self.warn(key_name, f"{what} (by the running server, fine for a restart; else the start fails)")
            elif code == errno.EADDRNOTAVAIL:
                self.error(key_name, f"cannot listen on {endpoint}: no interface of this machine has {endpoint.host}")
            else:
                self.error(key_name, f"cannot listen on {endpoint}: {detail}")

    def exposure(self) -> None:
        config = self.config
        clients = ("Listen", "ListenEncrypted", "ListenMqtt", "ListenMqttEncrypted")
        public = [(k, e) for k, e in self.endpoints() if k in clients and not _loopback(e.host)]
        networks = [ipaddress.ip_network(n, strict=False) for n in config.publish_allow_from]
        anyone = not networks or any(n.prefixlen == 0 for n in networks)
        if config.entitlement == "None" and anyone and public:
            reach = ", ".join(f"{k} {e}" for k, e in public)
            self.warn(
                "PublishAllowFromAddressList",
                f"every address that reaches {reach} may publish (Entitlement = None, no address list): list the "
                "publishers' addresses (10.0.0.0/24, ...) or set Entitlement (docs/security.md)",
                "Entitlement",
                "Listen",
            )
        monitors = [(k, e) for k, e in self.endpoints() if k.startswith("MonitorHTTP.") and not _loopback(e.host)]
        if monitors and not config.monitor_username:
            key_name, endpoint = monitors[0]
            self.warn(
                key_name,
                f"{endpoint}: every address that reaches it reads /stats and /metrics without a password: "
                "bind it to 127.0.0.1 or a LAN address, or set MonitorHTTP.Username and MonitorHTTP.Password",
            )


def consensus_endpoint(config: Config) -> Endpoint | None:
    """A Guaranteed seed's consensus (Raft) listener, ClusterMemberListen's address and port + 1; else None.

    Taken by another process, the seed cannot join the seed members' majority.
    """
    listen = config.cluster_member_listen
    if listen is None or config.cluster_delivery_mode is not DeliveryMode.GUARANTEED:
        return None
    if not 0 <= config.member_index < config.seed_count:
        return None
    return Endpoint(listen.host, listen.port + 1)


def listeners(config: Config) -> list[tuple[str, Endpoint]]:
    """(key, endpoint) of every listener of the member; a seed's consensus port too, as ClusterMemberListen."""
    monitor_tls: tuple[Endpoint, ...] = getattr(config, "monitor_listen_encrypted", ())
    found = [("Listen", e) for e in config.listen]
    found += [("ListenEncrypted", e) for e in config.listen_encrypted]
    found += [("ListenMqtt", e) for e in getattr(config, "listen_mqtt", ())]
    found += [("ListenMqttEncrypted", e) for e in getattr(config, "listen_mqtt_encrypted", ())]
    found += [("MonitorHTTP.Listen", e) for e in config.monitor_listen]
    found += [("MonitorHTTP.ListenEncrypted", e) for e in monitor_tls]
    if config.cluster_member_listen is not None:
        found.append(("ClusterMemberListen", config.cluster_member_listen))
    consensus = consensus_endpoint(config)
    if consensus is not None:
        found.append(("ClusterMemberListen", consensus))
    return found


def collide(a: Endpoint, b: Endpoint) -> bool:
    """Whether two listeners cannot both bind: one port, and the same host or a wildcard covering the other."""
    return bool(a.port) and a.port == b.port and _overlap(a.host, b.host)


def _group_exists(name: str) -> bool:
    if not name:
        return False
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def _mode_allows(path: Path, user: _User, want: int) -> bool:
    """Whether ``user`` (not this process) gets ``want`` (os.R_OK/W_OK/X_OK bits) on ``path`` by its mode."""
    if user.uid == 0:
        return True
    st = path.stat()
    if st.st_uid == user.uid:
        bits = st.st_mode >> 6
    elif st.st_gid in user.groups or st.st_gid in _supplementary(user.name):
        bits = st.st_mode >> 3
    else:
        bits = st.st_mode
    return bits & want == want


def _supplementary(name: str) -> set[int]:
    try:
        entry = pwd.getpwnam(name)
        return set(os.getgrouplist(name, entry.pw_gid))
    except (KeyError, OSError):
        return set()


WILDCARDS = {"*": 0, "0.0.0.0": 4, "::": 0}


def _family(host: str) -> int:
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return 0


def _overlap(a: str, b: str) -> bool:
    """Whether two listener hosts on one port collide: the same host, or a wildcard covering the other."""
    if a == b:
        return True
    for wild, other in ((a, b), (b, a)):
        if wild in WILDCARDS:
            family = WILDCARDS[wild]
            return family == 0 or _family(other) in (0, family)
    return False


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _probe(endpoint: Endpoint) -> tuple[int, str] | None:
    """Bind (and release) the endpoint as the server would; (errno, message) when that fails."""
    host = endpoint.bind_host
    candidates: list[tuple[int, tuple[object, ...]]] = []
    if host is None:
        if socket.has_ipv6:
            candidates.append((socket.AF_INET6, ("::", endpoint.port)))
        candidates.append((socket.AF_INET, ("0.0.0.0", endpoint.port)))
    else:
        try:
            infos = socket.getaddrinfo(host, endpoint.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            return (-1, f"{host} does not resolve ({exc.strerror})")
        candidates.append((infos[0][0], infos[0][4]))
    last: tuple[int, str] | None = None
    for family, address in candidates:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            last = (exc.errno or -1, exc.strerror or str(exc))
            continue
        with sock:
            try:
                if family == socket.AF_INET6 and host is None:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
                return None
            except OSError as exc:
                last = (exc.errno or -1, exc.strerror or str(exc))
                if exc.errno in (errno.EACCES, errno.EADDRINUSE):
                    return last  # the same on the fallback address
    return last


def _unprivileged_port_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text().strip())
    except (OSError, ValueError):
        return 1024


def has_bind_capability() -> bool:
    """Whether this process may bind ports below the unprivileged start: root, or CAP_NET_BIND_SERVICE."""
    if os.geteuid() == 0:
        return True
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_NET_BIND_SERVICE & 1)
    except (OSError, ValueError):
        pass
    return False


def _privileged_hint(port: int) -> str:
    start = _unprivileged_port_start()
    if port < start and not has_bind_capability():
        return (
            f"ports below {start} need root (then RunAsUser) or the CAP_NET_BIND_SERVICE capability "
            "(AmbientCapabilities in the systemd unit, as the packaged one has)"
        )
    return "permission denied by the system (a security policy?)"
