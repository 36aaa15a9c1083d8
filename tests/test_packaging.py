"""The DEB (and RPM) built for real and installed into a Debian bookworm chroot made by debootstrap.

One session builds the packages (packaging/build_packages.py, as `make deb`/`make rpm` do); each
scenario gets a fresh copy of a cached debootstrap tree (/var/cache/migratorydata-test), installs
with `apt-get install ./migratorydata_<version>_<arch>.deb` as a user would, and checks what the
issue promises: files, owners and modes, the system user, `migratory config check`, the unit's
ExecStart run as that user with the unit's one capability on a privileged port and serving a
subscribe/publish round trip, `systemd-analyze verify`, conffile kept on upgrade, user gone on purge.
No systemd runs here, so the unit's commands are started the way systemd would: setpriv with the
unit's User, Group and AmbientCapabilities.

The repositories (packaging/build_repo.py, `make repo`) are served on 127.0.0.1 by an http.server
of this module: apt-get installs migratorydata and migratorydata-analytics from the signed apt
repository (and refuses a tampered package and a repository signed by another key), apt-get
upgrade keeps an edited configuration, dnf --installroot installs both from the signed yum
repository; in each chroot the packaged server runs as its user and `migratory logs analyze`
reads its logs as that user.

Every test's pytest timeout is the sum of the step timeouts it may wait for (a session fixture's
build counts in the first test that uses it), so a cold cache on a slow machine fails a step with
its own message rather than the whole test at an arbitrary point.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import http.server
import importlib.util
import io
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from migratory.client import MigratoryClient
from migratory.protocol import Status
from tests.conftest import free_port, wait_for_port

# Step timeouts (seconds): several times what each takes on a loaded 2-core machine with a cold
# cache, so a slow machine passes and a stuck step fails with its own message (sh: the command and
# the end of its output). A test's pytest timeout is the sum of the steps it may wait for, session
# fixtures included, capped so that a hang is reported well inside a 90-minute CI run.
BUILD_TIMEOUT = 900  # build_packages.py: the core venv from PyPI, DEB, RPM (about 2 min warm)
ANALYTICS_BUILD_TIMEOUT = 1800  # the core staged again, PySpark and its dependencies, two 0.9 GB packages
ROOTFS_TIMEOUT = 1200  # debootstrap of the test chroot, once per cache
APT_TIMEOUT = 600  # apt-get update and install from Debian's mirror (Java 17 for the analytics)
ANALYSIS_TIMEOUT = 600  # `migratory logs analyze`: JVM start and the report
BASE_IMAGE_TIMEOUT = 1200  # images/base_image.py: debootstrap with a kernel, mkfs, extlinux, once per cache
KVM_PROBE_TIMEOUT = 90  # build_image.kvm_boots: a throwaway KVM boot of the base image
PACKER_TIMEOUT = 1500  # packer build: boot the base disk, install the DEB, shut down (TCG: about 4 min)
BOOT_TIMEOUT = 600  # the built image until /health answers (TCG: about 1 min)
MARGIN = 300
TEST_CAP = 2700  # no test waits longer than 45 minutes


def budget(*steps: int) -> int:
    return min(sum(steps) + MARGIN, TEST_CAP)


TEST_TIMEOUT = budget(BUILD_TIMEOUT, BUILD_TIMEOUT, ROOTFS_TIMEOUT, APT_TIMEOUT)
REPO_TEST_TIMEOUT = budget(
    BUILD_TIMEOUT, ANALYTICS_BUILD_TIMEOUT, ROOTFS_TIMEOUT, APT_TIMEOUT, APT_TIMEOUT, ANALYSIS_TIMEOUT
)
REPO_UPGRADE_TEST_TIMEOUT = budget(
    BUILD_TIMEOUT, BUILD_TIMEOUT, ANALYTICS_BUILD_TIMEOUT, ROOTFS_TIMEOUT, 4 * APT_TIMEOUT
)
IMAGE_TEST_TIMEOUT = budget(BUILD_TIMEOUT, BASE_IMAGE_TIMEOUT, KVM_PROBE_TIMEOUT, PACKER_TIMEOUT, BOOT_TIMEOUT)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.packaging,
    pytest.mark.timeout(TEST_TIMEOUT),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("debootstrap") is None or shutil.which("dpkg-deb") is None,
        reason="needs root, dpkg-deb and debootstrap (.ci/deps.sh)",
    ),
]

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "packaging" / "build_packages.py"
CACHE = Path(os.environ.get("MIGRATORY_TEST_CACHE", "/var/cache/migratorydata-test"))
# What the chroot has besides minbase: the package's interpreter, and systemd for `systemd-analyze --root`.
ROOTFS_PACKAGES = ["python3.11", "systemd", "procps"]
ROOTFS = CACHE / f"bookworm-minbase-{'-'.join(ROOTFS_PACKAGES)}.tar"
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
CONF = "/etc/migratorydata/migratorydata.conf"
UNIT = "/lib/systemd/system/migratorydata.service"
RPM_UNIT = "/usr/lib/systemd/system/migratorydata.service"
APT_CACHE = CACHE / "apt-archives"  # .debs downloaded in the chroots (Java), kept between runs
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
UPGRADE_VERSION = f"{VERSION}+1"
CAP_NET_BIND_SERVICE = 1 << 10


def tail(text: str, chars: int = 4000) -> str:
    """The end of a command's output or a console log, without its terminal colours."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    return text if len(text) <= chars else f"[... {len(text) - chars} characters before]\n{text[-chars:]}"


