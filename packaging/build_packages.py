"""Build the migratorydata DEB and RPM from this checkout: one staged tree, two package formats.

The tree carries its own Python environment in /opt/migratorydata (a venv on the system's
python3.11, with the server and its dependencies pinned by packaging/constraints.txt), so the
package depends on nothing from PyPI at install time. Builds are reproducible: every mtime is
SOURCE_DATE_EPOCH (the last commit's time unless set), byte code is hash-based, and no path of
the build machine is left in any file.

migratorydata-analytics (DEB and RPM) adds the log analytics to that venv: the Spark jobs
(spark/migratory_spark) and PySpark with its pinned dependencies (constraints-analytics.txt),
and depends on the core package of the same version and on a Java 17 runtime; it is the
difference between the core venv and the same venv with the analytics installed, so the two
packages never share a file and the core stays small.

    python packaging/build_packages.py deb|rpm|all|analytics-deb|analytics-rpm|analytics|everything ...
        [--version V] [--out dist] [--work build/pkg]

all = deb rpm; analytics = analytics-deb analytics-rpm; everything = all four. A missing build
tool is named with the package that provides it, before anything is built.
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
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HERE = REPO / "packaging"
NAME = "migratorydata"
PREFIX = Path("/opt/migratorydata")
CONF_PATH = Path("/etc/migratorydata/migratorydata.conf")
PYTHON = "/usr/bin/python3.11"  # the venv's interpreter: Debian's python3.11, RHEL/Fedora's python3.11

ANALYTICS = "migratorydata-analytics"
# Built from source: no binary wheel exists (both pure Python; the build is reproducible all the same).
SOURCE_BUILT = {NAME: ("pysyncobj",), ANALYTICS: ("pysyncobj", "pyspark")}
MAINTAINER = "migratorydata-py maintainers <maintainers@migratorydata.invalid>"

# The keys of conf/migratorydata.conf that the packaged copy sets, with a comment each; everything
# else stays as shipped (PublishAllowFromAddressList = 127.0.0.1, ::1 included: only this machine
# publishes until the operator opens it, and the file says how).
PACKAGED_KEYS = {
    "Listen": "*:8800",
    "ListenMqtt": "*:1883",
    "LogFolder": "/var/log/migratorydata",
    "StateFolder": "/var/lib/migratorydata",
    "MonitorHTTP.Listen": "127.0.0.1:9900",
}
PACKAGED_NOTES = {
    "Listen": "Packaged: every interface, so other machines reach the appliance (they subscribe; who may\n"
    "# publish is PublishAllowFromAddressList below).",
    "ListenMqtt": "Packaged: MQTT 3.1.1 and 5.0 on every interface, the standard port (docs/mqtt.md); MQTT over\n"
    "# WebSocket is on Listen's port at /mqtt. none turns the TCP listener off.",
    "MonitorHTTP.Listen": "Packaged: this machine only (curl http://127.0.0.1:9900/stats). To read it from elsewhere,\n"
    "# bind a LAN address and set MonitorHTTP.Username and MonitorHTTP.Password.",
}
PACKAGED_REQUIRED = {"PublishAllowFromAddressList": "127.0.0.1, ::1"}
CONF_HEADER = """\
# Installed by the migratorydata package as /etc/migratorydata/migratorydata.conf.
# Edit it, check it with `migratory config check /etc/migratorydata/migratorydata.conf`,
# then `systemctl reload migratorydata` for the keys it marks `reload` (tokens, JWT keys, the
# publish address list, log level, slow-consumer limits, certificates: nobody is disconnected),
# `systemctl restart migratorydata` for the others. Your edits are kept on upgrade. Set
# here: Listen (every interface, port 8800), ListenMqtt (MQTT, every interface, port 1883),
# LogFolder and StateFolder (owned by the migratorydata user), MonitorHTTP.Listen (this
# machine only) and PublishAllowFromAddressList (publishing from this machine only, until
# you open it: see that key's comment).

