"""Make a bootable Debian bookworm disk image from Debian's packages alone: debootstrap, mkfs.ext4, extlinux, qemu-img.

This is the base image the Packer template starts from, for machines that can reach Debian's
mirror but nothing else (no cloud image download). The disk has one MBR partition (ext4,
label mdroot) booted by extlinux, the Debian kernel with a console on ttyS0, systemd-networkd
doing DHCP on the first Ethernet interface, OpenSSH with root allowed by key only, nftables,
and python3.11 (the migratorydata package's interpreter), so the package installs offline.

    python images/base_image.py --out dist/debian-12-base.qcow2 [--ssh-key dist/packer_ed25519]

Needs root (debootstrap, a loop mount for extlinux). The private key that Packer uses is
created next to the image when missing; its public half is root's authorized key.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGES = [
    "linux-image-amd64",
    "initramfs-tools",
    "systemd-sysv",
    "udev",
    "kmod",
    "openssh-server",
    "nftables",
    "python3.11",
    "iproute2",
    "ca-certificates",
]
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
PART_OFFSET = 1024 * 1024  # the partition starts at 1 MiB
MBR_BIN = Path("/usr/lib/syslinux/mbr/mbr.bin")
EXTLINUX_MODULES = Path("/usr/lib/syslinux/modules/bios")


def run(*cmd: str, **kwargs: object) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(list(cmd), check=True, **kwargs)  # type: ignore[call-overload]


def ssh_key(path: Path) -> str:
    """The public key of path, creating an ed25519 pair there first when missing."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "packer@migratorydata", "-f", str(path))
    return Path(f"{path}.pub").read_text().strip()


def configure(root: Path, public_key: str) -> str:
    """Files that make the tree a machine: fstab, hostname, network, root's key, boot menu. Returns the kernel."""
    (root / "etc/fstab").write_text("LABEL=mdroot / ext4 errors=remount-ro 0 1\n")
    (root / "etc/hostname").write_text("migratorydata\n")
    (root / "etc/hosts").write_text("127.0.0.1 localhost\n127.0.1.1 migratorydata\n::1 localhost ip6-localhost\n")
    (root / "etc/machine-id").write_text("")  # each boot of a copy makes its own
    network = root / "etc/systemd/network/20-dhcp.network"
    network.parent.mkdir(parents=True, exist_ok=True)
    network.write_text("[Match]\nName=en* eth*\n\n[Network]\nDHCP=yes\n")
    ssh = root / "root/.ssh"
    ssh.mkdir(mode=0o700, exist_ok=True)
    (ssh / "authorized_keys").write_text(public_key + "\n")
    (ssh / "authorized_keys").chmod(0o600)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C.UTF-8"}
    run("chroot", str(root), "systemctl", "enable", "systemd-networkd", "ssh", "serial-getty@ttyS0", env=env)
    run("chroot", str(root), "passwd", "--lock", "root", env=env)
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise SystemExit("no kernel in /boot: linux-image-amd64 did not install")
    kernel = kernels[-1].name
    initrd = "initrd.img-" + kernel.removeprefix("vmlinuz-")
    extlinux = root / "boot/extlinux"
    extlinux.mkdir(parents=True, exist_ok=True)
    (extlinux / "extlinux.conf").write_text(
        "SERIAL 0 115200\nDEFAULT debian\nPROMPT 0\nTIMEOUT 1\n\nLABEL debian\n"
        f"  LINUX /boot/{kernel}\n  INITRD /boot/{initrd}\n"
        "  APPEND root=LABEL=mdroot ro console=ttyS0,115200 net.ifnames=1\n"
    )
    for module in ("ldlinux.c32", "libcom32.c32", "libutil.c32", "menu.c32"):
        shutil.copy2(EXTLINUX_MODULES / module, extlinux / module)
    return kernel


def make_disk(root: Path, raw: Path, size_mib: int) -> None:
    """MBR + one bootable ext4 partition filled from root (mkfs.ext4 -d), extlinux installed through a loop mount."""
    fs = raw.with_suffix(".ext4")
    fs_bytes = size_mib * 1024 * 1024 - PART_OFFSET
    # extlinux 6.04 reads neither 64-bit ext4 nor metadata checksums.
    run(
        "mkfs.ext4",
        "-q",
        "-F",
        "-L",
        "mdroot",
        "-O",
        "^64bit,^metadata_csum,^orphan_file",
        "-d",
        str(root),
        str(fs),
        f"{fs_bytes // 1024}k",
    )
    with raw.open("wb") as f:
        f.truncate(size_mib * 1024 * 1024)
    run("sfdisk", "--quiet", str(raw), input=b"label: dos\nstart=2048, type=83, bootable\n")
    run(
        "dd",
        f"if={fs}",
        f"of={raw}",
        "bs=1M",
        f"seek={PART_OFFSET // (1024 * 1024)}",
        "conv=notrunc,sparse",
        "status=none",
    )
    fs.unlink()
    run("dd", f"if={MBR_BIN}", f"of={raw}", "bs=440", "count=1", "conv=notrunc", "status=none")
    with tempfile.TemporaryDirectory() as mnt:
        run("mount", "-o", f"loop,offset={PART_OFFSET}", str(raw), mnt)
        try:
            run("extlinux", "--install", f"{mnt}/boot/extlinux")
        finally:
            run("umount", mnt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the qcow2 to write")
    parser.add_argument("--ssh-key", type=Path, default=None, help="private key for Packer (default: OUT's folder)")
    parser.add_argument("--size", type=int, default=6144, help="disk size in MiB (room for the analytics: Spark, Java)")
    parser.add_argument("--suite", default="bookworm")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("needs root: debootstrap and a loop mount")
    out: Path = args.out.resolve()
    key = (args.ssh_key or out.parent / "packer_ed25519").resolve()
    public_key = ssh_key(key)
    with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
        root = Path(tmp) / "root"
        run("debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", args.suite, str(root), MIRROR)
        kernel = configure(root, public_key)
        raw = Path(tmp) / "disk.raw"
        make_disk(root, raw, args.size)
        out.parent.mkdir(parents=True, exist_ok=True)
        run("qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(out))
    print(f"{out} ({kernel}); ssh key {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
