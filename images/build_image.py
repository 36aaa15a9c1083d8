"""Validate the inputs of the appliance image and run Packer on images/migratorydata.pkr.hcl.

    python images/build_image.py validate --base BASE.qcow2 --deb migratorydata_V_ARCH.deb [--config FILE]
    python images/build_image.py build    --base BASE.qcow2 --deb migratorydata_V_ARCH.deb [--config FILE]

Checked before Packer runs, so a mistake costs seconds and not a VM boot: the DEB is a
migratorydata package, the base is a qcow2, the SSH key exists, and the configuration (the
packaged one unless --config is given) passes the server's own check. The firewall ports are
those the configuration listens on (Listen, ListenEncrypted, MonitorHTTP.Listen), so the
image opens exactly what the server serves. Then `packer validate` and, for build,
`packer build` with the same variables; the image is OUTPUT/migratorydata.qcow2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from migratory.config import Config, ConfigError

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "migratorydata.pkr.hcl"
PACKAGED_CONF = "./etc/migratorydata/migratorydata.conf"


class InputError(Exception):
    """An input Packer would fail on late; the message says which and why."""


def deb_field(deb: Path, field: str) -> str:
    done = subprocess.run(["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True)
    if done.returncode != 0:
        raise InputError(f"{deb}: not a Debian package ({done.stderr.strip()})")
    return done.stdout.strip()


def packaged_conf(deb: Path, into: Path) -> Path:
    """The DEB's own /etc/migratorydata/migratorydata.conf, extracted to into."""
    payload = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    target = into / "migratorydata.conf"
    with tempfile.TemporaryFile() as raw:
        raw.write(payload)
        raw.seek(0)
        with tarfile.open(fileobj=raw) as tar:
            member = tar.extractfile(PACKAGED_CONF)
            if member is None:
                raise InputError(f"{deb}: no {PACKAGED_CONF}")
            target.write_bytes(member.read())
    return target


def config_ports(conf: Path) -> list[int]:
    """The TCP ports the configuration listens on, validated exactly as the server validates the file."""
    try:
        config = Config.from_file(conf)
    except ConfigError as err:
        raise InputError(f"{conf} is not a valid configuration:\n{err}") from err
    endpoints = [*config.listen, *config.listen_encrypted, *config.monitor_listen]
    return sorted({e.port for e in endpoints})


def check_inputs(base: Path, deb: Path, key: Path) -> None:
    if deb_field(deb, "Package") != "migratorydata":
        raise InputError(f"{deb}: package {deb_field(deb, 'Package')!r}, expected migratorydata")
    if not base.is_file():
        raise InputError(f"{base}: no such base image (make image-base, or images/base_image.py)")
    info = subprocess.run(["qemu-img", "info", "--output=json", str(base)], capture_output=True, text=True)
    if info.returncode != 0 or json.loads(info.stdout).get("format") != "qcow2":
        raise InputError(f"{base}: not a qcow2 image")
    if not key.is_file():
        raise InputError(f"{key}: no SSH private key (images/base_image.py writes it beside the base image)")


def accelerator(choice: str) -> str:
    """kvm when asked for or, with auto, when /dev/kvm is usable; tcg (software emulation) otherwise."""
    if choice != "auto":
        return choice
    return "kvm" if os.access("/dev/kvm", os.R_OK | os.W_OK) else "tcg"


def packer_vars(args: argparse.Namespace, conf: Path, ports: list[int]) -> list[str]:
    values = {
        "base_image": str(args.base.resolve()),
        "deb": str(args.deb.resolve()),
        "config": str(conf.resolve()),
        "ports": json.dumps(ports),
        "ssh_private_key_file": str(args.ssh_key.resolve()),
        "output_directory": str(args.output.resolve()),
        "accelerator": accelerator(args.accel),
    }
    return [arg for name, value in values.items() for arg in ("-var", f"{name}={value}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["validate", "build"])
    parser.add_argument("--base", type=Path, required=True, help="base qcow2 (images/base_image.py)")
    parser.add_argument("--deb", type=Path, required=True, help="the migratorydata DEB (make deb)")
    parser.add_argument("--config", type=Path, default=None, help="migratorydata.conf for the image")
    parser.add_argument("--ssh-key", type=Path, default=None, help="Packer's key (default: beside the base)")
    parser.add_argument("--output", type=Path, default=Path("dist/image"), help="Packer's output folder")
    parser.add_argument("--accel", choices=["auto", "kvm", "tcg"], default="auto")
    parser.add_argument("--force", action="store_true", help="replace an existing output folder")
    args = parser.parse_args(argv)
    args.ssh_key = args.ssh_key or args.base.resolve().parent / "packer_ed25519"
    packer = shutil.which("packer")
    if packer is None:
        raise SystemExit("packer not found (apt-get install packer, or .ci/deps.sh)")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            check_inputs(args.base, args.deb, args.ssh_key)
            conf = args.config or packaged_conf(args.deb, Path(tmp))
            ports = config_ports(conf)
        except InputError as err:
            print(f"build_image: {err}", file=sys.stderr)
            return 2
        variables = packer_vars(args, conf, ports)
        print(f"image ports: {ports}, accelerator: {accelerator(args.accel)}", file=sys.stderr)
        # Packer's cache (port locks, a copy of a remote base) would otherwise land in images/.
        env = dict(os.environ, PACKER_CACHE_DIR=os.environ.get("PACKER_CACHE_DIR", str(Path(tmp) / "packer_cache")))
        done = subprocess.run([packer, "validate", *variables, str(TEMPLATE)], cwd=HERE, env=env)
        if done.returncode != 0 or args.action == "validate":
            return done.returncode
        if args.output.exists() and not args.force:
            print(f"build_image: {args.output} exists (remove it, or --force)", file=sys.stderr)
            return 2
        force = ["-force"] if args.force else []
        return subprocess.run([packer, "build", *force, *variables, str(TEMPLATE)], cwd=HERE, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
