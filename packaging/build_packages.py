"""Build the migratorydata DEB and RPM from this checkout: one staged tree, two package formats.

The tree carries its own Python environment in /opt/migratorydata (a venv on the system's
python3.11, with the server and its dependencies pinned by packaging/constraints.txt), so the
package depends on nothing from PyPI at install time. Builds are reproducible: every mtime is
SOURCE_DATE_EPOCH (the last commit's time unless set), byte code is hash-based, and no path of
the build machine is left in any file.

    python packaging/build_packages.py deb|rpm|all [--version V] [--out dist] [--work build/pkg]
"""

from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = REPO / "packaging"
NAME = "migratorydata"
PREFIX = Path("/opt/migratorydata")
CONF_PATH = Path("/etc/migratorydata/migratorydata.conf")
PYTHON = "/usr/bin/python3.11"  # the venv's interpreter: Debian's python3.11, RHEL/Fedora's python3.11

# The keys of conf/migratorydata.conf that the packaged copy sets; everything else stays as shipped.
PACKAGED_KEYS = {
    "Listen": "*:8800",
    "LogFolder": "/var/log/migratorydata",
    "StateFolder": "/var/lib/migratorydata",
}
CONF_HEADER = """\
# Installed by the migratorydata package as /etc/migratorydata/migratorydata.conf.
# Edit it, check it with `migratory config check /etc/migratorydata/migratorydata.conf`,
# then `systemctl restart migratorydata` (`systemctl reload` re-reads the TLS certificate
# only). Your edits are kept on upgrade. Set here: Listen (every interface, port 8800),
# LogFolder and StateFolder (owned by the migratorydata user).

"""


@dataclass(frozen=True)
class Build:
    """What every step needs: the version, the timestamp, and where to stage and write."""

    version: str
    epoch: int
    work: Path
    out: Path

    @property
    def tree(self) -> Path:
        """The installed files, common to both formats (no systemd unit: its path differs)."""
        return self.work / "tree"

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SOURCE_DATE_EPOCH=str(self.epoch), LC_ALL="C.UTF-8", TZ="UTC", PYTHONHASHSEED="0")


def run(cmd: list[str], **kwargs: object) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload]


