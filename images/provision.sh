#!/bin/sh
# Runs inside the image under Packer: install the DEB as a user would, put the optional
# configuration in place, enable the service, and let nftables accept only SSH and $PORTS.
set -eu

cd /root
apt-get install -y -q ./migratorydata.deb
# The log analytics when the build was given its DEB: Java 17 comes from Debian's mirror.
if [ -f /root/migratorydata-analytics.deb ]; then
    apt-get update -q
    apt-get install -y -q --no-install-recommends ./migratorydata-analytics.deb
fi
# The image's configuration (the packaged one unless the build was given another); if it
# differs from the packaged file, dpkg treats it as edited and keeps it on upgrade.
install -m 0640 -o root -g migratorydata /root/migratorydata.conf /etc/migratorydata/migratorydata.conf
migratory config check /etc/migratorydata/migratorydata.conf
systemctl enable migratorydata.service

ports=$(echo "${PORTS:-8800}" | tr ' ' ',')
# A cluster member: its cluster port(s) open to the other listed members only.
cluster_rules=""
if grep -q '^[[:space:]]*ClusterMembers[[:space:]]*=' /etc/migratorydata/migratorydata.conf; then
    cluster_rules=$(migratory cluster firewall /etc/migratorydata/migratorydata.conf | sed 's/^/        /')
fi
cat > /etc/nftables.conf <<EOF
#!/usr/sbin/nft -f
# Written by the migratorydata image build: SSH and the server's ports, nothing else.
flush ruleset
table inet filter {
    chain input {
        type filter hook input priority 0; policy drop;
        iif lo accept
        ct state established,related accept
        ct state invalid drop
        meta l4proto { 1, 58 } accept  # icmp, ipv6-icmp (by number: minbase has no /etc/protocols)
        tcp dport 22 accept
        tcp dport { $ports } accept
$cluster_rules
    }
    chain forward {
        type filter hook forward priority 0; policy drop;
    }
    chain output {
        type filter hook output priority 0; policy accept;
    }
}
EOF
nft -c -f /etc/nftables.conf
# Under this firewall every client connection is a conntrack entry (about 300 bytes of kernel
# memory); the kernel's default table (65,536 to 262,144 entries by memory) would refuse new
# clients long before a million. The module loads at boot so that the setting applies.
echo nf_conntrack > /etc/modules-load.d/migratorydata.conf
cat > /etc/sysctl.d/60-migratorydata.conf <<EOF
# Written by the migratorydata image build (docs/operations.md, "Many connections").
net.netfilter.nf_conntrack_max = 2097152
EOF
systemctl enable nftables.service
systemctl restart migratorydata.service
rm -f /root/migratorydata.deb /root/migratorydata-analytics.deb /root/no-analytics /root/migratorydata.conf /root/provision.sh
apt-get clean
