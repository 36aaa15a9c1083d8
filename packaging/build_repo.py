"""Signed package repositories from the built packages: an apt repository and a yum/dnf repository.

    python packaging/build_repo.py [--packages dist] [--out dist/repo] [--gpg-home DIR] [--key ID]
                                   [--generate-key] [--url URL] [--formats apt,yum]

apt (OUT/apt): pool/main/*.deb, dists/stable/main/binary-ARCH/Packages(.gz) and
dists/stable/Release by apt-ftparchive, signed into InRelease and Release.gpg. yum (OUT/yum):
Packages/*.rpm, each signed with rpmsign, repodata/ by createrepo_c, repodata/repomd.xml.asc.
The public key is OUT/migratorydata-archive-keyring.gpg (binary, for apt's Signed-By) and
OUT/RPM-GPG-KEY-migratorydata (armored, for dnf's gpgkey); OUT/migratorydata.sources and
OUT/migratorydata.repo are the client files for URL.

The pools are additive: the packages of earlier runs stay and the indexes list every version,
so publishing a newer build gives clients an `apt upgrade` / `dnf upgrade`.

The key: --key (a key id or fingerprint in --gpg-home, default $GNUPGHOME or ~/.gnupg) signs
for real. --generate-key, when no key is given, makes a passphrase-less RSA key in
OUT/../repo-gnupg (kept and reused) so that tests and trials get a signed repository: never
publish with it.
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

from build_packages import Tool, require

REPO = Path(__file__).resolve().parent.parent
ORIGIN = "migratorydata"
SUITE = "stable"
COMPONENT = "main"
KEY_NAME = "migratorydata repository signing key (generated for tests) <repo@migratorydata.invalid>"

APT_FTPARCHIVE = Tool("apt-ftparchive", "indexes the apt repository", "apt-utils", "")
GPG = Tool("gpg", "signs both repositories", "gnupg", "gnupg2")
CREATEREPO = Tool("createrepo_c", "indexes the yum repository", "createrepo-c", "createrepo_c")
RPMSIGN = Tool("rpmsign", "signs the RPMs", "rpm", "rpm-sign")
DPKG_DEB = Tool("dpkg-deb", "reads the architecture of the DEBs", "dpkg", "dpkg")


def run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[bytes]:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kwargs)  # type: ignore[call-overload, no-any-return]


class Signer:
    """gpg with one home and one key; every call is batch mode (no terminal, no prompt)."""

    def __init__(self, home: Path, key: str) -> None:
        self.home = home
        self.key = key

    def gpg(self, *args: str, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
        return run(["gpg", "--homedir", str(self.home), "--batch", "--yes", *args], **kwargs)

    def export(self, path: Path, armor: bool) -> None:
        self.gpg(*(["--armor"] if armor else []), "--output", str(path), "--export", self.key)

    def clearsign(self, source: Path, target: Path) -> None:
        self.gpg(
            "--local-user", self.key, "--digest-algo", "SHA512", "--output", str(target), "--clearsign", str(source)
        )

    def detach(self, source: Path, target: Path, armor: bool = True) -> None:
        armor_args = ["--armor"] if armor else []
        self.gpg(
            "--local-user",
            self.key,
            "--digest-algo",
            "SHA512",
            *armor_args,
            "--output",
            str(target),
            "--detach-sign",
            str(source),
        )

    def fingerprint(self) -> str:
        done = subprocess.run(
            ["gpg", "--homedir", str(self.home), "--batch", "--with-colons", "--list-secret-keys", self.key],
            capture_output=True,
            text=True,
        )
        for line in done.stdout.splitlines():
            if line.startswith("fpr:"):
                return line.split(":")[9]
        raise SystemExit(f"build_repo: no secret key {self.key!r} in {self.home} (gpg --list-secret-keys)")


def generated_key(home: Path) -> Signer:
    """A passphrase-less RSA 3072 signing key in home, made once and reused."""
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    home.chmod(0o700)
    listed = subprocess.run(
        ["gpg", "--homedir", str(home), "--batch", "--with-colons", "--list-secret-keys"],
        capture_output=True,
        text=True,
    )
    if "fpr:" not in listed.stdout:
        print(f"build_repo: generating a throwaway signing key in {home} (never publish with it)", file=sys.stderr)
        run(
            [
                *("gpg", "--homedir", str(home), "--batch", "--passphrase", ""),
                *("--quick-generate-key", KEY_NAME, "rsa3072", "sign", "never"),
            ]
        )
    signer = Signer(home, KEY_NAME)
    signer.key = signer.fingerprint()
    return signer


def deb_arch(deb: Path) -> str:
    return subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Architecture"], capture_output=True, text=True, check=True
    ).stdout.strip()


def build_apt(debs: list[Path], out: Path, signer: Signer) -> None:
    """OUT/apt: pool and signed dists/stable, indexed by apt-ftparchive."""
    apt = out / "apt"
    pool = apt / "pool" / COMPONENT
    pool.mkdir(parents=True, exist_ok=True)
    for deb in debs:
        shutil.copy2(deb, pool / deb.name)
    architectures = sorted({deb_arch(deb) for deb in pool.glob("*.deb")} - {"all"}) or ["amd64"]
    dist = apt / "dists" / SUITE
    shutil.rmtree(dist, ignore_errors=True)
    for arch in architectures:
        binary = dist / COMPONENT / f"binary-{arch}"
        binary.mkdir(parents=True)
        packages = run(
            ["apt-ftparchive", "--arch", arch, "packages", f"pool/{COMPONENT}"], cwd=apt, capture_output=True
        ).stdout
        (binary / "Packages").write_bytes(packages)
        with (binary / "Packages.gz").open("wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as gz:
            gz.write(packages)
    options = {
        "Origin": ORIGIN,
        "Label": ORIGIN,
        "Suite": SUITE,
        "Codename": SUITE,
        "Architectures": " ".join(architectures),
        "Components": COMPONENT,
        "Description": "migratorydata server packages",
    }
    settings = [arg for key, value in options.items() for arg in ("-o", f"APT::FTPArchive::Release::{key}={value}")]
    release = run(["apt-ftparchive", *settings, "release", "."], cwd=dist, capture_output=True).stdout
    (dist / "Release").write_bytes(release)
    signer.clearsign(dist / "Release", dist / "InRelease")
    signer.detach(dist / "Release", dist / "Release.gpg")


def build_yum(rpms: list[Path], out: Path, signer: Signer) -> None:
    """OUT/yum: signed RPMs, repodata by createrepo_c, and repomd.xml's detached signature."""
    yum = out / "yum"
    packages = yum / "Packages"
    packages.mkdir(parents=True, exist_ok=True)
    for rpm in rpms:
        target = packages / rpm.name
        shutil.copy2(rpm, target)
        run(
            [
                "rpmsign",
                "--define",
                f"__gpg {shutil.which('gpg') or 'gpg'}",  # Debian's rpm looks for gpg2
                "--define",
                f"_gpg_path {signer.home}",
                "--define",
                f"_gpg_name {signer.key}",
                "--define",
                "_gpg_sign_cmd_extra_args --batch",
                "--addsign",
                str(target),
            ],
            stdout=subprocess.DEVNULL,
        )
    run(["createrepo_c", "--quiet", "--update", str(yum)])
    signer.detach(yum / "repodata" / "repomd.xml", yum / "repodata" / "repomd.xml.asc")


