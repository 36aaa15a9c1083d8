"""migratory/preflight.py: `config check` finds what `serve` would refuse at start, all at once, with lines.

Each problem is `file:line: Key: what` (never line 0); warnings (anyone may publish, monitoring open,
a certificate near expiry, a port in use) leave the exit code at 0. The tests as another user run
the CLI under setpriv, as the systemd unit runs the packaged server.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from migratory.certs import create_ca, issue_server_cert
from migratory.config import Config
from migratory.preflight import KeyLines, check, check_file
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "migratory_cli.main"]
as_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")


def cli(*args: str, user: int | None = None, caps: bool = False) -> subprocess.CompletedProcess[str]:
    prefix: list[str] = []
    if user is not None:
        prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
        if caps:
            prefix += ["--inh-caps=+net_bind_service", "--ambient-caps=+net_bind_service"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "cli")]), COLUMNS="200")
    # from a folder everyone may write, as the default relative LogFolder and StateFolder are checked there
    return subprocess.run(
        [*prefix, *CLI, *args], capture_output=True, text=True, timeout=60, env=env, cwd=tempfile.gettempdir()
    )


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder every user can enter (tmp_path's parents are root's 0700 on some machines)."""
    path = Path(tempfile.mkdtemp(prefix="migratory-preflight-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def write(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o644)
    return path


def located(output: str) -> list[tuple[int, str]]:
    """(line, key) of every `file:line: Key:` line; asserts that none is at line 0."""
    found = [(int(m[1]), m[2]) for m in re.finditer(r"^\S+?:(\d+): ([\w.()]+): ", output, re.MULTILINE)]
    assert all(line > 0 for line, _ in found), output
    return found


# --- everything at once, each at its line ---------------------------------------------------------------


def test_every_problem_in_one_run_with_its_line(folder: Path) -> None:
    conf = write(
        folder / "m.conf",
        f"Listen = 127.0.0.1:{free_port()}",
        "Workers = lots",
        "ListenEncrypted = 127.0.0.1:0",
        f"TLSCertificate = {folder}/missing.pem",
        f"TLSKey = {folder}/missing.key",
        "BatchingSize = 100",
        f"LogFolder = {folder}/not-a-folder",
        "MonitorHTTP.Listen = 192.0.2.77:9900",
        "Entitlement = Custom",
        "EntitlementCustomClass = no_such_module_here:Gate",
    )
    (folder / "not-a-folder").write_text("a file\n")
    done = cli("config", "check", str(conf))
    assert done.returncode == 2, done.stdout + done.stderr
    assert located(done.stderr) == [
        (2, "Workers"),
        (4, "TLSCertificate"),
        (5, "TLSKey"),
        (6, "BatchingSize"),
        (7, "LogFolder"),
        (8, "MonitorHTTP.Listen"),
        (10, "EntitlementCustomClass"),
        (8, "MonitorHTTP.Listen"),  # and a warning: monitoring open without a password
    ]
    assert "no interface of this machine has 192.0.2.77" in done.stderr
    assert f"{conf}:7: LogFolder: {folder}/not-a-folder exists and is not a folder" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_issues_case_a_missing_certificate_fails_check_and_serve_alike(folder: Path) -> None:
    """It used to pass `config check` and then stop `serve` with `file:0:`."""
    conf = write(
        folder / "tls.conf",
        f"Listen = 127.0.0.1:{free_port()}",
        f"ListenEncrypted = 127.0.0.1:{free_port()}",
        f"TLSCertificate = {folder}/fullchain.pem",
        f"TLSKey = {folder}/privkey.pem",
        f"LogFolder = {folder}/logs",
        f"StateFolder = {folder}/state",
    )
    checked = cli("config", "check", str(conf))
    served = cli("serve", "-c", str(conf))
    assert checked.returncode == served.returncode == 2
    expected = f"{conf}:3: TLSCertificate: {folder}/fullchain.pem: cannot read the certificate"
    assert expected in checked.stderr and expected in served.stderr
    assert located(checked.stderr) == located(served.stderr) == [(3, "TLSCertificate"), (4, "TLSKey")]


def test_cross_key_problems_are_all_reported_even_beside_bad_values(folder: Path) -> None:
    conf = write(
        folder / "x.conf",
        "Workers = many",
        "ListenEncrypted = *:8443",
        "BatchingSize = 10",
        "MonitorHTTP.Username = ops",
    )
    report = check_file(conf)
    assert [line.split(": ")[0:2] for line in report.errors] == [
        [f"{conf}:1", "Workers"],
        [f"{conf}:2", "ListenEncrypted"],
        [f"{conf}:3", "BatchingSize"],
        [f"{conf}:4", "MonitorHTTP.Password"],
    ]


def test_a_problem_of_a_value_already_wrong_is_not_reported_twice(folder: Path) -> None:
    """ClusterMembers is wrong: "ClusterMemberListen set without ClusterMembers" would only repeat it."""
    member = f"127.0.0.1:{free_port()}"
    conf = write(folder / "c.conf", f"ClusterMembers = {member}, nonsense", f"ClusterMemberListen = {member}")
    errors = check_file(conf).errors
    assert len(errors) == 1 and errors[0].startswith(f"{conf}:1: ClusterMembers: "), errors


def test_lines_follow_continuations_and_default_to_one() -> None:
    lines = KeyLines("# comment\nListen = 127.0.0.1:1, \\\n  127.0.0.2:1\n\nWorkers = 2\n")
    assert lines.line("Listen") == 2 and lines.line("Workers") == 5
    assert lines.line("LogFolder") == 1 and lines.line("LogFolder", "Workers") == 5
    assert lines.of_problem("ListenEncrypted: needs TLSCertificate and TLSKey") == 1  # not Listen's line


def test_unreadable_file_is_line_one(folder: Path) -> None:
    done = cli("config", "check", str(folder / "none.conf"))
    assert done.returncode == 2 and done.stderr.startswith(f"{folder}/none.conf:1: (file): cannot read")
    served = cli("serve", "-c", str(folder / "none.conf"))
    assert served.returncode == 2 and f"{folder}/none.conf:1: (file): cannot read" in served.stderr


# --- certificates ---------------------------------------------------------------------------------------


def tls_conf(folder: Path, cert: Path, key: Path, *extra: str) -> Path:
    return write(
        folder / "tls.conf",
        "Listen = 127.0.0.1:0",
        "ListenEncrypted = 127.0.0.1:0",
        f"TLSCertificate = {cert}",
        f"TLSKey = {key}",
        *extra,
        f"LogFolder = {folder}/logs",
        f"StateFolder = {folder}/state",
    )


def test_certificate_and_key_problems(folder: Path) -> None:
    ca, ca_key = create_ca(folder / "ca")
    cert, key = issue_server_cert(ca, ca_key, ["localhost"], folder / "srv")
    assert check_file(tls_conf(folder, cert, key)).errors == []
    conf = tls_conf(folder, cert, ca_key)
    assert check_file(conf).errors == [f"{conf}:4: TLSKey: {ca_key} does not match TLSCertificate {cert}"]
    locked, locked_key = create_ca(folder / "locked", password="right")
    assert check_file(tls_conf(folder, locked, locked_key, "TLSKeyPassword = right")).errors == []
    conf = tls_conf(folder, locked, locked_key)
    assert check_file(conf).errors == [
        f"{conf}:4: TLSKeyPassword: {locked_key}: the key is encrypted: give its password"
    ]
    conf = tls_conf(folder, locked, locked_key, "TLSKeyPassword = wrong")
    assert check_file(conf).errors == [
        f"{conf}:5: TLSKeyPassword: {locked_key}: wrong password, or not a PEM private key"
    ]
    old = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=30)
    expired, expired_key = issue_server_cert(ca, ca_key, ["x"], folder / "old", days=10, not_before=old)
    conf = tls_conf(folder, expired, expired_key)
    (error,) = check_file(conf).errors
    assert error.startswith(f"{conf}:3: TLSCertificate: {expired} expired on ")
    soon, soon_key = issue_server_cert(ca, ca_key, ["x"], folder / "soon", days=35, not_before=old)
    report = check_file(tls_conf(folder, soon, soon_key))
    assert report.ok and len(report.warnings) == 1 and "expires in 4 day(s)" in report.warnings[0]
    conf = tls_conf(folder, cert, key, "TLSCiphers = NO-SUCH-CIPHER")
    assert check_file(conf).errors == [f"{conf}:5: TLSCiphers: OpenSSL accepts none of 'NO-SUCH-CIPHER'"]


def test_certificate_unused_without_a_tls_listener_is_not_checked(folder: Path) -> None:
    conf = write(folder / "m.conf", "Listen = 127.0.0.1:0", f"TLSCertificate = {folder}/none.pem", "TLSKey = x")
    assert check_file(conf).errors == []


def test_cluster_tls_files(folder: Path) -> None:
    ca, ca_key = create_ca(folder / "ca")
    cert, _key = issue_server_cert(ca, ca_key, ["127.0.0.1"], folder / "m1")
    lines = [
        "Listen = 127.0.0.1:0",
        f"ClusterMembers = 127.0.0.1:{free_port()}, 127.0.0.1:{free_port()}",
        "ClusterPassword = a-long-enough-secret",
        "ClusterTLS = true",
        f"ClusterTLSCertificate = {cert}",
        f"ClusterTLSKey = {ca_key}",
        f"ClusterTLSCA = {folder}/none.pem",
    ]
    members = lines[1].split(" = ")[1].split(", ")
    conf = write(folder / "c.conf", *lines, f"ClusterMemberListen = {members[0]}")
    assert [e.split(": ")[1] for e in check_file(conf).errors] == ["ClusterTLSKey", "ClusterTLSCA"]


# --- folders, users and ports, as the user the server runs as ----------------------------------------------


def test_state_file_that_is_not_a_number(folder: Path) -> None:
    (folder / "state").mkdir()
    (folder / "state" / "epoch").write_text("seven\n")
    conf = write(folder / "m.conf", "Listen = 127.0.0.1:0", f"StateFolder = {folder}/state")
    assert check_file(conf).errors == [
        f"{conf}:2: StateFolder: {folder}/state/epoch does not hold an epoch number (remove it to start again from 1)"
    ]


@as_root
def test_folders_and_privileged_port_as_the_service_user(folder: Path) -> None:
    """As nobody: a root-owned folder is refused, port 80 only with CAP_NET_BIND_SERVICE (as the unit grants)."""
    (folder / "root-only").mkdir(mode=0o755)
    conf = write(
        folder / "m.conf",
        f"Listen = 127.{os.getpid() % 200 + 1}.3.4:80",
        f"LogFolder = {folder}/root-only/logs",
        f"StateFolder = {folder}/root-only",
    )
    done = cli("config", "check", str(conf), user=65534)
    assert done.returncode == 2
    assert located(done.stderr) == [(1, "Listen"), (2, "LogFolder"), (3, "StateFolder")]
    assert "ports below 1024 need root (then RunAsUser) or the CAP_NET_BIND_SERVICE capability" in done.stderr
    assert f"{folder}/root-only/logs cannot be created by nobody: {folder}/root-only is not writable" in done.stderr
    (folder / "root-only").chmod(0o777)
    granted = cli("config", "check", str(conf), user=65534, caps=True)
    assert granted.returncode == 0, granted.stderr
    served = cli("serve", "-c", str(conf), user=65534)  # serve refuses the same way, before binding anything
    assert served.returncode == 2 and located(served.stderr) == [(1, "Listen")]


@as_root
def test_run_as_user_must_exist_and_reach_its_folders(folder: Path) -> None:
    conf = write(folder / "m.conf", "Listen = 127.0.0.1:0", "RunAsUser = no-such-user-here")
    assert check_file(conf).errors == [f"{conf}:2: RunAsUser: no such user 'no-such-user-here'"]
    private = folder / "private"
    private.mkdir(mode=0o700)
    conf = write(folder / "m.conf", "Listen = 127.0.0.1:0", "RunAsUser = nobody", f"LogFolder = {private}/logs")
    assert check_file(conf).errors == [
        f"{conf}:3: LogFolder: {private}/logs: nobody (RunAsUser) cannot enter {private}"
    ]
    private.chmod(0o755)
    assert check_file(conf).errors == []


def test_listeners_sharing_a_port(folder: Path) -> None:
    port = free_port()
    conf = write(folder / "m.conf", f"Listen = 127.0.0.1:{port}", f"MonitorHTTP.Listen = *:{port}")
    assert check_file(conf).errors == [
        f"{conf}:2: MonitorHTTP.Listen: *:{port} overlaps Listen 127.0.0.1:{port}: one listener per address and port"
    ]
    conf = write(folder / "m.conf", f"Listen = 127.0.0.1:{port}", f"MonitorHTTP.Listen = 127.0.0.2:{port}")
    assert check_file(conf).errors == []


def test_a_port_in_use_is_a_warning_for_check_and_an_error_where_asked(folder: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        conf = write(
            folder / "m.conf", f"Listen = 127.0.0.1:{port}", f"LogFolder = {folder}/l", f"StateFolder = {folder}/s"
        )
        done = cli("config", "check", str(conf))
        assert (
            done.returncode == 0 and f"{conf}:1: Listen: warning: port {port} of 127.0.0.1 is in use now" in done.stderr
        )
        config = Config.from_file(conf)
        assert check(config, conf, in_use="error").errors == [
            f"{conf}:1: Listen: port {port} of 127.0.0.1 is in use now"
        ]
        assert check(config, conf, in_use="skip").findings == []


def test_a_seeds_consensus_port_in_use_is_named(folder: Path) -> None:
    """A Guaranteed seed also listens on its cluster port + 1 (Raft): taken, the seed would wait forever."""
    with _busy_port_after_a_free_one() as busy:
        raft = busy.getsockname()[1]
        members = f"127.0.0.1:{raft - 1}, 127.0.0.2:{raft - 1}, 127.0.0.3:{raft - 1}"
        conf = write(
            folder / "m.conf",
            f"Listen = 127.0.0.1:{free_port()}",
            f"ClusterMembers = {members}",
            f"ClusterMemberListen = 127.0.0.1:{raft - 1}",
            "ClusterPassword = a-password-long-enough",
            "ClusterDeliveryMode = Guaranteed",
            f"LogFolder = {folder}/l",
            f"StateFolder = {folder}/s",
        )
        found = check(Config.from_file(conf), conf, in_use="error").errors
        assert found == [
            f"{conf}:3: ClusterMemberListen: port {raft} of 127.0.0.1 is in use now"
            " (the seed members' consensus port: ClusterMemberListen's port + 1)"
        ], found


def _busy_port_after_a_free_one() -> socket.socket:
    """A listening socket whose port's predecessor is free (the check names only the port in use: a busy
    machine's other servers may hold the one before, which is not what this test is about)."""
    for _ in range(100):
        busy = socket.socket()
        busy.bind(("127.0.0.1", 0))
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", busy.getsockname()[1] - 1))
            except OSError:
                busy.close()
                continue
        busy.listen()
        return busy
    raise RuntimeError("no free port before a free port in 100 tries")


# --- safe by default: who may publish -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "warned"),
    [
        (["Listen = *:{port}"], True),
        (["Listen = *:{port}", "PublishAllowFromAddressList = 0.0.0.0/0"], True),
        (["Listen = *:{port}", "PublishAllowFromAddressList = 127.0.0.1, ::1"], False),
        (["Listen = *:{port}", "Entitlement = Basic", "EntitlementAllowToken = t0ken"], False),
        (["Listen = 127.0.0.1:{port}"], False),
    ],
)
def test_anyone_may_publish_is_a_warning_not_an_error(folder: Path, lines: list[str], warned: bool) -> None:
    port = free_port()
    conf = write(folder / "m.conf", *(line.format(port=port) for line in lines))
    done = cli("config", "check", str(conf))
    assert done.returncode == 0, done.stderr
    assert ("PublishAllowFromAddressList: warning: every address that reaches" in done.stderr) is warned, done.stderr
    assert "OK" in done.stdout


def test_repository_and_packaged_configurations_warn_about_nothing() -> None:
    spec = importlib.util.spec_from_file_location("build_packages", ROOT / "packaging" / "build_packages.py")
    assert spec is not None and spec.loader is not None
    build_packages = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_packages", build_packages)  # its dataclasses look their module up
    spec.loader.exec_module(build_packages)
    packaged_conf = build_packages.packaged_conf
    packaged = Config.from_text(packaged_conf(), "packaged.conf")
    assert packaged.publish_allow_from == ("127.0.0.1", "::1")
    assert [str(e) for e in packaged.monitor_listen] == ["127.0.0.1:9900"]
    assert [str(e) for e in packaged.listen] == ["*:8800"]
    report = check(packaged, "packaged.conf", lines=KeyLines(packaged_conf()))
    assert report.warnings == [], report.warnings
    repo = check_file(ROOT / "conf" / "migratorydata.conf", in_use="skip")
    assert repo.warnings == [] and repo.config is not None
    assert repo.config.publish_allow_from == ("127.0.0.1", "::1")


# --- the CLI around it ---------------------------------------------------------------------------------------


def test_version_and_help_texts_match_the_arguments() -> None:
    version = cli("--version")
    assert version.returncode == 0 and re.fullmatch(r"migratory \S+\n", version.stdout), version.stdout
    serve = cli("serve", "--help").stdout
    assert "--config/-c" in serve and "CONFIG" not in serve
    check_help = cli("config", "check", "--help").stdout
    assert "FILE" in check_help and "Check FILE" in check_help
    cert = cli("cert", "check", "--help").stdout
    assert "TLSCertificate, TLSKey and TLSKeyPassword" in cert


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_tiers(tmp_path: Path) -> None:
    """`make run` installs the server only; `make check` leaves out the VM, Spark, packaging and cluster tiers."""

    def recipe(target: str) -> str:
        done = subprocess.run(
            ["make", "-n", "-B", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    run = recipe("run")
    assert "pip install -q -e .\n" in run and "[dev" not in run and "spark" not in run
    check = recipe("check")
    assert "'.[dev,spark]'" in check and "ruff check" in check and "mypy" in check
    assert '-m "not slow and not packaging and not image and not spark"' in check
    assert "--ignore=tests/test_packaging.py" in check and "--ignore=tests/test_spark.py" in check
    test = recipe("test")
    assert "bash .ci/deps.sh" in test  # everything, the README's one command
    assert f"bash tools/test_beside.sh {tmp_path / 'venv'}/bin/pytest\n" in test


@pytest.mark.parametrize(
    ("rest", "packaging", "status"),
    [(0, 0, 0), (1, 0, 1), (0, 1, 1), (5, 0, 5), (0, 5, 5), (2, 1, 2)],
)
def test_make_test_runs_every_test_once_and_fails_if_either_half_fails(
    tmp_path: Path, rest: int, packaging: int, status: int
) -> None:
    """tools/test_beside.sh: the packaging tests in one pytest, everything else in another (together the
    whole suite, nothing twice); the first failing run's status is the script's (5: a half that collected
    nothing), and the packaging run's report is printed."""
    calls = tmp_path / "calls"
    fake = tmp_path / "pytest"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {calls}\n'
        'case "$*" in *--ignore=tests/test_packaging.py*) exit "$REST" ;; esac\n'
        'echo "the packaging report"\n'
        'exit "$PACKAGING"\n'
    )
    fake.chmod(0o755)
    env = dict(os.environ, REST=str(rest), PACKAGING=str(packaging), TMPDIR=str(tmp_path))
    done = subprocess.run(
        ["bash", str(ROOT / "tools" / "test_beside.sh"), str(fake), "-x"], capture_output=True, text=True, env=env
    )
    assert done.returncode == status, done.stdout + done.stderr
    runs = sorted(calls.read_text().splitlines())
    assert runs == ["-q -p no:cacheprovider -x tests/test_packaging.py", "-q -x --ignore=tests/test_packaging.py"], runs
    assert "the packaging report" in done.stdout and f"exit {packaging})" in done.stdout
    assert not list(tmp_path.glob("packaging-tests.*"))  # its log is printed, then removed
