#!/bin/bash
# issue 33: the server before (92bbcee, flat migratory/server) and after (3eaa5ec, by concern), alternating
ulimit -n 20000
cd /work/main
SRC=127.0.0.2-127.0.0.5
for pass in 1 2; do
  for side in before after; do
    if [ $side = before ]; then cd /tmp/before; export PYTHONPATH=/tmp/before:/tmp/before/cli:/tmp/before/spark; else cd /work/main; unset PYTHONPATH; fi
    B="/work/main/.venv/bin/python -m migratory_cli.main bench peers --targets migratory --processes 4 --sources $SRC --workers 1"
    $B --clients 8000 --messages 0 --idle 5 --json /tmp/b33/idle-$side-$pass.json > /tmp/b33/idle-$side-$pass.log 2>&1
    $B --clients 4000 --messages 20 --rate 2 --json /tmp/b33/2hz-$side-$pass.json > /tmp/b33/2hz-$side-$pass.log 2>&1
    $B --clients 4000 --messages 200 --burst 50 --json /tmp/b33/sat-$side-$pass.json > /tmp/b33/sat-$side-$pass.log 2>&1
    echo "$side $pass done $(date +%T)" >> /tmp/b33/progress
  done
done