"""


@dataclass(frozen=True)
class Tool:
    """A program a build step runs, and where it comes from."""

    command: str
    purpose: str
    debian: str
    fedora: str

    def found(self) -> bool:
        return (os.access(self.command, os.X_OK) if "/" in self.command else shutil.which(self.command)) is not None

    def advice(self) -> str:
        where = f"`apt-get install {self.debian}` on Debian and Ubuntu"
        where += f", `dnf install {self.fedora}` on Fedora and RHEL" if self.fedora else " (Fedora and RHEL have none)"
        return f"{self.command} not found ({self.purpose}): install it with {where} (or run .ci/deps.sh as root)"


PYTHON_TOOL = Tool(PYTHON, "the packaged venv's interpreter", "python3.11", "python3.11")
DPKG_DEB = Tool("dpkg-deb", "builds the DEB", "dpkg", "dpkg")
DPKG = Tool("dpkg", "names the architecture of the DEB", "dpkg", "dpkg")
RPMBUILD = Tool("rpmbuild", "builds the RPM", "rpm", "rpm-build")
JAVAC = Tool("javac", "compiles the analytics' JVM line parser", "openjdk-17-jdk-headless", "java-17-openjdk-devel")
STEP_TOOLS = {
    "deb": [PYTHON_TOOL, DPKG_DEB, DPKG],
    "rpm": [PYTHON_TOOL, RPMBUILD],
    "analytics-deb": [PYTHON_TOOL, DPKG_DEB, DPKG, JAVAC],
    "analytics-rpm": [PYTHON_TOOL, RPMBUILD, JAVAC],
}
ALIASES = {
    "all": ["deb", "rpm"],
    "analytics": ["analytics-deb", "analytics-rpm"],
    "everything": ["deb", "rpm", "analytics-deb", "analytics-rpm"],
}


def require(tools: Iterable[Tool], what: str = "build_packages") -> None:
    """Exit 2 with one line per missing tool, naming the package that provides it."""
    missing = list(dict.fromkeys(tool for tool in tools if not tool.found()))
    if missing:
        for tool in missing:
            print(f"{what}: {tool.advice()}", file=sys.stderr)
        raise SystemExit(2)


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
    def analytics_root(self) -> Path:
        """A copy of the core venv with the analytics installed into it (at the same relative path)."""
        return self.work / "analytics-root"

    @property
    def analytics_tree(self) -> Path:
        """What migratorydata-analytics installs: the files that analytics_root has and the core tree has not."""
        return self.work / "analytics-tree"

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
        line = (f"# {PACKAGED_NOTES[key]}\n" if key in PACKAGED_NOTES else "") + f"{key} = {value}"
        text, count = pattern.subn(line.replace("\\", "\\\\"), text, count=1)
        if count != 1:
            raise SystemExit(f"conf/migratorydata.conf has no line for {key}: update PACKAGED_KEYS")
    for key, value in PACKAGED_REQUIRED.items():
        if not re.search(rf"^{re.escape(key)} = {re.escape(value)}$", text, re.MULTILINE):
            raise SystemExit(f"conf/migratorydata.conf must set {key} = {value} (tools/gen_config_docs.py)")
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
            *("install", "--quiet", "--no-compile", "--no-warn-script-location", *binary_only(NAME)),
            *("-c", str(HERE / "constraints.txt"), str(src)),
        ],
        env=build.env,
    )
    site = next((venv / "lib").glob("python3.*/site-packages"))
    unbuild(venv, site, venv.rglob("*"))
    compile_python(build, venv, build.tree, [site])


def binary_only(name: str) -> list[str]:
    """pip's options: binary wheels only, except the few projects that publish none."""
    return ["--only-binary=:all:", *(f"--no-binary={project}" for project in SOURCE_BUILT[name])]


def unbuild(venv: Path, site: Path, paths: Iterable[Path]) -> None:
    """Remove the staging path from what pip wrote (direct_url.json, scripts, pyvenv.cfg) and fix RECORD."""
    for direct_url in site.glob("*.dist-info/direct_url.json"):  # names the build directory
        record = direct_url.parent / "RECORD"
        entry = f"{direct_url.parent.name}/direct_url.json,"
        lines = [line for line in record.read_text().splitlines() if not line.startswith(entry)]
        record.write_text("\n".join(lines) + "\n")
        direct_url.unlink()
    rewritten: set[Path] = set()
    for path in paths:  # scripts and pyvenv.cfg name the staging path
        if path.is_file() and not path.is_symlink() and path.suffix not in (".so", ".jar"):
            data = path.read_bytes()
            if str(venv).encode() in data:
                path.write_bytes(data.replace(str(venv).encode(), str(PREFIX).encode()))
                rewritten.add(path.resolve())
    for record in site.glob("*.dist-info/RECORD"):  # their hashes must match what is shipped
        record.write_text(
            "".join(record_line(record.parent.parent, line, rewritten) for line in record.read_text().splitlines())
        )


