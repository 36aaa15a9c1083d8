#!/usr/bin/env bash
# Issue 18: the seeds' benchmark shape (--preset seed-10m) from 10,000 to 1,000,000 connections on
# this machine, on a member of a 2-member cluster (the publisher alone on the other member, so every
# delivery crosses a member link). Reports: bench/results/million-<N>.json; table: bench/million.md.
# The scaling points hold 60 s of publishing, the million the preset's 10 minutes.
# Usage: bash bench/million.sh [N ...]   (default: every point)
set -euo pipefail
cd "$(dirname "$0")/.."
ulimit -n 20000
points=("$@")
[ ${#points[@]} -gt 0 ] || points=(10000 50000 100000 250000 500000 1000000)
for n in "${points[@]}"; do
  hold=60
  [ "$n" -ge 1000000 ] && hold=600
  echo "== $n clients, hold $hold s, $(date -u +%H:%M:%S) UTC, load $(cut -d' ' -f1-3 /proc/loadavg)"
  .venv/bin/migratory bench run --spawn --preset seed-10m --clients "$n" --members 2 --hold "$hold" \
    --set BusBatchingTime=20 --drain 120 --json "bench/results/million-$n.json" \
    || echo "run of $n clients reported errors"
done
