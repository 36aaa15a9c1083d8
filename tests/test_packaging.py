"""The DEB (and RPM) built for real and installed into a Debian bookworm chroot made by debootstrap.

One session builds the packages (packaging/build_packages.py, as `make deb`/`make rpm` do); each
scenario gets a fresh copy of a cached debootstrap tree (/var/cache/migratorydata-test), installs
with `apt-get install ./migratorydata_<version>_<arch>.deb` as a user would, and checks what the
issue promises: files, owners and modes, the system user, `migratory config check`, the unit's
ExecStart run as that user with the unit's one capability on a privileged port and serving a
subscribe/publish round trip, `systemd-analyze verify`, conffile kept on upgrade, user gone on purge.
No systemd runs here, so the unit's commands are started the way systemd would: setpriv with the
unit's User, Group and AmbientCapabilities.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from migratory.client import MigratoryClient
from migratory.protocol import Status
from tests.conftest import free_port, wait_for_port

pytestmark = [
    pytest.mark.slow,
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
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
UPGRADE_VERSION = f"{VERSION}+1"
CAP_NET_BIND_SERVICE = 1 << 10


def sh(*args: str, check: bool = True, timeout: float = 600, **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]
    if check and done.returncode != 0:
        raise AssertionError(f"{shlex.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Built:
    deb: Path
    rpm: Path | None
    work: Path


# The build's default SOURCE_DATE_EPOCH is the last commit's time; read once, so a commit made while
# the suite runs cannot make two builds of this session differ.
EPOCH = int(sh("git", "-C", str(ROOT), "log", "-1", "--format=%ct").stdout) if (ROOT / ".git").exists() else 0


def build(out: Path, work: Path, what: str, version: str | None = None) -> list[Path]:
    args = [sys.executable, str(BUILD), what, "--out", str(out), "--work", str(work)]
    if version:
        args += ["--version", version]
    done = sh(*args, timeout=900, env=dict(os.environ, SOURCE_DATE_EPOCH=str(EPOCH)))
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


def rootfs_tarball() -> Path:
    """A debootstrap'ed bookworm (minbase + ROOTFS_PACKAGES), made once and kept as a tarball in CACHE."""
    if ROOTFS.exists():
        return ROOTFS
    CACHE.mkdir(parents=True, exist_ok=True)
    target = CACHE / f"rootfs.{os.getpid()}"
    shutil.rmtree(target, ignore_errors=True)
    include = ",".join(ROOTFS_PACKAGES)
    sh("debootstrap", "--variant=minbase", f"--include={include}", "bookworm", str(target), MIRROR, timeout=1800)
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
        self.procs: list[subprocess.Popen[bytes]] = []

    def run(self, *cmd: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}
        env["DEBIAN_FRONTEND"] = "noninteractive"
        return sh("chroot", str(self.root), *cmd, check=check, timeout=timeout, env=env)

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
        sh("umount", "-l", str(self.root / "proc"), check=False)
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
    for line in ("Listen = *:8800", "LogFolder = /var/log/migratorydata", "StateFolder = /var/lib/migratorydata"):
        assert f"\n{line}\n" in text
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
    assert "OK" in pre.stdout + pre.stderr
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