def compile_python(build: Build, venv: Path, root: Path, targets: list[Path]) -> None:
    """Hash-checked byte code for targets, naming the installed paths (root stripped)."""
    run(
        [
            *(str(venv / "bin" / "python"), "-m", "compileall", "-q", "-j", "0"),
            *("--invalidation-mode", "checked-hash", "-s", str(root), "-p", "/", *map(str, targets)),
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
    for name in ("operations.md", "configuration.md", "security.md", "cluster.md", "clients.md", "logs.md", "mqtt.md"):
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
    (control / "md5sums").write_text(md5sums(root, control))
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
    top = rpm_topdir(build, "rpmbuild")
    unit = HERE / "common" / f"{NAME}.service"
    return rpmbuild(build, top, NAME, {"stagedir": str(build.tree), "unitfile": str(unit)})


def rpm_topdir(build: Build, name: str) -> Path:
    """An empty rpmbuild _topdir under the work folder."""
    top = build.work / name
    shutil.rmtree(top, ignore_errors=True)
    top.mkdir()
    return top


def rpmbuild(build: Build, top: Path, spec: str, defines: dict[str, str]) -> Path:
    """rpmbuild -bb on packaging/rpm/<spec>.spec in top, with mdversion and defines; its one RPM, copied to out."""
    run(
        [
            *("rpmbuild", "-bb", "--nodeps", "--quiet", str(HERE / "rpm" / f"{spec}.spec")),
            *("--define", f"_topdir {top}", "--define", f"mdversion {build.version}"),
            *(arg for name, value in defines.items() for arg in ("--define", f"{name} {value}")),
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


def spark_requirements() -> list[str]:
    """The `spark` extra of pyproject.toml: what `migratory logs analyze` imports besides the server."""
    with (REPO / "pyproject.toml").open("rb") as f:
        return [str(r) for r in tomllib.load(f)["project"]["optional-dependencies"]["spark"]]


def files_of(root: Path) -> dict[Path, bytes]:
    """Every file and symlink under root, relative, with its content (a symlink's: its target)."""
    found: dict[Path, bytes] = {}
    for path in root.rglob("*"):
        if path.is_symlink():
            found[path.relative_to(root)] = b"->" + os.readlink(path).encode()
        elif path.is_file():
            found[path.relative_to(root)] = hashlib.sha256(path.read_bytes()).digest()
    return found


def stage_analytics(build: Build) -> None:
    """The analytics payload: the files that migratory_spark and the spark extra add to a copy of the core venv."""
    prefix = PREFIX.relative_to("/")
    root = build.analytics_root
    shutil.rmtree(root, ignore_errors=True)
    (root / prefix).parent.mkdir(parents=True)
    shutil.copytree(build.tree / prefix, root / prefix, symlinks=True)
    before = files_of(root / prefix)
    venv = root / prefix
    src = build.work / "analytics-src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(
        REPO / "spark" / "migratory_spark",
        src / "migratory_spark",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "jars"),  # the jar is built below, for this PySpark
    )
    requirements = ", ".join(f'"{r}"' for r in spark_requirements())
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=77"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{ANALYTICS}"\nversion = "{build.version}"\nrequires-python = ">=3.11"\n'
        f'description = "Log analytics of migratorydata-py: the Spark jobs of `migratory logs analyze`"\n'
        f"dependencies = [{requirements}]\n\n"
        '[tool.setuptools]\npackages = ["migratory_spark"]\n'
    )
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "--disable-pip-version-check"]
    run(
        [
            *pip,
            *("install", "--quiet", "--no-compile", "--no-warn-script-location", *binary_only(ANALYTICS)),
            *("-c", str(HERE / "constraints.txt"), "-c", str(HERE / "constraints-analytics.txt"), str(src)),
        ],
        env=build.env,
    )
    site = next((venv / "lib").glob("python3.*/site-packages"))
    # the JVM line parser, compiled against the PySpark just installed (reproducible: see spark/build_jar.py)
    jar = ["--out", str(site / "migratory_spark" / "jars" / "migratory-spark.jar")]
    run([sys.executable, str(REPO / "spark" / "build_jar.py"), *jar, "--spark-jars", str(site / "pyspark" / "jars")])
    after = files_of(venv)
    changed = sorted(str(p) for p, digest in before.items() if after.get(p) != digest)
    if changed:
        raise SystemExit(f"installing the analytics changed files of the core package: {', '.join(changed[:10])}")
    added = sorted(p for p in after if p not in before)
    unbuild(venv, site, [venv / p for p in added])
    top_level = sorted({site / (venv / p).relative_to(site).parts[0] for p in added if (venv / p).is_relative_to(site)})
    compile_python(build, venv, root, [p for p in top_level if p.is_dir() or p.suffix == ".py"])
    tree = build.analytics_tree
    shutil.rmtree(tree, ignore_errors=True)
    for path in sorted(p for p in files_of(venv) if p not in before):
        source, target = venv / path, tree / prefix / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    doc = tree / "usr/share/doc" / ANALYTICS
    doc.mkdir(parents=True)
    shutil.copy2(tree.parent / "tree/usr/share/doc" / NAME / "copyright", doc / "copyright")
    if (REPO / "docs" / "analytics.md").exists():
        shutil.copy2(REPO / "docs" / "analytics.md", doc / "analytics.md")
    changelog = f"{ANALYTICS} ({build.version}) stable; urgency=medium\n\n  * Release {build.version}.\n\n"
    changelog += f" -- {MAINTAINER}  {rfc2822(build.epoch)}\n"
    write_gzip(doc / "changelog.Debian.gz", changelog.encode())
    leaked = [p for p in tree.rglob("*") if p.is_file() and str(build.work).encode() in p.read_bytes()]
    if leaked:
        raise SystemExit(f"build paths left in: {', '.join(str(p) for p in leaked[:10])}")
    normalise(tree, build.epoch)


