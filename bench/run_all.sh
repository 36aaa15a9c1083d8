#!/usr/bin/env bash
# Reproduce every figure of bench/peers.md (JSON reports land in bench/results/).
# Needs: make venv; nats-server and mosquitto (.ci/deps.sh); about 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
B=".venv/bin/migratory bench"
R=bench/results
ulimit -n "$(ulimit -Hn)"
SRC=127.0.0.2-127.0.0.5
PEERS=migratory,nats,mqtt,ws-broadcast,websockets

# (a) idle connections: memory per connection, 16,000 subscribed clients
$B peers --targets $PEERS --clients 16000 --messages 0 --processes 4 --sources $SRC --workers 2 --json $R/a-idle-16k.json
# (b) fan-out: one subject, 16,000 subscribers, 64-byte messages, saturation (closed-loop bursts of 50)
$B peers --targets $PEERS --clients 16000 --messages 600 --burst 50 --processes 4 --sources $SRC --workers 2 --json $R/b-fanout-16k-saturation.json
# (b) fan-out at 2 messages/s (no coalescing possible)
$B peers --targets $PEERS --clients 16000 --messages 20 --rate 2 --processes 4 --sources $SRC --workers 2 --json $R/b-fanout-16k-2hz.json
# (c) market data: 10,000 subjects, 100,000 subscribers with 10 subjects each, 1,000 messages/s in total
#     (one process may hold 20,000 files: 6 workers; the peers cannot hold 100,000 connections in one process here)
$B run --spawn --workers 6 --clients 100000 --subjects 10000 --subjects-per-client 10 --rate 1000 --messages 20000 \
  --processes 7 --sources 127.0.0.2-127.0.0.8 --json $R/c-market-100k.json
# (d) connection storm: connect rate, and memory returned once everyone disconnected
$B run --spawn --workers 2 --clients 16000 --messages 0 --processes 4 --sources $SRC --disconnect --json $R/d-storm-16k.json