def sh(*args: str, check: bool = True, timeout: float = 600, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """args run in a process group of their own, stdin empty.

    On its timeout, or the test's (pytest-timeout), the whole group is killed, Packer's qemu and
    apt's children included, and a timeout fails with the command and the end of its output.
    """
    proc = subprocess.Popen(  # type: ignore[call-overload]
        list(args),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as err:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # something outside the group holds the pipes
            proc.kill()
            stdout, stderr = "", "(output lost: the pipes stayed open after the process group was killed)"
        if isinstance(err, subprocess.TimeoutExpired):
            raise AssertionError(
                f"{shlex.join(args)} timed out after {timeout:.0f} s:\n{tail(stdout)}\n{tail(stderr)}"
            ) from None
        # the test's own timeout (or ^C): pytest shows this captured output with the failure
        print(f"{shlex.join(args)} interrupted:\n{tail(stdout)}\n{tail(stderr)}", file=sys.stderr)
        raise
    done = subprocess.CompletedProcess(list(args), proc.returncode, stdout, stderr)
    if check and done.returncode != 0:
        raise AssertionError(f"{shlex.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


@dataclass(frozen=True)
class Built:
    deb: Path
    rpm: Path | None
    work: Path

    @property
    def out(self) -> Path:
        return self.deb.parent


# The build's default SOURCE_DATE_EPOCH is the last commit's time; read once, so a commit made while
# the suite runs cannot make two builds of this session differ.
EPOCH = int(sh("git", "-C", str(ROOT), "log", "-1", "--format=%ct").stdout) if (ROOT / ".git").exists() else 0


def build(out: Path, work: Path, what: str, version: str | None = None, timeout: float = BUILD_TIMEOUT) -> list[Path]:
    args = [sys.executable, str(BUILD), what, "--out", str(out), "--work", str(work)]
    if version:
        args += ["--version", version]
    done = sh(*args, timeout=timeout, env=dict(os.environ, SOURCE_DATE_EPOCH=str(EPOCH)))
    return [Path(line) for line in done.stdout.split()]


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The DEB (and the RPM where rpmbuild exists) of this checkout, built once per session."""
    base = tmp_path_factory.mktemp("pkg")
    what = "all" if shutil.which("rpmbuild") else "deb"
    paths = build(base / "out", base / "work", what)
    deb = next(p for p in paths if p.suffix == ".deb")
    rpm = next((p for p in paths if p.suffix == ".rpm"), None)
    return Built(deb, rpm, base / "work")


@pytest.fixture(scope="session")
def upgrade(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The same tree as version UPGRADE_VERSION: what an upgrade installs."""
    base = tmp_path_factory.mktemp("pkg-upgrade")
    paths = build(base / "out", base / "work", "all" if shutil.which("rpmbuild") else "deb", UPGRADE_VERSION)
    deb = next(p for p in paths if p.suffix == ".deb")
    return Built(deb, next((p for p in paths if p.suffix == ".rpm"), None), base / "work")


@pytest.fixture(scope="session")
def analytics(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """migratorydata-analytics, DEB and RPM (rpmbuild permitting), of this checkout."""
    base = tmp_path_factory.mktemp("pkg-analytics")
    what = "analytics" if shutil.which("rpmbuild") else "analytics-deb"
    paths = build(base / "out", base / "work", what, timeout=ANALYTICS_BUILD_TIMEOUT)
    deb = next(p for p in paths if p.suffix == ".deb")
    return Built(deb, next((p for p in paths if p.suffix == ".rpm"), None), base / "work")


def rootfs_tarball() -> Path:
    """A debootstrap'ed bookworm (minbase + ROOTFS_PACKAGES), made once and kept as a tarball in CACHE."""
    if ROOTFS.exists():
        return ROOTFS
    CACHE.mkdir(parents=True, exist_ok=True)
    target = CACHE / f"rootfs.{os.getpid()}"
    shutil.rmtree(target, ignore_errors=True)
    include = ",".join(ROOTFS_PACKAGES)
    sh(
        *("debootstrap", "--variant=minbase", f"--include={include}", "bookworm", str(target), MIRROR),
        timeout=ROOTFS_TIMEOUT,
    )
    partial = ROOTFS.with_suffix(f".{os.getpid()}.partial")
    sh("tar", "-C", str(target), "--numeric-owner", "-cf", str(partial), ".")
    partial.rename(ROOTFS)
    shutil.rmtree(target)
    return ROOTFS


class Chroot:
    """A fresh bookworm tree with /proc mounted; `run` executes inside it as root."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True)
        sh("tar", "-C", str(root), "--numeric-owner", "-xf", str(rootfs_tarball()))
        sh("mount", "-t", "proc", "proc", str(root / "proc"))
        self.mounts = [root / "proc"]
        shutil.copy2("/etc/resolv.conf", root / "etc/resolv.conf")  # apt reaches Debian's mirror by name
        # as on an installed machine (debootstrap writes none): localhost and this host's name resolve
        hosts = f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n::1 localhost ip6-localhost ip6-loopback\n"
        (root / "etc/hosts").write_text(hosts)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.apt_cached = False

    def run(
        self, *cmd: str, check: bool = True, timeout: float = 300, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        base = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}
        base["DEBIAN_FRONTEND"] = "noninteractive"
        return sh("chroot", str(self.root), *cmd, check=check, timeout=timeout, env={**base, **(env or {})})

    def cache_apt(self) -> None:
        """Debian's packages that earlier chroots and runs downloaded (Java) start in this one's apt cache,
        and what it downloads is kept for the next (close). Copied, not a shared folder: apt-get locks
        its cache, and another session's apt-get (another job on the machine) would hold that lock."""
        APT_CACHE.mkdir(parents=True, exist_ok=True)
        for deb in APT_CACHE.glob("*.deb"):
            if not deb.name.startswith("migratorydata"):  # the cache keeps Debian's packages, not a build's
                shutil.copy2(deb, self.path("/var/cache/apt/archives") / deb.name)
        self.apt_cached = True

    def path(self, inside: str) -> Path:
        return self.root / inside.lstrip("/")

    def install(self, deb: Path) -> subprocess.CompletedProcess[str]:
        """`apt-get install ./file.deb`, the command the documentation gives."""
        shutil.copy2(deb, self.path("/root") / deb.name)
        return self.run("sh", "-c", f"cd /root && apt-get install -y -q ./{deb.name}")

    def uid(self, user: str) -> int:
        return int(self.run("id", "-u", user).stdout)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.apt_cached:
            for deb in self.path("/var/cache/apt/archives").glob("*.deb"):
                kept = APT_CACHE / deb.name
                if not deb.name.startswith("migratorydata") and not kept.exists():
                    partial = kept.with_suffix(f".{os.getpid()}.partial")  # never a half-copied .deb in the cache
                    shutil.copy2(deb, partial)
                    partial.rename(kept)
        for mount in reversed(self.mounts):
            sh("umount", "-l", str(mount), check=False)
        if not any(os.path.ismount(mount) for mount in self.mounts):  # never delete through a mount
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def chroot(tmp_path: Path) -> Iterator[Chroot]:
    box = Chroot(tmp_path / "root")
    yield box
    box.close()


@pytest.fixture(scope="module")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chroot]:
    """One chroot with the DEB installed, shared by the read-mostly checks of this module."""
    box = Chroot(tmp_path_factory.mktemp("installed") / "root")
    try:
        box.install(built.deb)
        yield box
    finally:
        box.close()


def unit_directives(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def as_unit_user(directives: dict[str, list[str]], command: str) -> list[str]:
    """The unit's command run the way systemd runs it: User, Group, AmbientCapabilities, NoNewPrivileges."""
    caps = ",".join("+" + cap.lower().removeprefix("cap_") for cap in directives["AmbientCapabilities"][0].split())
    user, group = directives["User"][0], directives["Group"][0]
    prefix = ["setpriv", f"--reuid={user}", f"--regid={group}", "--init-groups"]
    prefix += [f"--inh-caps={caps}", f"--ambient-caps={caps}", f"--bounding-set=-all,{caps}"]
    if directives.get("NoNewPrivileges") == ["true"]:
        prefix.append("--no-new-privs")
    return prefix + shlex.split(command)


def status_field(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {name} in /proc/{pid}/status")


# --- the package files -------------------------------------------------------------------------------


def test_deb_control_and_conffiles(built: Built) -> None:
    fields = {f: sh("dpkg-deb", "-f", str(built.deb), f).stdout.strip() for f in ("Package", "Version", "Depends")}
    assert fields["Package"] == "migratorydata"
    assert fields["Version"] == VERSION
    assert "python3.11" in fields["Depends"]
    arch = sh("dpkg", "--print-architecture").stdout.strip()
    assert built.deb.name == f"migratorydata_{VERSION}_{arch}.deb"
    control = subprocess.run(["dpkg-deb", "--ctrl-tarfile", str(built.deb)], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(control)) as ctrl:
        conffiles = ctrl.extractfile("./conffiles")
        assert conffiles is not None and conffiles.read().decode().split() == [CONF]
        for script in ("./postinst", "./prerm", "./postrm"):
            assert ctrl.getmember(script).mode & 0o111


def test_deb_payload_owners_modes_and_times(built: Built) -> None:
    """Everything root-owned, modes normalised, every mtime the commit's time: reproducible input to dpkg-deb."""
    payload = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(built.deb)], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
        members = {m.name.removeprefix("."): m for m in tar}
        shebang = tar.extractfile("./opt/migratorydata/bin/migratory")
        assert shebang is not None and shebang.readline() == b"#!/opt/migratorydata/bin/python\n"
    assert {m.mtime for m in members.values()} == {EPOCH}
    assert {(m.uid, m.gid) for m in members.values()} == {(0, 0)}
    for path in ("/opt/migratorydata/bin/migratory", "/opt/migratorydata/bin/python"):
        assert path in members
    assert members["/opt/migratorydata/bin/migratory"].mode == 0o755
    assert members[CONF].mode == 0o644  # 0640 root:migratorydata comes from dpkg-statoverride in postinst
    assert members["/usr/bin/migratory"].issym() and members["/usr/bin/migratory"].linkname == (
        "/opt/migratorydata/bin/migratory"
    )
    assert members[UNIT].isfile() and "/usr/share/man/man1/migratory.1.gz" in members
    assert not [n for n in members if "migratory_spark" in n or "pyspark" in n]  # no spark extra
    # hash-based byte code for the server, so a user without write access to /opt loads it as shipped
    assert "/opt/migratorydata/lib/python3.11/site-packages/migratory/__pycache__/config.cpython-311.pyc" in members


def test_a_missing_build_tool_is_named_with_its_package(tmp_path: Path) -> None:
    """`make rpm` or `make repo` on a machine without rpmbuild, createrepo_c ...: what to install, no traceback."""
    bare = dict(os.environ, PATH=str(tmp_path))  # no tool at all on the PATH
    rpm = sh(sys.executable, str(BUILD), "rpm", "--work", str(tmp_path / "w"), check=False, env=bare)
    assert rpm.returncode == 2 and "Traceback" not in rpm.stderr, rpm.stderr
    assert "rpmbuild not found (builds the RPM): install it with `apt-get install rpm`" in rpm.stderr
    assert "`dnf install rpm-build`" in rpm.stderr and not (tmp_path / "w").exists()  # nothing built first
    repo = sh(sys.executable, str(ROOT / "packaging" / "build_repo.py"), "--check-tools", check=False, env=bare)
    assert repo.returncode == 2 and "Traceback" not in repo.stderr, repo.stderr
    for tool, package in [("gpg", "gnupg"), ("apt-ftparchive", "apt-utils"), ("createrepo_c", "createrepo-c")]:
        assert f"build_repo: {tool} not found" in repo.stderr and f"apt-get install {package}`" in repo.stderr
    assert sh(sys.executable, str(ROOT / "packaging" / "build_repo.py"), "--check-tools").returncode == 0


def test_deb_is_reproducible(built: Built, tmp_path: Path) -> None:
    again = build(tmp_path / "out", tmp_path / "work", "deb")[0]
    assert again.name == built.deb.name
    assert hashlib.sha256(again.read_bytes()).hexdigest() == hashlib.sha256(built.deb.read_bytes()).hexdigest()


# --- installed ------------------------------------------------------------------------------------------


def test_installed_files_owners_and_modes(installed: Chroot) -> None:
    uid, gid = installed.uid("migratorydata"), int(installed.run("id", "-g", "migratorydata").stdout)
    conf = installed.path(CONF).stat()
    assert (conf.st_uid, conf.st_gid, conf.st_mode & 0o7777) == (0, gid, 0o640)
    for folder in ("/var/log/migratorydata", "/var/lib/migratorydata"):
        st = installed.path(folder).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (uid, gid, 0o750), folder
    opt = installed.path("/opt/migratorydata/bin/migratory").stat()
    assert (opt.st_uid, opt.st_mode & 0o7777) == (0, 0o755)
    text = installed.path(CONF).read_text()
    for line in (
        "Listen = *:8800",
        "ListenMqtt = *:1883",  # MQTT on the standard port
        "LogFolder = /var/log/migratorydata",
        "StateFolder = /var/lib/migratorydata",
        "MonitorHTTP.Listen = 127.0.0.1:9900",  # monitoring for this machine only
        "PublishAllowFromAddressList = 127.0.0.1, ::1",  # publishing from this machine only, until opened
    ):
        assert f"\n{line}\n" in text
    assert "add their addresses or networks (PublishAllowFromAddressList =" in text  # how to open it
    assert "#Workers = auto" in text  # the rest is the repository's file, comments included
    assert installed.run("sh", "-c", "command -v migratory").stdout.strip() == "/usr/bin/migratory"
    assert installed.path("/usr/share/man/man1/migratory.1.gz").exists()
    # enabled the Debian way, for the boot of a machine where systemd runs
    wants = installed.path("/etc/systemd/system/multi-user.target.wants/migratorydata.service")
    assert wants.is_symlink() and os.readlink(wants) == UNIT


def test_system_user(installed: Chroot) -> None:
    _, _, uid, gid, _, home, shell = installed.run("getent", "passwd", "migratorydata").stdout.strip().split(":")
    assert int(uid) < 1000 and home == "/var/lib/migratorydata" and shell == "/usr/sbin/nologin"
    assert installed.run("getent", "group", "migratorydata").stdout.split(":")[2] == gid


def test_the_packaged_server_seals_tls_records_in_c(installed: Chroot) -> None:
    """The package's build compiled migratory/server/transport/_tlsseal.c, and it binds to the chroot's libcrypto."""
    probe = (
        "from migratory.server.transport.tls import c_sealer\n"
        "sealer = c_sealer()\n"
        "assert sealer is not None, 'no C sealer'\n"
        "print(len(sealer(bytes(16), bytes(12)).seal(1, b'x\\x17', bytes((23, 3, 3, 0, 18)))))\n"
    )
    assert installed.run("/opt/migratorydata/bin/python", "-c", probe).stdout.strip() == "23"


def test_help_and_man_page_cover_every_command(installed: Chroot) -> None:
    help_text = installed.run("migratory", "--help").stdout
    page = installed.run("sh", "-c", "zcat /usr/share/man/man1/migratory.1.gz").stdout
    for command in ("serve", "config", "publish", "subscribe", "snapshot", "bench", "cert"):
        assert command in help_text
    for command in ("serve", "config check", "publish", "subscribe", "snapshot", "bench run", "cert issue"):
        assert f".SS migratory {command}" in page, command


def test_config_check_as_the_service_user(installed: Chroot) -> None:
    directives = unit_directives(installed.path(UNIT).read_text())
    pre = installed.run(*as_unit_user(directives, directives["ExecStartPre"][0]))
    assert "OK" in pre.stdout and "warning" not in pre.stdout + pre.stderr, pre.stdout + pre.stderr
    assert installed.run("migratory", "--version").stdout.strip() == f"migratory {VERSION}"
    broken = installed.path("/root/broken.conf")
    broken.write_text("Listen = 127.0.0.1:8800\nWorkers = lots\n")
    bad = installed.run("migratory", "config", "check", "/root/broken.conf", check=False)
    assert bad.returncode == 2 and "/root/broken.conf:2: Workers:" in bad.stdout + bad.stderr


def test_systemd_analyze_verify(installed: Chroot) -> None:
    """The unit as installed: every directive known, every command present, in the installed tree."""
    done = sh("systemd-analyze", "verify", "--man=no", f"--root={installed.root}", "migratorydata.service", check=False)
    assert done.returncode == 0, done.stderr
    assert "migratorydata.service" not in done.stderr, done.stderr
    security = sh("systemd-analyze", "security", "--offline=true", f"--root={installed.root}", "migratorydata.service")
    level = float(security.stdout.split("Overall exposure level for migratorydata.service:")[1].split()[0])
    assert level <= 2.5, security.stdout


def serve_as_unit(box: Chroot, unit: str = UNIT, port: int = 80) -> tuple[subprocess.Popen[bytes], str]:
    """The unit's ExecStartPre, then ExecStart as systemd would run them, on a loopback address of its own.

    Listen, ListenMqtt and MonitorHTTP.Listen are moved to a random 127.x.y.z (other suites use the usual ports);
    the rest of the installed configuration stays. Returns the server process and its host.
    """
    directives = unit_directives(box.path(unit).read_text())
    host = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(2, 254)}"
    conf = box.path(CONF)
    text = conf.read_text().replace("\nListen = *:8800\n", f"\nListen = {host}:{port}\n")
    text = text.replace("\nListenMqtt = *:1883\n", f"\nListenMqtt = {host}:1883\n")
    conf.write_text(text.replace("\nMonitorHTTP.Listen = 127.0.0.1:9900\n", f"\nMonitorHTTP.Listen = {host}:9900\n"))
    pre = box.run(*as_unit_user(directives, directives["ExecStartPre"][0]))
    assert "OK" in pre.stdout and "warning" not in pre.stdout + pre.stderr, pre.stdout + pre.stderr
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}
    for item in directives.get("Environment", []):
        key, value = item.split("=", 1)
        env[key] = value
    start = ["chroot", str(box.root), *as_unit_user(directives, directives["ExecStart"][0])]
    proc = subprocess.Popen(start, stderr=subprocess.PIPE, env=env, start_new_session=True)
    box.procs.append(proc)
    wait_for_port(host, port, timeout=60, proc=proc)
    return proc, host


def round_trip(url: str, subject: str, payload: bytes, timeout: float = 10) -> bytes:
    async def exchange() -> bytes:
        async with MigratoryClient([url]) as subscriber, MigratoryClient([url]) as publisher:
            assert await subscriber.subscribe([subject]) == {subject: Status.OK}
            # The publisher's worker may not have heard of the other worker's new subscriber yet (counts
            # travel once per loop turn): NO_SUBSCRIBER then, and the message is delivered all the same.
            assert await publisher.publish(subject, payload) in (Status.OK, Status.NO_SUBSCRIBER)
            return (await subscriber.next_message(timeout)).content

    return asyncio.run(exchange())


def wait_logged(box: Chroot, subject: str) -> Path:
    logs = box.path("/var/log/migratorydata")
    deadline = time.monotonic() + 5  # logs are flushed once a second
    while subject not in (logs / "message.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert subject in (logs / "message.log").read_text(), sorted(p.name for p in logs.iterdir())
    return logs


def test_service_runs_as_user_on_privileged_port(installed: Chroot) -> None:
    """The unit's ExecStart as systemd would run it: the user, only CAP_NET_BIND_SERVICE, port 80, a round trip."""
    proc, host = serve_as_unit(installed)
    uid = installed.uid("migratorydata")
    pids = [proc.pid, *(int(p) for p in sh("pgrep", "-P", str(proc.pid)).stdout.split())]
    assert len(pids) >= 2  # the supervisor and its workers
    for pid in pids:
        assert status_field(pid, "Uid").split() == [str(uid)] * 4
        assert int(status_field(pid, "CapEff"), 16) == CAP_NET_BIND_SERVICE
        assert int(status_field(pid, "CapBnd"), 16) == CAP_NET_BIND_SERVICE
    assert round_trip(f"ws://{host}:80", "/pkg/test", b"from the package") == b"from the package"
    with urllib.request.urlopen(f"http://{host}:9900/health", timeout=10) as answer:  # monitoring, as packaged
        assert b'"status"' in answer.read()
    logs = wait_logged(installed, "/pkg/test")
    assert (logs / "message.log").stat().st_uid == uid
    proc.send_signal(signal.SIGHUP)  # ExecReload: no TLS configured, so nothing to reload, and nobody restarted
    time.sleep(1.5)
    assert sorted(int(p) for p in sh("pgrep", "-P", str(proc.pid)).stdout.split()) == sorted(pids[1:])
    wait_for_port(host, 80, timeout=5, proc=proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


# --- upgrade and purge -------------------------------------------------------------------------------------


def test_upgrade_keeps_edited_conffile(built: Built, upgrade: Built, chroot: Chroot) -> None:
    chroot.install(built.deb)
    conf = chroot.path(CONF)
    conf.write_text(conf.read_text().replace("#LogLevel = INFO", "LogLevel = DEBUG"))
    out = chroot.install(upgrade.deb)
    assert "Setting up migratorydata" in out.stdout
    assert chroot.run("dpkg-query", "-W", "-f=${Version}", "migratorydata").stdout == UPGRADE_VERSION
    assert "\nLogLevel = DEBUG\n" in conf.read_text()
    assert not chroot.path(CONF + ".dpkg-dist").exists()
    gid = int(chroot.run("id", "-g", "migratorydata").stdout)
    assert (conf.stat().st_gid, conf.stat().st_mode & 0o777) == (gid, 0o640)
    chroot.run("migratory", "config", "check", CONF)


def test_remove_keeps_and_purge_removes_user_and_data(built: Built, chroot: Chroot) -> None:
    chroot.install(built.deb)
    chroot.path("/var/log/migratorydata/server.log").write_text("{}\n")
    chroot.run("dpkg", "--remove", "migratorydata")
    assert chroot.run("getent", "passwd", "migratorydata", check=False).returncode == 0
    assert chroot.path(CONF).exists() and not chroot.path("/opt/migratorydata").exists()
    chroot.run("dpkg", "--purge", "migratorydata")
    assert chroot.run("getent", "passwd", "migratorydata", check=False).returncode == 2
    assert chroot.run("getent", "group", "migratorydata", check=False).returncode == 2
    for gone in ("/etc/migratorydata", "/var/log/migratorydata", "/var/lib/migratorydata", "/opt/migratorydata"):
        assert not chroot.path(gone).exists(), gone
    assert "migratorydata" not in chroot.run("dpkg-statoverride", "--list", check=False).stdout
    assert not chroot.path("/etc/systemd/system/multi-user.target.wants/migratorydata.service").exists()


# --- RPM ------------------------------------------------------------------------------------------------------


def rpm_query(rpm: Path, *args: str) -> str:
    return sh("rpm", "-qp", *args, str(rpm)).stdout


def test_rpm_contents_and_scriptlets(built: Built) -> None:
    assert built.rpm is not None, "rpmbuild missing: .ci/deps.sh installs Debian's rpm"
    assert rpm_query(built.rpm, "--qf", "%{NAME} %{VERSION} %{ARCH}") == f"migratorydata {VERSION} x86_64"
    files = rpm_query(built.rpm, "-l").split()
    for path in (
        "/opt/migratorydata/bin/migratory",
        "/usr/bin/migratory",
        "/usr/lib/systemd/system/migratorydata.service",
    ):
        assert path in files
    assert rpm_query(built.rpm, "-c").split() == [CONF]
    flags = rpm_query(built.rpm, "--qf", "[%{FILEFLAGS:fflags} %{FILENAMES}\n]").splitlines()
    assert f"cn {CONF}" in flags  # %config(noreplace): an edited file is never overwritten (.rpmnew instead)
    listing = rpm_query(built.rpm, "--qf", "[%{FILENAMES} %{FILEUSERNAME} %{FILEGROUPNAME} %{FILEMODES:perms}\n]")
    owners = {line.split()[0]: line.split()[1:] for line in listing.splitlines()}
    assert owners[CONF] == ["root", "migratorydata", "-rw-r-----"]
    assert owners["/var/log/migratorydata"] == ["migratorydata", "migratorydata", "drwxr-x---"]
    scripts = rpm_query(built.rpm, "--scripts")
    assert "useradd -r -g migratorydata" in scripts and "systemctl --no-reload preset" in scripts
    assert "python3.11" in rpm_query(built.rpm, "--requires")


def test_rpm_installs_with_scriptlets_into_a_root(built: Built, chroot: Chroot) -> None:
    """`rpm --root` with its scriptlets (the %pre creates the user), into the bookworm tree."""
    assert built.rpm is not None
    sh("rpm", "--root", str(chroot.root), "--initdb")
    sh("rpm", "--root", str(chroot.root), "-i", "--nodeps", str(built.rpm))
    assert chroot.run("getent", "passwd", "migratorydata").stdout.split(":")[5] == "/var/lib/migratorydata"
    uid, gid = chroot.uid("migratorydata"), int(chroot.run("id", "-g", "migratorydata").stdout)
    conf = chroot.path(CONF).stat()
    assert (conf.st_uid, conf.st_gid, conf.st_mode & 0o7777) == (0, gid, 0o640)
    logs = chroot.path("/var/log/migratorydata").stat()
    assert (logs.st_uid, logs.st_mode & 0o7777) == (uid, 0o750)
    assert chroot.path("/usr/lib/systemd/system/migratorydata.service").is_file()
    check = chroot.run("runuser", "-u", "migratorydata", "--", "migratory", "config", "check", CONF)
    assert "OK" in check.stdout + check.stderr
    # every file as packaged (dependencies are Debian's here, not in the RPM database)
    assert sh("rpm", "--root", str(chroot.root), "-V", "--nodeps", "migratorydata", check=False).stdout == ""


# --- the VM image: Packer template and wrapper ----------------------------------------------------------------

IMAGE_WRAPPER = ROOT / "images" / "build_image.py"


@pytest.fixture(scope="module")
def image_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A qcow2 (empty: validation does not boot it) and an SSH key, what the wrapper checks besides the DEB."""
    base = tmp_path_factory.mktemp("image")
    sh("qemu-img", "create", "-q", "-f", "qcow2", str(base / "base.qcow2"), "1G")
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(base / "packer_ed25519"))
    return base / "base.qcow2", base / "packer_ed25519"


def wrapper(*args: str) -> subprocess.CompletedProcess[str]:
    return sh(sys.executable, str(IMAGE_WRAPPER), *args, check=False, timeout=120)


@pytest.mark.skipif(shutil.which("packer") is None, reason="needs packer (.ci/deps.sh)")
def test_packer_validate_through_the_wrapper(built: Built, image_inputs: tuple[Path, Path], tmp_path: Path) -> None:
    base, key = image_inputs
    common = ["--base", str(base), "--deb", str(built.deb), "--ssh-key", str(key)]
    done = wrapper("validate", *common)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "image ports: [1883, 8800]" in done.stderr  # the packaged Listen and ListenMqtt; not the monitoring
    conf = tmp_path / "appliance.conf"
    conf.write_text("Listen = *:80\nListenEncrypted = none\nMonitorHTTP.Listen = 10.0.0.5:8801\n")
    custom = wrapper("validate", *common, "--config", str(conf))
    assert custom.returncode == 0 and "image ports: [80, 8801]" in custom.stderr, custom.stderr


@pytest.mark.skipif(shutil.which("packer") is None, reason="needs packer (.ci/deps.sh)")
@pytest.mark.timeout(REPO_TEST_TIMEOUT)
def test_packer_validate_with_the_analytics(
    built: Built, analytics: Built, image_inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    """The image build variable analytics_deb: the wrapper checks the DEB and Packer accepts the template."""
    base, key = image_inputs
    common = ["--base", str(base), "--deb", str(built.deb), "--ssh-key", str(key)]
    done = wrapper("validate", *common, "--analytics-deb", str(analytics.deb))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "with analytics" in done.stderr
    wrong = wrapper("validate", *common, "--analytics-deb", str(built.deb))
    assert wrong.returncode == 2 and "expected migratorydata-analytics" in wrong.stderr


def test_image_wrapper_refuses_bad_inputs(built: Built, image_inputs: tuple[Path, Path], tmp_path: Path) -> None:
    base, key = image_inputs
    broken = tmp_path / "broken.conf"
    broken.write_text("Listen = *:8800\nWorkers = lots\n")
    bad_conf = wrapper(
        "validate", "--base", str(base), "--deb", str(built.deb), "--ssh-key", str(key), "--config", str(broken)
    )
    assert bad_conf.returncode == 2 and f"{broken}:2: Workers:" in bad_conf.stderr
    not_qcow = tmp_path / "disk.raw"
    not_qcow.write_bytes(b"\0" * 4096)
    bad_base = wrapper("validate", "--base", str(not_qcow), "--deb", str(built.deb), "--ssh-key", str(key))
    assert bad_base.returncode == 2 and "not a qcow2 image" in bad_base.stderr
    bad_deb = wrapper("validate", "--base", str(base), "--deb", str(broken), "--ssh-key", str(key))
    assert bad_deb.returncode == 2 and "not a Debian package" in bad_deb.stderr


# --- the VM image, built and booted -------------------------------------------------------------------------

BASE_IMAGE_SCRIPT = ROOT / "images" / "base_image.py"


def image_accelerator(base: Path) -> str:
    """The wrapper's own choice: kvm where KVM boots the base image here, else tcg; MIGRATORY_IMAGE_ACCEL overrides."""
    forced = os.environ.get("MIGRATORY_IMAGE_ACCEL", "auto")
    if forced != "auto":
        return forced
    spec = importlib.util.spec_from_file_location("build_image", IMAGE_WRAPPER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("build_image", module)
    spec.loader.exec_module(module)
    return str(module.accelerator("auto", base, KVM_PROBE_TIMEOUT))


@pytest.fixture(scope="session")
def base_image() -> tuple[Path, Path]:
    """The debootstrap'ed base disk and Packer's key, cached in CACHE per version of images/base_image.py."""
    digest = hashlib.sha256(BASE_IMAGE_SCRIPT.read_bytes()).hexdigest()[:12]
    folder = CACHE / f"base-image-{digest}"
    image, key = folder / "debian-12-base.qcow2", folder / "packer_ed25519"
    if not image.exists():
        partial = folder / f"partial-{os.getpid()}.qcow2"  # a killed build leaves no image that looks finished
        sh(
            sys.executable,
            str(BASE_IMAGE_SCRIPT),
            "--out",
            str(partial),
            "--ssh-key",
            str(key),
            timeout=BASE_IMAGE_TIMEOUT,
        )
        partial.rename(image)
    return image, key


def ssh(port: int, key: Path, command: str) -> subprocess.CompletedProcess[str]:
    options = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
    return sh("ssh", "-i", str(key), *options, "-p", str(port), "root@127.0.0.1", command, check=False, timeout=60)


@pytest.mark.image
@pytest.mark.timeout(IMAGE_TEST_TIMEOUT)
@pytest.mark.skipif(
    os.environ.get("MIGRATORY_IMAGE_TEST", "1") == "0" or shutil.which("packer") is None,
    reason="MIGRATORY_IMAGE_TEST=0, or no packer (.ci/deps.sh)",
)
def test_image_builds_boots_and_serves(built: Built, base_image: tuple[Path, Path], tmp_path: Path) -> None:
    """Packer installs the DEB into the base disk; it boots under qemu (KVM if it works, else TCG) and serves."""
    base, key = base_image
    out = tmp_path / "image"
    accel = image_accelerator(base)
    common = ["--base", str(base), "--deb", str(built.deb), "--ssh-key", str(key), "--accel", accel]
    started = time.monotonic()
    done = sh(
        sys.executable, str(IMAGE_WRAPPER), "build", *common, "--output", str(out), check=False, timeout=PACKER_TIMEOUT
    )
    packer = f"packer build ({accel}, exit {done.returncode}):\n{tail(done.stdout, 6000)}\n{tail(done.stderr, 2000)}"
    assert done.returncode == 0, packer
    print(f"image built with {accel} in {time.monotonic() - started:.0f} s")
    image = out / "migratorydata.qcow2"
    assert image.is_file(), packer
    web, ssh_port = free_port(), free_port()
    forwards = f"hostfwd=tcp:127.0.0.1:{web}-:8800,hostfwd=tcp:127.0.0.1:{ssh_port}-:22"
    console = tmp_path / "console.log"
    with console.open("wb") as sink:
        qemu = subprocess.Popen(
            [
                *("qemu-system-x86_64", "-accel", accel, "-m", "1024", "-smp", "2", "-nographic", "-snapshot"),
                *("-drive", f"file={image},if=virtio,format=qcow2"),
                *("-netdev", f"user,id=n0,{forwards}", "-device", "virtio-net-pci,netdev=n0"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )

    def evidence(what: str) -> str:
        """What a CI log needs to tell why: the VM's console (boot, systemd, the service) and Packer's build."""
        booted = f"{time.monotonic() - boot_started:.0f} s after qemu ({accel}) started"
        state = "running" if qemu.poll() is None else f"exited {qemu.returncode}"
        console_tail = tail(console.read_text(errors="replace"), 5000)
        return f"{what}, {booted}, qemu {state}\n--- VM console (tail) ---\n{console_tail}\n--- {packer}"

    boot_started = time.monotonic()
    try:
        deadline = boot_started + BOOT_TIMEOUT
        health, last_error = "", "no answer yet"
        while time.monotonic() < deadline and qemu.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{web}/health", timeout=5) as answer:
                    health = answer.read().decode()
                    break
            except OSError as err:
                last_error = repr(err)
                time.sleep(2)
        assert '"status":"ok"' in health, evidence(f"/health answered {health!r} (last error: {last_error})")

        async def outside_in() -> bytes:
            """From this machine: subscribe (allowed to anyone) and publish (refused: not loopback, as packaged);
            a publication made on the VM itself reaches the subscriber out here."""
            url = f"ws://127.0.0.1:{web}"
            async with MigratoryClient([url]) as subscriber, MigratoryClient([url]) as outsider:
                assert await subscriber.subscribe(["/vm/test"]) == {"/vm/test": Status.OK}
                assert await outsider.publish("/vm/test", b"from outside") == Status.DENIED
                inside = "migratory publish ws://127.0.0.1:8800 /vm/test 'from the image'"
                published = await asyncio.get_running_loop().run_in_executor(None, ssh, ssh_port, key, inside)
                assert published.stdout.strip() == "OK", published.stdout + published.stderr
                return (await subscriber.next_message(30)).content

        assert asyncio.run(outside_in()) == b"from the image"
        state = ssh(ssh_port, key, "systemctl is-enabled migratorydata nftables; systemctl is-active migratorydata")
        assert state.stdout.split() == ["enabled", "enabled", "active"], evidence(f"{state.stdout!r} {state.stderr!r}")
        user = ssh(ssh_port, key, "ps -o user= -p $(systemctl show -p MainPID --value migratorydata)")
        assert user.stdout.strip() == "migratorydata", user.stdout + user.stderr
        rules = ssh(ssh_port, key, "nft list chain inet filter input")
        opened = [line for line in rules.stdout.splitlines() if "tcp dport" in line and "accept" in line]
        assert "policy drop" in rules.stdout and any("8800" in line for line in opened), rules.stdout
        assert not any("9900" in line for line in opened), rules.stdout  # monitoring stays on loopback
        probe = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9900/health', timeout=5).status)"
        monitor = ssh(ssh_port, key, f'python3.11 -c "{probe}"')
        assert monitor.stdout.strip() == "200", monitor.stdout + monitor.stderr
    finally:
        qemu.kill()
        qemu.wait()


def test_rpm_upgrade_keeps_edited_config(built: Built, upgrade: Built, chroot: Chroot) -> None:
    """%config(noreplace): rpm -U to the next version leaves an edited configuration as it is."""
    assert built.rpm is not None and upgrade.rpm is not None
    rpm = ["rpm", "--root", str(chroot.root)]
    sh(*rpm, "--initdb")
    sh(*rpm, "-i", "--nodeps", str(built.rpm))
    conf = chroot.path(CONF)
    conf.write_text(conf.read_text().replace("#LogLevel = INFO", "LogLevel = DEBUG"))
    sh(*rpm, "-U", "--nodeps", str(upgrade.rpm))
    assert sh(*rpm, "-q", "--qf", "%{VERSION}", "migratorydata").stdout == UPGRADE_VERSION
    assert "\nLogLevel = DEBUG\n" in conf.read_text()
    assert chroot.run("getent", "passwd", "migratorydata", check=False).returncode == 0


# --- the signed apt and yum repositories (make repo), served on 127.0.0.1 -----------------------------------------

BUILD_REPO = ROOT / "packaging" / "build_repo.py"
APT_SOURCE = "/etc/apt/sources.list.d/migratorydata.sources"
KEYRING = "/etc/apt/keyrings/migratorydata-archive-keyring.gpg"


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass(frozen=True)
class Repos:
    """A web root on 127.0.0.1 holding the repositories at /repo (and the tests' variants beside it)."""

    www: Path
    url: str
    gnupg: Path

    @property
    def path(self) -> Path:
        return self.www / "repo"

    def make(
        self, out: Path, *package_dirs: Path, gnupg: Path | None = None, formats: str = "apt,yum"
    ) -> subprocess.CompletedProcess[str]:
        """packaging/build_repo.py as `make repo` runs it (a generated test key), into out, served at url/out."""
        folders = [arg for folder in package_dirs for arg in ("--packages", str(folder))]
        return sh(
            *(sys.executable, str(BUILD_REPO), *folders, "--out", str(out), "--formats", formats),
            *("--generate-key", "--gpg-home", str(gnupg or self.gnupg), "--url", f"{self.url}/{out.name}"),
            timeout=BUILD_TIMEOUT,
        )


@pytest.fixture(scope="session")
def repos(built: Built, analytics: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Repos]:
    """`make repo` of the session's packages (both formats, both packages), served by http.server."""
    www = tmp_path_factory.mktemp("www")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(www)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        served = Repos(www, f"http://127.0.0.1:{server.server_address[1]}", www.parent / f"{www.name}-gnupg")
        served.make(served.path, built.out, analytics.out)
        yield served
    finally:
        server.shutdown()
        server.server_close()


def use_apt_repo(box: Chroot, repos: Repos, name: str = "repo", debian: bool = True) -> None:
    """What docs/operations.md has an operator do: the keyring, the .sources file (for url/name).

    With debian, Debian's mirror stays too (Java 17 comes from it) and the downloads are cached;
    without, the chroot sees this repository only and nothing cached (a cached package would
    stand in for the one a test tampered with).
    """
    box.path(KEYRING).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(repos.www / name / "migratorydata-archive-keyring.gpg", box.path(KEYRING))
    box.path(KEYRING).chmod(0o644)
    sources = (repos.www / name / "migratorydata.sources").read_text()
    box.path(APT_SOURCE).write_text(sources.replace(f"{repos.url}/repo/", f"{repos.url}/{name}/"))
    assert f"URIs: {repos.url}/{name}/apt\n" in box.path(APT_SOURCE).read_text()
    if debian:
        box.cache_apt()
    else:
        box.path("/etc/apt/sources.list").write_text("")


def test_repositories_are_signed(repos: Repos, tmp_path: Path) -> None:
    keyring = repos.path / "migratorydata-archive-keyring.gpg"
    dist = repos.path / "apt" / "dists" / "stable"
    sh("gpgv", "--keyring", str(keyring), str(dist / "InRelease"))
    sh("gpgv", "--keyring", str(keyring), str(dist / "Release.gpg"), str(dist / "Release"))
    repomd = repos.path / "yum" / "repodata" / "repomd.xml"
    sh("gpgv", "--keyring", str(keyring), f"{repomd}.asc", str(repomd))
    packages = (dist / "main" / "binary-amd64" / "Packages").read_text()
    assert "Package: migratorydata\n" in packages and "Package: migratorydata-analytics\n" in packages
    assert "Depends: migratorydata (= " in packages and "openjdk-17-jre-headless | java17-runtime-headless" in packages
    rpmdb = tmp_path / "rpmroot"
    sh("rpm", "--root", str(rpmdb), "--initdb")
    sh("rpm", "--root", str(rpmdb), "--import", str(repos.path / "RPM-GPG-KEY-migratorydata"))
    for rpm in sorted((repos.path / "yum" / "Packages").glob("*.rpm")):
        checked = sh("rpm", "--root", str(rpmdb), "-K", str(rpm)).stdout
        assert "signatures OK" in checked, checked
    assert len(list((repos.path / "yum" / "Packages").glob("*.rpm"))) == 2
    assert f"baseurl={repos.url}/repo/yum" in (repos.path / "migratorydata.repo").read_text()


def analyze_as_service_user(box: Chroot) -> dict[str, Any]:
    """`migratory logs analyze /var/log/migratorydata` as migratorydata, the way docs/operations.md shows it."""
    user = ["setpriv", "--reuid=migratorydata", "--regid=migratorydata", "--init-groups"]
    done = box.run(
        *user,
        *("migratory", "logs", "analyze", "/var/log/migratorydata", "--out", "/var/lib/migratorydata/report", "--json"),
        env={"HOME": "/var/lib/migratorydata"},
        timeout=ANALYSIS_TIMEOUT,
    )
    report = box.path("/var/lib/migratorydata/report")
    assert (report / "report.html").is_file() and (report / "summary.json").is_file(), done.stderr[-3000:]
    assert (report / "summary.json").stat().st_uid == box.uid("migratorydata")
    return dict(json.loads(done.stdout))


def serve_publish_and_analyze(box: Chroot, unit: str) -> None:
    """The packaged server as its unit runs it, a few messages, then the analytics over its logs."""
    proc, host = serve_as_unit(box, unit)
    for index in range(3):
        subject, payload = f"/pkg/analytics/{index}", f"m{index}".encode()
        assert round_trip(f"ws://{host}:80", subject, payload) == payload
    wait_logged(box, "/pkg/analytics/2")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    summary = analyze_as_service_user(box)
    assert "/pkg/analytics/1" in json.dumps(summary)
    assert summary["inputs"] == ["/var/log/migratorydata"]
    assert summary["spark"]["parser"] == "jvm"  # the package's jar, built for its own PySpark


@pytest.mark.timeout(REPO_TEST_TIMEOUT)
def test_apt_installs_both_from_the_signed_repository_and_analyzes_the_logs(repos: Repos, chroot: Chroot) -> None:
    """apt-get install migratorydata migratorydata-analytics from the repository, Java 17 from Debian's mirror."""
    use_apt_repo(chroot, repos)
    update = chroot.run("apt-get", "update", timeout=APT_TIMEOUT)
    assert f"{repos.url}/repo/apt stable InRelease" in update.stdout, update.stdout
    assert "not signed" not in update.stdout + update.stderr and "insecure" not in update.stdout + update.stderr
    chroot.run("apt-get", "install", "-y", "-q", "migratorydata", "migratorydata-analytics", timeout=APT_TIMEOUT)
    versions = chroot.run("dpkg-query", "-W", "-f=${Package} ${Version}\n").stdout.splitlines()
    assert f"migratorydata {VERSION}" in versions and f"migratorydata-analytics {VERSION}" in versions
    assert any(line.startswith("openjdk-17-jre-headless ") for line in versions)  # pulled in by the dependency
    serve_publish_and_analyze(chroot, UNIT)


@pytest.mark.timeout(REPO_TEST_TIMEOUT)
def test_apt_refuses_a_tampered_package_and_a_foreign_signature(repos: Repos, built: Built, chroot: Chroot) -> None:
    tampered = repos.www / "tampered"
    shutil.copytree(repos.path, tampered)
    deb = tampered / "apt" / "pool" / "main" / built.deb.name
    data = bytearray(deb.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of the payload, the size unchanged
    deb.write_bytes(bytes(data))
    use_apt_repo(chroot, repos, "tampered", debian=False)
    chroot.run("apt-get", "update", timeout=APT_TIMEOUT)
    refused = chroot.run("apt-get", "install", "-y", "-q", "migratorydata", check=False, timeout=APT_TIMEOUT)
    assert refused.returncode != 0 and "Hash Sum mismatch" in refused.stdout + refused.stderr, refused.stderr
    assert chroot.run("dpkg-query", "-W", "migratorydata", check=False).returncode != 0
    # the same packages, indexed and signed by someone else's key: apt refuses the repository itself
    foreign = repos.www / "foreign"
    other_key = repos.gnupg.parent / f"{repos.gnupg.name}-other"
    repos.make(foreign, built.out, gnupg=other_key, formats="apt")
    chroot.path(APT_SOURCE).write_text(chroot.path(APT_SOURCE).read_text().replace("/tampered/", "/foreign/"))
    update = chroot.run("apt-get", "update", check=False, timeout=APT_TIMEOUT)
    output = update.stdout + update.stderr
    assert update.returncode != 0 and "NO_PUBKEY" in output and "is not signed" in output, output
    assert chroot.run("apt-get", "install", "-y", "-q", "migratorydata", check=False).returncode != 0


@pytest.mark.timeout(REPO_UPGRADE_TEST_TIMEOUT)
def test_apt_upgrade_from_the_repository_keeps_an_edited_config(
    repos: Repos, built: Built, upgrade: Built, chroot: Chroot
) -> None:
    published = repos.www / "upgrade"
    shutil.copytree(repos.path, published)
    use_apt_repo(chroot, repos, "upgrade", debian=False)
    chroot.run("apt-get", "update", timeout=APT_TIMEOUT)
    chroot.run("apt-get", "install", "-y", "-q", "migratorydata", timeout=APT_TIMEOUT)
    conf = chroot.path(CONF)
    conf.write_text(conf.read_text().replace("#LogLevel = INFO", "LogLevel = DEBUG"))
    repos.make(published, upgrade.out)  # the next release published into the same repository
    chroot.run("apt-get", "update", timeout=APT_TIMEOUT)
    out = chroot.run("apt-get", "upgrade", "-y", "-q", timeout=APT_TIMEOUT)
    assert "Setting up migratorydata" in out.stdout, out.stdout
    assert chroot.run("dpkg-query", "-W", "-f=${Version}", "migratorydata").stdout == UPGRADE_VERSION
    assert "\nLogLevel = DEBUG\n" in conf.read_text() and not chroot.path(CONF + ".dpkg-dist").exists()
    chroot.run("migratory", "config", "check", CONF)


# The Debian chroot, described to rpm: what the RPMs require and Debian provides (dnf sees rpm's database only).
ROOT_PROVIDES_SPEC = """\
Name: debian-root-provides
Version: 12
Release: 1
Summary: What this Debian bookworm root provides, for rpm's database
License: none
BuildArch: noarch
Provides: python3.11, shadow-utils, systemd, jre-17-headless, /bin/sh
%description
The test chroot is Debian: python3.11, useradd, systemd and OpenJDK 17 come from its own packages.
%files
"""


@pytest.mark.timeout(REPO_TEST_TIMEOUT)
@pytest.mark.skipif(shutil.which("dnf") is None or shutil.which("rpmbuild") is None, reason="needs dnf and rpmbuild")
def test_dnf_installs_both_from_the_signed_yum_repository_and_analyzes_the_logs(
    repos: Repos, chroot: Chroot, tmp_path: Path
) -> None:
    """dnf --installroot (Debian's dnf) with gpgcheck and repo_gpgcheck, into the Debian chroot."""
    chroot.cache_apt()  # Java 17 from Debian, as the root's own runtime
    chroot.run("apt-get", "update", timeout=APT_TIMEOUT)
    chroot.run(
        "apt-get", "install", "-y", "-q", "--no-install-recommends", "openjdk-17-jre-headless", timeout=APT_TIMEOUT
    )
    spec = tmp_path / "root.spec"
    spec.write_text(ROOT_PROVIDES_SPEC)
    sh("rpmbuild", "-bb", "--quiet", "--define", f"_topdir {tmp_path / 'rpmbuild'}", str(spec))
    stub = next((tmp_path / "rpmbuild" / "RPMS").rglob("*.rpm"))
    rpm = ["rpm", "--root", str(chroot.root)]
    sh(*rpm, "--initdb")
    sh(*rpm, "-i", str(stub))
    repo_file = chroot.path("/etc/yum.repos.d/migratorydata.repo")
    repo_file.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(repos.path / "migratorydata.repo", repo_file)
    dnf = ["dnf", f"--installroot={chroot.root}", "--releasever=9", "--setopt=install_weak_deps=False", "-y"]
    sh(*dnf, "install", "migratorydata", "migratorydata-analytics", timeout=APT_TIMEOUT)
    assert "gpg-pubkey-" in sh(*rpm, "-qa").stdout  # dnf imported the repository's key, as it asks to
    installed = sh(*rpm, "-q", "--qf", "%{NAME} %{VERSION}\n", "migratorydata", "migratorydata-analytics").stdout
    assert installed.split("\n")[:2] == [f"migratorydata {VERSION}", f"migratorydata-analytics {VERSION}"]
    assert (
        "signatures OK" in sh(*rpm, "-K", str(next((repos.path / "yum" / "Packages").glob("migratorydata-0*")))).stdout
    )
    assert chroot.run("getent", "passwd", "migratorydata").stdout.split(":")[5] == "/var/lib/migratorydata"
    serve_publish_and_analyze(chroot, RPM_UNIT)
