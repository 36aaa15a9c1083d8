#!/bin/bash
# usage: cpu.sh seconds -> per-process CPU (ms/s) of serve processes, labelled member/ppid
T=$1
declare -A a
for p in $(pgrep -f "migratory_cli.main serve"); do a[$p]=$(awk '{print $14+$15}' /proc/$p/stat); done
sleep $T
for p in "${!a[@]}"; do
  b=$(awk '{print $14+$15}' /proc/$p/stat 2>/dev/null) || continue
  m=$(tr '\0' ' ' < /proc/$p/cmdline | grep -o 'member-[0-9]*')
  pp=$(awk '{print $4}' /proc/$p/stat)
  echo "$m pid=$p ppid=$pp ms/s=$(( (b - ${a[$p]}) * 10 / T ))"
done | sort