def md5sums(root: Path, control: Path) -> str:
    sums = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        if control not in path.parents:
            sums.append(f"{hashlib.md5(path.read_bytes()).hexdigest()}  {path.relative_to(root)}\n")
    return "".join(sums)


def build_analytics_deb(build: Build) -> Path:
    """migratorydata-analytics_V_ARCH.deb: the analytics payload, needing the same core version and Java 17."""
    root = build.work / "analytics-deb"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(build.analytics_tree, root, symlinks=True)
    arch = deb_arch()
    control = root / "DEBIAN"
    control.mkdir()
    (control / "control").write_text(
        f"Package: {ANALYTICS}\nVersion: {build.version}\nArchitecture: {arch}\nMaintainer: {MAINTAINER}\n"
        f"Installed-Size: {installed_size_kib(root)}\n"
        f"Depends: {NAME} (= {build.version}), openjdk-17-jre-headless | java17-runtime-headless\n"
        "Section: net\nPriority: optional\n"
        "Description: log analytics for the migratorydata server (PySpark)\n"
        " The Spark jobs of `migratory logs analyze`: traffic, subjects, sessions,\n"
        " a security audit and latency from the server's access and message logs,\n"
        " as tables, Parquet, charts and an HTML report. Adds PySpark and its\n"
        " dependencies to the migratorydata package's environment in /opt/migratorydata.\n"
    )
    (control / "md5sums").write_text(md5sums(root, control))
    normalise(root, build.epoch)
    build.out.mkdir(parents=True, exist_ok=True)
    deb = build.out / f"{ANALYTICS}_{build.version}_{arch}.deb"
    # 0.9 GB, mostly jars and shared objects compressed already: zstd (dpkg >= 1.21.18, Debian 12) in a
    # fraction of xz's time, for about the same size
    run(
        ["dpkg-deb", "--root-owner-group", "-Zzstd", "-z6", "--build", str(root), str(deb)],
        env=build.env,
        stdout=sys.stderr,
    )
    return deb


def rpm_path(path: Path) -> str:
    """A %files entry: quoted, with rpm's glob characters escaped."""
    text = "/" + str(path)
    for char in "\\[]*?{}":
        text = text.replace(char, "\\" + char)
    return f'"{text}"'


def build_analytics_rpm(build: Build) -> Path:
    """rpmbuild -bb on packaging/rpm/migratorydata-analytics.spec with the payload's file list."""
    top = rpm_topdir(build, "rpmbuild-analytics")
    tree, core = build.analytics_tree, build.tree
    entries = []
    for path in sorted(tree.rglob("*")):
        relative = path.relative_to(tree)
        if path.is_dir() and not path.is_symlink():
            if not (core / relative).is_dir():
                entries.append(f"%dir {rpm_path(relative)}")
        else:
            entries.append(rpm_path(relative))
    filelist = top / "files.txt"
    filelist.write_text("\n".join(entries) + "\n")
    return rpmbuild(build, top, ANALYTICS, {"stagedir": str(tree), "filelist": str(filelist)})


def steps(names: list[str]) -> list[str]:
    """The build steps named (aliases expanded), in a fixed order, each once."""
    wanted = {step for name in names for step in ALIASES.get(name, [name])}
    return [step for step in ("deb", "rpm", "analytics-deb", "analytics-rpm") if step in wanted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    choices = ["stage", *STEP_TOOLS, *ALIASES]
    parser.add_argument("what", nargs="+", choices=choices, help="what to build (stage: the core tree only)")
    parser.add_argument("--version", default=None, help="package version (default: pyproject's)")
    parser.add_argument("--out", type=Path, default=REPO / "dist", help="where the packages go")
    parser.add_argument("--work", type=Path, default=REPO / "build" / "pkg", help="staging folder, emptied first")
    args = parser.parse_args(argv)
    todo = steps(args.what)
    require([PYTHON_TOOL, *(tool for step in todo for tool in STEP_TOOLS[step])])
    build = Build(args.version or project_version(), source_date_epoch(), args.work.resolve(), args.out.resolve())
    stage(build)
    if any(step.startswith("analytics") for step in todo):
        stage_analytics(build)
    builders = {
        "deb": build_deb,
        "rpm": build_rpm,
        "analytics-deb": build_analytics_deb,
        "analytics-rpm": build_analytics_rpm,
    }
    for step in todo:
        print(builders[step](build), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
