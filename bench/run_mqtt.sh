#!/usr/bin/env bash
# The MQTT comparison of bench/peers.md: this server's MQTT listener (migratory-mqtt) beside its native
# WebSocket (migratory), Mosquitto (mqtt) and NATS with MQTT enabled (nats-mqtt), every MQTT target driven by
# the same MQTT 3.1.1 clients. Needs: make venv; nats-server and mosquitto (.ci/deps.sh); about 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
B=".venv/bin/migratory bench"
R=bench/results
ulimit -n "$(ulimit -Hn)"
SRC=127.0.0.2-127.0.0.5
T=migratory,migratory-mqtt,mqtt,nats-mqtt

# (a) idle connections: memory per connection, 16,000 clients subscribed to one subject each
$B peers --targets $T --clients 16000 --messages 0 --processes 4 --sources $SRC --workers 2 --json $R/mqtt-a-idle-16k.json
# (b) fan-out: one subject, 16,000 subscribers, 64-byte messages, saturation (closed-loop bursts of 50)
$B peers --targets $T --clients 16000 --messages 600 --burst 50 --processes 4 --sources $SRC --workers 2 --json $R/mqtt-b-fanout-16k-saturation.json
# (b) fan-out at 2 messages/s
$B peers --targets $T --clients 16000 --messages 20 --rate 2 --processes 4 --sources $SRC --workers 2 --json $R/mqtt-b-fanout-16k-2hz.json
# (c) the seeds' workload (preset seed-10m's shape): 100 subscribers a subject, a 512-byte message a minute
#     per client, for one minute: 16,000 clients, 160 subjects, 2.67 messages/s
$B peers --targets $T --clients 16000 --subjects 160 --size 512 --rate 2.6667 --messages 160 --processes 4 --sources $SRC --workers 2 --json $R/mqtt-c-seed-16k.json
