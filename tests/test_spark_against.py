"""`migratory bench logs --against COMMIT`: an earlier commit's report beside this one's, on the same logs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from migratory_spark import against
from migratory_spark.generate import GenerateResult, generate

pytestmark = pytest.mark.slow

MIGRATORY = [sys.executable, "-m", "migratory_cli.main"]
TREE = str(Path(against.__file__).resolve().parents[2])  # this checkout (spark/migratory_spark/against.py)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> GenerateResult:
    return generate(str(tmp_path_factory.mktemp("logs")), 200_000, nodes=2)


def _in_git_checkout() -> bool:
    try:
        against.repository_root()
    except against.AgainstError:
        return False
    return True


def test_a_tree_is_timed_in_its_own_process(logs: GenerateResult, tmp_path: Path) -> None:
    result = against.timed_report(TREE, logs.folders, str(tmp_path / "report"), "local[1]", "1g")
    assert result["message_lines"] == logs.message_lines  # it read every line it was given
    assert result["start"] > 0 and result["analyze"] > 0
    assert result["total"] == pytest.approx(result["start"] + result["analyze"], abs=0.02)
    assert (tmp_path / "report" / "summary.json").is_file()


def test_a_failing_report_is_one_line_naming_the_tree(tmp_path: Path) -> None:
    with pytest.raises(against.AgainstError, match=r"the report of .* failed \(exit 1\): .*not a directory"):
        against.timed_report(TREE, [str(tmp_path / "none")], str(tmp_path), "local[1]", "1g")


def test_pairs_run_in_turn_on_the_same_logs(logs: GenerateResult, tmp_path: Path) -> None:
    if not _in_git_checkout():  # an installed package: the one-line refusal is the behaviour to check
        with pytest.raises(against.AgainstError, match=r"needs (the package to run from a git checkout|git)"):
            against.run_against("HEAD", logs.folders, str(tmp_path), rounds=1)
        return
    steps: list[str] = []
    result = against.run_against(
        "HEAD", logs.folders, str(tmp_path), rounds=1, master="local[1]", memory="1g", step=steps.append
    )
    (pair,) = result["rounds"]
    assert pair["baseline"]["message_lines"] == pair["current"]["message_lines"] == logs.message_lines
    assert pair["ratio_total"] == pytest.approx(pair["current"]["total"] / pair["baseline"]["total"], abs=0.001)
    assert result["ratio_total"]["median"] == result["ratio_total"]["max"] == pair["ratio_total"]
    assert len(result["commit"]) == 40 and steps[0].startswith("round 1/1: ")
    worktrees = subprocess.run(
        ["git", "-C", against.repository_root(), "worktree", "list"], capture_output=True, text=True, check=True
    ).stdout
    assert str(tmp_path) not in worktrees  # the checkout of the earlier commit is gone


def test_an_unknown_commit_is_refused_before_any_work(tmp_path: Path) -> None:
    done = subprocess.run(
        [*MIGRATORY, "bench", "logs", "--size", "1M", "--against", "no-such-commit", "--workdir", str(tmp_path / "w")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: --against") and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "w").exists()  # nothing generated
