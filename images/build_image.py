"""Validate the inputs of the appliance image and run Packer on images/migratorydata.pkr.hcl.

    python images/build_image.py validate --base BASE.qcow2 --deb migratorydata_V_ARCH.deb [--config FILE]
    python images/build_image.py build    --base BASE.qcow2 --deb migratorydata_V_ARCH.deb [--config FILE]
        [--analytics-deb migratorydata-analytics_V_ARCH.deb] [--accel auto|kvm|tcg]

Checked before Packer runs, so a mistake costs seconds and not a VM boot: the DEB is a
migratorydata package (and the analytics DEB a migratorydata-analytics of the same version),
the base is a qcow2, the SSH key exists, and the configuration (the packaged one unless
--config is given) passes the server's own parse. The firewall ports are those the
configuration listens on other than loopback (Listen, ListenEncrypted, ListenMqtt,
ListenMqttEncrypted, MonitorHTTP.Listen, MonitorHTTP.ListenEncrypted), so the image opens exactly
what the server serves to others.
Then `packer validate` and, for build, `packer build` with the same variables; the image is
OUTPUT/migratorydata.qcow2. --accel auto uses KVM when /dev/kvm creates a VM and, for a build,
a throwaway KVM boot of the base image reaches its init; else TCG, software emulation.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
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


def loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def config_ports(conf: Path) -> list[int]:
    """The TCP ports the configuration listens on for other machines, the file validated as the server does."""
    try:
        config = Config.from_file(conf)
    except ConfigError as err:
        raise InputError(f"{conf} is not a valid configuration:\n{err}") from err
    endpoints = [
        *config.listen,
        *config.listen_encrypted,
        *config.listen_mqtt,
        *config.listen_mqtt_encrypted,
        *config.monitor_listen,
        *config.monitor_listen_encrypted,
    ]
    return sorted({e.port for e in endpoints if not loopback(e.host)})


def check_inputs(base: Path, deb: Path, key: Path, analytics: Path | None = None) -> None:
    if deb_field(deb, "Package") != "migratorydata":
        raise InputError(f"{deb}: package {deb_field(deb, 'Package')!r}, expected migratorydata")
    if analytics is not None:
        if deb_field(analytics, "Package") != "migratorydata-analytics":
            raise InputError(
                f"{analytics}: package {deb_field(analytics, 'Package')!r}, expected migratorydata-analytics"
            )
        version, expected = deb_field(analytics, "Version"), deb_field(deb, "Version")
        if version != expected:
            raise InputError(f"{analytics}: version {version}, the server DEB's is {expected}")
    if not base.is_file():
        raise InputError(f"{base}: no such base image (make image-base, or images/base_image.py)")
    info = subprocess.run(["qemu-img", "info", "--output=json", str(base)], capture_output=True, text=True)
    if info.returncode != 0 or json.loads(info.stdout).get("format") != "qcow2":
        raise InputError(f"{base}: not a qcow2 image")
    if not key.is_file():
        raise InputError(f"{key}: no SSH private key (images/base_image.py writes it beside the base image)")


KVM_GET_API_VERSION = 0xAE00
KVM_CREATE_VM = 0xAE01


def kvm_works(device: str = "/dev/kvm") -> bool:
    """Whether KVM can run a VM here: the device opens, speaks API 12 and creates a VM (nested or not)."""
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if fcntl.ioctl(fd, KVM_GET_API_VERSION, 0) != 12:
            return False
        os.close(fcntl.ioctl(fd, KVM_CREATE_VM, 0))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


BOOTED = (b"Run /sbin/init", b"Welcome to ", b"login:")
KVM_FAILED = (
    b"KVM internal error",
    b"emulation failure",
    b"failed to initialize",
    b"No bootable device",
    b"Boot failed",
)


def kvm_boots(image: Path, timeout: float = 90.0) -> bool:
    """Whether this image's boot gets to its init under KVM here (a throwaway -snapshot run).

    Creating a VM is not enough: nested KVM without unrestricted-guest support dies with an
    "emulation failure" in SYSLINUX's mode switches, which only a real boot shows.
    """
    qemu = shutil.which("qemu-system-x86_64")
    if qemu is None:
        return False
    with tempfile.TemporaryFile() as console:
        proc = subprocess.Popen(
            [
                *(qemu, "-accel", "kvm", "-m", "512", "-smp", "1", "-nographic", "-snapshot", "-no-reboot"),
                *("-drive", f"file={image},if=virtio,format=qcow2", "-nic", "none"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                time.sleep(0.5)
                console.seek(0)
                seen = console.read()
                if any(marker in seen for marker in KVM_FAILED) or proc.poll() is not None:
                    return False
                if any(marker in seen for marker in BOOTED):
                    return True
            return False
        finally:
            proc.kill()
            proc.wait()


def accelerator(choice: str, image: Path | None = None, timeout: float = 90.0) -> str:
    """kvm when asked for or, with auto, when KVM works (and boots image within timeout, when given); tcg otherwise."""
    if choice != "auto":
        return choice
    if not kvm_works():
        return "tcg"
    return "kvm" if image is None or kvm_boots(image, timeout) else "tcg"


def packer_vars(args: argparse.Namespace, conf: Path, ports: list[int], accel: str) -> list[str]:
    values = {
        "base_image": str(args.base.resolve()),
        "deb": str(args.deb.resolve()),
        "config": str(conf.resolve()),
        "ports": json.dumps(ports),
        "ssh_private_key_file": str(args.ssh_key.resolve()),
        "output_directory": str(args.output.resolve()),
        "accelerator": accel,
        "analytics_deb": str(args.analytics_deb.resolve()) if args.analytics_deb else "",
    }
    return [arg for name, value in values.items() for arg in ("-var", f"{name}={value}")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["validate", "build"])
    parser.add_argument("--base", type=Path, required=True, help="base qcow2 (images/base_image.py)")
    parser.add_argument("--deb", type=Path, required=True, help="the migratorydata DEB (make deb)")
    parser.add_argument("--analytics-deb", type=Path, default=None, help="also install migratorydata-analytics")
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
            check_inputs(args.base, args.deb, args.ssh_key, args.analytics_deb)
            conf = args.config or packaged_conf(args.deb, Path(tmp))
            ports = config_ports(conf)
        except InputError as err:
            print(f"build_image: {err}", file=sys.stderr)
            return 2
        # a build boots the base image: KVM only if it gets through that boot here (validate boots nothing)
        accel = accelerator(args.accel, args.base.resolve() if args.action == "build" else None)
        variables = packer_vars(args, conf, ports, accel)
        with_analytics = ", with analytics" if args.analytics_deb else ""
        print(f"image ports: {ports}, accelerator: {accel}{with_analytics}", file=sys.stderr)
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
