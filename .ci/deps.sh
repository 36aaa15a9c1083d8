#!/usr/bin/env bash
# System packages the test suite drives for real: Java for Spark, the peer servers of the benchmark
# comparison (NATS and Mosquitto from Debian), nftables and iproute2 for the DMZ test,
# openssl for the TLS test; for the packaging and image tests: Debian's python3.11 (the
# packaged venv's interpreter), debootstrap (the test chroot and the base image), rpm
# (rpmbuild, rpmsign), packer, qemu (qemu-img, the boot test) and extlinux (the base image's
# boot loader); for the repository tests (make repo): apt-ftparchive (apt-utils), gpg,
# createrepo_c and Debian's dnf (dnf --installroot from the yum repository). Idempotent;
# needs root and apt.
set -euo pipefail
need=()
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || need+=(nats-server)
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
# mosquitto_pub and mosquitto_sub: MQTT clients nobody here wrote (tests/test_mqtt.py)
command -v mosquitto_sub >/dev/null 2>&1 || need+=(mosquitto-clients)
command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || need+=(nftables)
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || need+=(iproute2)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
# Java 17+ for PySpark (the log analytics); pyspark itself comes from PyPI with the `spark` extra
java_major=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1 || true)
if [ -z "$java_major" ] || [ "$java_major" -lt 17 ]; then need+=(openjdk-17-jre-headless); fi
# and its compiler for the analytics' JVM line parser (spark/build_jar.py, `make jar`)
command -v javac >/dev/null 2>&1 || need+=(openjdk-17-jdk-headless)
[ -x /usr/bin/python3.11 ] || need+=(python3.11)
command -v dpkg-deb >/dev/null 2>&1 || need+=(dpkg)
[ -x /usr/sbin/debootstrap ] || need+=(debootstrap)
command -v rpmbuild >/dev/null 2>&1 || need+=(rpm)
command -v packer >/dev/null 2>&1 || need+=(packer)
command -v qemu-img >/dev/null 2>&1 || need+=(qemu-utils)
command -v qemu-system-x86_64 >/dev/null 2>&1 || need+=(qemu-system-x86)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
command -v setpriv >/dev/null 2>&1 || need+=(util-linux)
command -v sfdisk >/dev/null 2>&1 || [ -x /usr/sbin/sfdisk ] || need+=(fdisk)
[ -x /usr/bin/extlinux ] || [ -x /usr/sbin/extlinux ] || need+=(extlinux syslinux-common)
command -v ssh-keygen >/dev/null 2>&1 || need+=(openssh-client)
command -v pgrep >/dev/null 2>&1 || need+=(procps)
command -v mkfs.ext4 >/dev/null 2>&1 || [ -x /usr/sbin/mkfs.ext4 ] || need+=(e2fsprogs)
# headless Chromium for the browser tests (Playwright drives it; no browser download)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
# Node.js for the JavaScript client's tests (node --test)
command -v node >/dev/null 2>&1 || need+=(nodejs)
# npm (a separate Debian package): npm pack for the JavaScript client and MQTT.js (tests/test_mqtt_browser.py)
command -v npm >/dev/null 2>&1 || need+=(npm)
command -v apt-ftparchive >/dev/null 2>&1 || need+=(apt-utils)
command -v gpg >/dev/null 2>&1 || need+=(gnupg)
command -v gpgv >/dev/null 2>&1 || need+=(gpgv)
command -v createrepo_c >/dev/null 2>&1 || need+=(createrepo-c)
command -v dnf >/dev/null 2>&1 || need+=(dnf)
# a C compiler and Python's headers build the TLS record sealer (migratory/server/transport/_tlsseal.c): for the
# venv's interpreter (its headers come with it) and for Debian's python3.11 of the DEB/RPM builds
command -v gcc >/dev/null 2>&1 || need+=(gcc)
[ -f /usr/include/python3.11/Python.h ] || need+=(libpython3.11-dev)
# promtool (in Debian's prometheus package) checks the /metrics exposition as Prometheus itself parses it
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "missing system packages: ${need[*]} (run as root, or: sudo apt-get install ${need[*]})" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# Debian starts mosquitto as a service where it can; the tests start their own.