def test_service_runs_as_user_on_privileged_port(installed: Chroot) -> None:
    """The unit's ExecStart as systemd would run it: the user, only CAP_NET_BIND_SERVICE, port 80, a round trip."""
    directives = unit_directives(installed.path(UNIT).read_text())
    host = f"127.{random.randint(1, 254)}.{random.randint(1, 254)}.{random.randint(2, 254)}"
    conf = installed.path(CONF)
    conf.write_text(conf.read_text().replace("\nListen = *:8800\n", f"\nListen = {host}:80\n"))
    installed.run(*as_unit_user(directives, directives["ExecStartPre"][0]))
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}
    for item in directives.get("Environment", []):
        key, value = item.split("=", 1)
        env[key] = value
    start = ["chroot", str(installed.root), *as_unit_user(directives, directives["ExecStart"][0])]
    proc = subprocess.Popen(start, stderr=subprocess.PIPE, env=env, start_new_session=True)
    installed.procs.append(proc)
    wait_for_port(host, 80, timeout=30, proc=proc)
    uid = installed.uid("migratorydata")
    pids = [proc.pid, *(int(p) for p in sh("pgrep", "-P", str(proc.pid)).stdout.split())]
    assert len(pids) >= 2  # the supervisor and its workers
    for pid in pids:
        assert status_field(pid, "Uid").split() == [str(uid)] * 4
        assert int(status_field(pid, "CapEff"), 16) == CAP_NET_BIND_SERVICE
        assert int(status_field(pid, "CapBnd"), 16) == CAP_NET_BIND_SERVICE

    async def round_trip() -> bytes:
        url = f"ws://{host}:80"
        async with MigratoryClient([url]) as subscriber, MigratoryClient([url]) as publisher:
            assert await subscriber.subscribe(["/pkg/test"]) == {"/pkg/test": Status.OK}
            assert await publisher.publish("/pkg/test", b"from the package") == Status.OK
            return (await subscriber.next_message(10)).content

    assert asyncio.run(round_trip()) == b"from the package"
    logs = installed.path("/var/log/migratorydata")
    deadline = time.monotonic() + 5  # logs are flushed once a second
    while "/pkg/test" not in (logs / "message.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "/pkg/test" in (logs / "message.log").read_text(), sorted(p.name for p in logs.iterdir())
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
    assert "image ports: [8800]" in done.stderr  # the packaged configuration's Listen
    conf = tmp_path / "appliance.conf"
    conf.write_text("Listen = *:80\nListenEncrypted = none\nMonitorHTTP.Listen = 10.0.0.5:8801\n")
    custom = wrapper("validate", *common, "--config", str(conf))
    assert custom.returncode == 0 and "image ports: [80, 8801]" in custom.stderr, custom.stderr


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


@pytest.fixture(scope="session")
def base_image() -> tuple[Path, Path]:
    """The debootstrap'ed base disk and Packer's key, cached in CACHE per version of images/base_image.py."""
    digest = hashlib.sha256(BASE_IMAGE_SCRIPT.read_bytes()).hexdigest()[:12]
    folder = CACHE / f"base-image-{digest}"
    image, key = folder / "debian-12-base.qcow2", folder / "packer_ed25519"
    if not image.exists():
        sh(sys.executable, str(BASE_IMAGE_SCRIPT), "--out", str(image), "--ssh-key", str(key), timeout=1800)
    return image, key


def ssh(port: int, key: Path, command: str) -> subprocess.CompletedProcess[str]:
    options = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
    return sh("ssh", "-i", str(key), *options, "-p", str(port), "root@127.0.0.1", command, check=False, timeout=60)


@pytest.mark.skipif(
    os.environ.get("MIGRATORY_IMAGE_TEST", "1") == "0" or shutil.which("packer") is None,
    reason="MIGRATORY_IMAGE_TEST=0, or no packer (.ci/deps.sh)",
)
def test_image_builds_boots_and_serves(built: Built, base_image: tuple[Path, Path], tmp_path: Path) -> None:
    """Packer installs the DEB into the base disk; the result boots under qemu (software emulation) and serves."""
    base, key = base_image
    out = tmp_path / "image"
    common = ["--base", str(base), "--deb", str(built.deb), "--ssh-key", str(key), "--accel", "tcg"]
    done = sh(sys.executable, str(IMAGE_WRAPPER), "build", *common, "--output", str(out), check=False, timeout=2400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    image = out / "migratorydata.qcow2"
    assert image.is_file()
    web, ssh_port = free_port(), free_port()
    forwards = f"hostfwd=tcp:127.0.0.1:{web}-:8800,hostfwd=tcp:127.0.0.1:{ssh_port}-:22"
    console = tmp_path / "console.log"
    qemu = subprocess.Popen(
        [
            *("qemu-system-x86_64", "-accel", "tcg", "-m", "1024", "-smp", "2", "-nographic", "-snapshot"),
            *("-drive", f"file={image},if=virtio,format=qcow2"),
            *("-netdev", f"user,id=n0,{forwards}", "-device", "virtio-net-pci,netdev=n0"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=console.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 600
        health = ""
        while time.monotonic() < deadline and qemu.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{web}/health", timeout=5) as answer:
                    health = answer.read().decode()
                    break
            except OSError:
                time.sleep(2)
        assert '"status":"ok"' in health, console.read_text(errors="replace")[-3000:]

        async def round_trip() -> bytes:
            url = f"ws://127.0.0.1:{web}"
            async with MigratoryClient([url]) as subscriber, MigratoryClient([url]) as publisher:
                assert await subscriber.subscribe(["/vm/test"]) == {"/vm/test": Status.OK}
                assert await publisher.publish("/vm/test", b"from the image") == Status.OK
                return (await subscriber.next_message(20)).content

        assert asyncio.run(round_trip()) == b"from the image"
        state = ssh(ssh_port, key, "systemctl is-enabled migratorydata nftables; systemctl is-active migratorydata")
        assert state.stdout.split() == ["enabled", "enabled", "active"], state.stdout + state.stderr
        user = ssh(ssh_port, key, "ps -o user= -p $(systemctl show -p MainPID --value migratorydata)")
        assert user.stdout.strip() == "migratorydata", user.stdout + user.stderr
        rules = ssh(ssh_port, key, "nft list chain inet filter input")
        opened = [line for line in rules.stdout.splitlines() if "tcp dport" in line and "accept" in line]
        assert "policy drop" in rules.stdout and any("8800" in line for line in opened), rules.stdout
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