def client_files(out: Path, url: str) -> None:
    """What a machine adds to use the repositories (docs/operations.md shows where each goes)."""
    (out / "migratorydata.sources").write_text(
        f"Types: deb\nURIs: {url}/apt\nSuites: {SUITE}\nComponents: {COMPONENT}\n"
        "Signed-By: /etc/apt/keyrings/migratorydata-archive-keyring.gpg\n"
    )
    (out / "migratorydata.repo").write_text(
        f"[migratorydata]\nname=migratorydata\nbaseurl={url}/yum\nenabled=1\n"
        f"gpgcheck=1\nrepo_gpgcheck=1\ngpgkey={url}/RPM-GPG-KEY-migratorydata\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packages", type=Path, action="append", help="folder of .deb and .rpm (default: dist)")
    parser.add_argument("--out", type=Path, default=REPO / "dist" / "repo", help="the repositories' folder")
    parser.add_argument("--gpg-home", type=Path, default=None, help="GnuPG home of the key (default: $GNUPGHOME)")
    parser.add_argument("--key", default=os.environ.get("MIGRATORY_REPO_KEY"), help="signing key id or fingerprint")
    parser.add_argument("--generate-key", action="store_true", help="without --key: make (or reuse) a test key")
    parser.add_argument("--url", default="https://packages.example.com/migratorydata", help="where OUT is served")
    parser.add_argument("--formats", default="apt,yum", help="apt, yum or both (comma-separated)")
    parser.add_argument("--check-tools", action="store_true", help="only check that the tools are installed")
    args = parser.parse_args(argv)
    formats = {f.strip() for f in args.formats.split(",") if f.strip()}
    if not formats <= {"apt", "yum"}:
        parser.error(f"--formats: apt and yum only, not {', '.join(sorted(formats - {'apt', 'yum'}))}")
    tools = [GPG]
    tools += [APT_FTPARCHIVE, DPKG_DEB] if "apt" in formats else []
    tools += [CREATEREPO, RPMSIGN] if "yum" in formats else []
    require(tools, "build_repo")
    if args.check_tools:
        return 0
    folders = args.packages or [REPO / "dist"]
    debs = sorted(p for folder in folders for p in folder.glob("*.deb"))
    rpms = sorted(p for folder in folders for p in folder.glob("*.rpm"))
    if ("apt" in formats and not debs) or ("yum" in formats and not rpms):
        names = ", ".join(str(f) for f in folders)
        raise SystemExit(f"build_repo: no packages in {names} (make packages first)")
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.key:
        home = (args.gpg_home or Path(os.environ.get("GNUPGHOME", Path.home() / ".gnupg"))).resolve()
        signer = Signer(home, args.key)
        signer.key = signer.fingerprint()
    elif args.generate_key:
        signer = generated_key((args.gpg_home or out.parent / "repo-gnupg").resolve())
    else:
        raise SystemExit("build_repo: no signing key: give --key ID (and --gpg-home), or --generate-key for a test key")
    try:
        signer.export(out / "migratorydata-archive-keyring.gpg", armor=False)
        signer.export(out / "RPM-GPG-KEY-migratorydata", armor=True)
        if "apt" in formats:
            build_apt(debs, out, signer)
        if "yum" in formats:
            build_yum(rpms, out, signer)
    finally:  # gpg started an agent for this home: stop it rather than leave it running
        subprocess.run(["gpgconf", "--homedir", str(signer.home), "--kill", "gpg-agent"], check=False)
    client_files(out, args.url.rstrip("/"))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