def project_version() -> str:
    with (REPO / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def source_date_epoch() -> int:
    """SOURCE_DATE_EPOCH if set, else the last commit's time, so two builds of one commit match."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    done = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    return int(done.stdout.strip()) if done.returncode == 0 and done.stdout.strip() else 0


def deb_arch() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()


def packaged_conf() -> str:
    """conf/migratorydata.conf with PACKAGED_KEYS set in place, so comments and defaults stay the repo's."""
    text = (REPO / "conf" / "migratorydata.conf").read_text()
    for key, value in PACKAGED_KEYS.items():
        pattern = re.compile(rf"^#?{re.escape(key)} = .*$", re.MULTILINE)
        text, count = pattern.subn(f"{key} = {value}", text, count=1)
        if count != 1:
            raise SystemExit(f"conf/migratorydata.conf has no line for {key}: update PACKAGED_KEYS")
    return CONF_HEADER + text


def stage_python(build: Build) -> None:
    """The venv in tree/opt/migratorydata, made with PYTHON, holding the server and its pinned dependencies."""
    venv = build.tree / PREFIX.relative_to("/")
    src = build.work / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    # Only what the wheel needs: the spark extra and the tests stay out of the package.
    for name in ("migratory", "cli"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    text = (src / "pyproject.toml").read_text()
    (src / "pyproject.toml").write_text(re.sub(r'(?m)^version = ".*"$', f'version = "{build.version}"', text))
    run([PYTHON, "-m", "venv", "--without-pip", str(venv)])
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "--disable-pip-version-check"]
    run(
        [
            *pip,
            *("install", "--quiet", "--no-compile", "--no-warn-script-location", "--only-binary=:all:"),
            *("-c", str(HERE / "constraints.txt"), str(src)),
        ],
        env=build.env,
    )
    site = next((venv / "lib").glob("python3.*/site-packages"))
    for direct_url in site.glob("*.dist-info/direct_url.json"):  # names the build directory
        record = direct_url.parent / "RECORD"
        entry = f"{direct_url.parent.name}/direct_url.json,"
        lines = [line for line in record.read_text().splitlines() if not line.startswith(entry)]
        record.write_text("\n".join(lines) + "\n")
        direct_url.unlink()
    rewritten: set[Path] = set()
    for path in venv.rglob("*"):  # scripts and pyvenv.cfg name the staging path
        if path.is_file() and not path.is_symlink() and path.suffix != ".so":
            data = path.read_bytes()
            if str(venv).encode() in data:
                path.write_bytes(data.replace(str(venv).encode(), str(PREFIX).encode()))
                rewritten.add(path.resolve())
    for record in site.glob("*.dist-info/RECORD"):  # their hashes must match what is shipped
        record.write_text(
            "".join(record_line(record.parent.parent, line, rewritten) for line in record.read_text().splitlines())
        )
    run(
        [
            *(str(venv / "bin" / "python"), "-m", "compileall", "-q", "-j", "0"),
            *("--invalidation-mode", "checked-hash", "-s", str(build.tree), "-p", "/", str(site)),
        ],
        env=build.env,
        stdout=subprocess.DEVNULL,
    )


def record_line(site: Path, line: str, rewritten: set[Path]) -> str:
    """One RECORD line, with hash and size recomputed when its file was rewritten."""
    name, _, _ = line.rpartition(",")[0].rpartition(",")
    path = (site / name).resolve()
    if path not in rewritten:
        return line + "\n"
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def stage_files(build: Build) -> None:
    """Everything beside the venv: the conffile, the CLI on PATH, the man page, the documentation."""
    tree = build.tree
    conf = tree / CONF_PATH.relative_to("/")
    conf.parent.mkdir(parents=True)
    conf.write_text(packaged_conf())
    (tree / "usr/bin").mkdir(parents=True)
    (tree / "usr/bin/migratory").symlink_to(PREFIX / "bin" / "migratory")
    date = datetime.fromtimestamp(build.epoch, UTC).strftime("%Y-%m-%d")
    page = subprocess.run(
        [str(tree / PREFIX.relative_to("/") / "bin" / "python"), str(HERE / "manpage.py"), build.version, date],
        capture_output=True,
        check=True,
        env=dict(build.env, PYTHONDONTWRITEBYTECODE="1"),
    ).stdout
    write_gzip(tree / "usr/share/man/man1/migratory.1.gz", page)
    doc = tree / "usr/share/doc" / NAME
    doc.mkdir(parents=True)
    (doc / "copyright").write_text(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
        "Upstream-Name: migratorydata-py\n\nFiles: *\nCopyright: the migratorydata-py authors\nLicense: Proprietary\n"
    )
    for name in ("operations.md", "configuration.md", "security.md"):
        if (REPO / "docs" / name).exists():
            shutil.copy2(REPO / "docs" / name, doc / name)
    changelog = f"{NAME} ({build.version}) stable; urgency=medium\n\n  * Release {build.version}.\n\n"
    changelog += f" -- migratorydata-py maintainers <maintainers@migratorydata.invalid>  {rfc2822(build.epoch)}\n"
    write_gzip(doc / "changelog.Debian.gz", changelog.encode())


def rfc2822(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%a, %d %b %Y %H:%M:%S +0000")


def write_gzip(path: Path, data: bytes) -> None:
    """gzip without a name or time in the header (gzip -n), for reproducibility."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        gz.write(data)


def normalise(root: Path, epoch: int) -> None:
    """Modes 0755/0644 by the executable bit and every mtime at epoch, so the archive depends on content only."""
    for path in sorted(root.rglob("*"), reverse=True):
        if not path.is_symlink():
            mode = path.stat().st_mode
            executable = stat.S_ISDIR(mode) or mode & 0o111
            path.chmod(0o755 if executable else 0o644)
        os.utime(path, (epoch, epoch), follow_symlinks=False)
    os.utime(root, (epoch, epoch))


def stage(build: Build) -> None:
    shutil.rmtree(build.work, ignore_errors=True)
    build.work.mkdir(parents=True)
    stage_python(build)
    stage_files(build)
    leaked = [p for p in build.tree.rglob("*") if p.is_file() and str(build.work).encode() in p.read_bytes()]
    if leaked:
        raise SystemExit(f"build paths left in: {', '.join(str(p) for p in leaked[:10])}")
    normalise(build.tree, build.epoch)


def installed_size_kib(root: Path) -> int:
    return sum((p.stat().st_size + 1023) // 1024 for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def build_deb(build: Build) -> Path:
    """dpkg-deb over the tree plus the unit and DEBIAN/ (control, conffiles, md5sums, maintainer scripts)."""
    root = build.work / "deb"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(build.tree, root, symlinks=True)
    unit = root / "lib/systemd/system/migratorydata.service"
    unit.parent.mkdir(parents=True)
    shutil.copy2(HERE / "common" / "migratorydata.service", unit)
    arch = deb_arch()
    control = root / "DEBIAN"
    control.mkdir()
    (control / "control").write_text(
        f"Package: {NAME}\nVersion: {build.version}\nArchitecture: {arch}\n"
        "Maintainer: migratorydata-py maintainers <maintainers@migratorydata.invalid>\n"
        f"Installed-Size: {installed_size_kib(root)}\n"
        "Depends: python3.11, passwd, init-system-helpers (>= 1.54)\n"
        "Section: net\nPriority: optional\n"
        "Description: MigratoryData-class real-time publish/subscribe server\n"
        " WebSocket and HTTP push with snapshots, conflation, batching and entitlement,\n"
        " run by systemd as the unprivileged migratorydata user. Configuration:\n"
        " /etc/migratorydata/migratorydata.conf; command line: migratory.\n"
    )
    (control / "conffiles").write_text(f"{CONF_PATH}\n")
    sums = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        if control not in path.parents:
            sums.append(f"{hashlib.md5(path.read_bytes()).hexdigest()}  {path.relative_to(root)}\n")
    (control / "md5sums").write_text("".join(sums))
    for script in ("postinst", "prerm", "postrm"):
        shutil.copy2(HERE / "deb" / script, control / script)
        (control / script).chmod(0o755)
    normalise(root, build.epoch)
    build.out.mkdir(parents=True, exist_ok=True)
    deb = build.out / f"{NAME}_{build.version}_{arch}.deb"
    run(["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(root), str(deb)], env=build.env, stdout=sys.stderr)
    return deb


def build_rpm(build: Build) -> Path:
    """rpmbuild -bb on packaging/rpm/migratorydata.spec, which copies the same tree into its buildroot."""
    top = build.work / "rpmbuild"
    shutil.rmtree(top, ignore_errors=True)
    top.mkdir()
    run(
        [
            *("rpmbuild", "-bb", "--nodeps", "--quiet", str(HERE / "rpm" / f"{NAME}.spec")),
            *("--define", f"_topdir {top}", "--define", f"mdversion {build.version}"),
            *("--define", f"stagedir {build.tree}", "--define", f"unitfile {HERE / 'common' / f'{NAME}.service'}"),
        ],
        env=build.env,
    )
    built = sorted((top / "RPMS").rglob("*.rpm"))
    if len(built) != 1:
        raise SystemExit(f"rpmbuild made {len(built)} packages, expected 1")
    build.out.mkdir(parents=True, exist_ok=True)
    rpm = build.out / built[0].name
    shutil.copy2(built[0], rpm)
    return rpm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["deb", "rpm", "all", "stage"])
    parser.add_argument("--version", default=None, help="package version (default: pyproject's)")
    parser.add_argument("--out", type=Path, default=REPO / "dist", help="where the packages go")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "pkg", help="staging folder, emptied first")
    args = parser.parse_args(argv)
    build = Build(args.version or project_version(), source_date_epoch(), args.work.resolve(), args.out.resolve())
    stage(build)
    if args.what in ("deb", "all"):
        print(build_deb(build))
    if args.what in ("rpm", "all"):
        print(build_rpm(build))
    return 0


if __name__ == "__main__":
    sys.exit(main())
