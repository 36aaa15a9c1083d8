"""The report of an earlier commit beside this one's, on the same logs, in one run.

A speed goal stated against an earlier version ("half of today's time") is only
measured fairly on one machine in one sitting: a shared 2-core machine's speed
drifts by a fifth between days and by a tenth between runs. So the earlier
commit is checked out beside this tree (``git worktree``), and the two reports
run in turn, each in its own fresh process and JVM, on the same generated files.
The ratio of each pair (this commit's time over the earlier one's) is what the
goal is read from.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["AgainstError", "repository_root", "resolve_commit", "run_against", "timed_report"]

# Runs one whole report of the tree given and prints its start and analyse seconds. It runs under
# this interpreter but imports only from that tree, and adapts to the two session signatures
# build_session has had (with and without ``input_size``).
_RUNNER = """
import inspect, json, os, sys, time
tree, folders, out, master, memory = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
sys.path[:0] = [os.path.join(tree, "spark"), tree]
from migratory_spark import session
from migratory_spark.report import Options, run
kwargs = {"conf": {"spark.driver.memory": memory}}
if "input_size" in inspect.signature(session.build_session).parameters:
    kwargs["input_size"] = session.input_bytes(folders)
began = time.perf_counter()
spark = session.build_session(master, app_name="migratory-logs-bench", **kwargs)
started = time.perf_counter() - began
began = time.perf_counter()
summary = run(spark, Options(dirs=folders, out=out))
analysed = time.perf_counter() - began
spark.stop()
lines = summary.get("lines", {})
print(json.dumps({"start": started, "analyze": analysed, "message_lines": lines.get("message")}))
"""


# what each pair's ratio is taken of: start + analyze, and analyze alone
_MEASURES = ("total", "analyze")


class AgainstError(RuntimeError):
    """The earlier commit could not be checked out or its report failed (the message says which)."""


def repository_root() -> str:
    """The git checkout this package runs from (``--against`` needs one)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        done = subprocess.run(
            ["git", "-C", here, "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=False
        )
    except OSError as exc:  # no git at all
        raise AgainstError(f"--against needs git: {exc.strerror or exc}") from None
    if done.returncode != 0:
        raise AgainstError("--against needs the package to run from a git checkout (it is installed elsewhere)")
    return done.stdout.strip()


def resolve_commit(commit: str) -> tuple[str, str]:
    """The checkout's root and the commit's full id; AgainstError if either is missing."""
    root = repository_root()
    resolved = subprocess.run(
        ["git", "-C", root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if resolved.returncode != 0:
        raise AgainstError(f"--against {commit}: no such commit in {root}")
    return root, resolved.stdout.strip()


def timed_report(tree: str, folders: Sequence[str], out: str, master: str, memory: str) -> dict[str, Any]:
    """Run the whole report of ``tree`` in a fresh interpreter and JVM; its start and analyse seconds."""
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, tree, json.dumps(list(folders)), out, master, memory],
        capture_output=True,
        text=True,
        check=False,
        cwd=tree,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise AgainstError(f"the report of {tree} failed (exit {done.returncode}): {tail}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["total"] = result["start"] + result["analyze"]
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}


def run_against(
    commit: str,
    folders: Sequence[str],
    workdir: str,
    rounds: int = 3,
    master: str = "local[*]",
    memory: str = "4g",
    step: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """``rounds`` pairs (the earlier commit's report, then this tree's), interleaved; each pair's ratio."""
    root, full = resolve_commit(commit)
    os.makedirs(workdir, exist_ok=True)
    baseline = tempfile.mkdtemp(prefix="against-", dir=workdir)
    added = subprocess.run(
        ["git", "-C", root, "worktree", "add", "--detach", baseline, full], capture_output=True, text=True, check=False
    )
    if added.returncode != 0:
        raise AgainstError(f"--against {commit}: git worktree add failed: {added.stderr.strip()}")
    pairs: list[dict[str, Any]] = []
    try:
        for index in range(rounds):
            step(f"round {index + 1}/{rounds}: {full[:9]}")
            before = timed_report(baseline, folders, os.path.join(workdir, "report-baseline"), master, memory)
            step(f"round {index + 1}/{rounds}: this tree")
            now = timed_report(root, folders, os.path.join(workdir, "report-current"), master, memory)
            if before.get("message_lines") != now.get("message_lines"):
                raise AgainstError(
                    f"the two reports read different logs ({before.get('message_lines')} and "
                    f"{now.get('message_lines')} message lines)"
                )
            pair: dict[str, Any] = {"baseline": before, "current": now}
            for measure in _MEASURES:
                pair[f"ratio_{measure}"] = round(now[measure] / before[measure], 3)
            pairs.append(pair)
    finally:
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", baseline], capture_output=True, check=False)
        subprocess.run(["git", "-C", root, "worktree", "prune"], capture_output=True, check=False)  # if interrupted
    summary: dict[str, Any] = {"commit": full, "rounds": pairs}
    for measure in _MEASURES:
        ratios = [p[f"ratio_{measure}"] for p in pairs]
        summary[f"ratio_{measure}"] = {"median": statistics.median(ratios), "max": max(ratios)}
    return summary
