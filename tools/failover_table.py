"""The table of bench/failover.md from the JSON files of `migratory bench failover --json` (one row per mode and fault).

.venv/bin/python tools/failover_table.py bench/results/fo-48-G.json bench/results/fo-48-S.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _rows(documents: list[dict[str, Any]]) -> list[str]:
    rounds: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for document in documents:
        for result in document["rounds"]:
            rounds.setdefault((result["mode"], result["fault"]), []).append(result)
    out = [
        "| mode | fault | rounds | ok | acknowledged | client gap p50 / p99 / max (s) "
        "| faulted member's clients unserved p50 / max (s), moved | ack gap p50 / max (s) |",
        "| --- | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for (mode, fault), results in sorted(rounds.items()):
        gaps = sorted(g for r in results for g in r["gaps"])
        victim = sorted(g for r in results for g in r.get("victim_gaps", []))
        acks = sorted(g for r in results for g in r["ack_gaps"])
        moved = sum(r.get("victim_moved", 0) for r in results)
        clients = sum(r.get("victim_clients", 0) for r in results)

        def q(values: list[float], p: float) -> str:
            return f"{values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]:.3f}" if values else "-"

        out.append(
            f"| {mode} | {fault} | {len(results)} | {sum(1 for r in results if r['ok'])} | "
            f"{sum(r['acked'] for r in results):,} | {q(gaps, 50)} / {q(gaps, 99)} / {q(gaps, 100)} | "
            f"{q(victim, 50)} / {q(victim, 100)}, {moved} of {clients} | {q(acks, 50)} / {q(acks, 100)} |"
        )
    return out


def main() -> int:
    documents = [json.loads(Path(name).read_text()) for name in sys.argv[1:]]
    print("\n".join(_rows(documents)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
