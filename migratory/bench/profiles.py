"""py-spy profiles of every process of the servers under test, and what they say in a few lines.

A benchmark's servers are several processes (a supervisor, its member agent, its workers; three
members): each is sampled on its own (``py-spy record --nonblocking``, collapsed stacks), so the
time a publication costs can be told apart per hop. py-spy is a development tool, not a dependency
of the server: without it, no profile is taken and the run says so.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from migratory.bench.servers import process_tree

__all__ = ["Profiler", "Summary", "summarise"]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"


class Profiler:
    """Samples each process of the given trees for ``seconds`` into ``folder/<label>-<name>-<pid>.txt``."""

    def __init__(self, folder: Path, label: str, roots: Iterable[int], seconds: float, rate: int = 250) -> None:
        self.folder = folder
        self.label = label
        self.roots = list(roots)
        self.seconds = seconds
        self.rate = rate
        self.running: list[tuple[Path, subprocess.Popen[bytes]]] = []

    def start(self) -> str:
        """Start sampling; an empty string, or why no profile is taken."""
        beside = Path(sys.executable).with_name("py-spy")  # a virtual environment's, when not on the PATH
        binary = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
        if binary is None:
            return "py-spy is not installed (pip install py-spy): no profile taken"
        self.folder.mkdir(parents=True, exist_ok=True)
        for member, root in enumerate(self.roots):
            for pid in process_tree(root):
                out = self.folder / f"{self.label}-m{member}-{_comm(pid)}-{pid}.txt"
                command = [binary, "record", "--pid", str(pid), "--duration", str(max(1, round(self.seconds)))]
                command += ["--rate", str(self.rate), "--nonblocking", "--format", "raw", "--output", str(out)]
                proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self.running.append((out, proc))
        return ""

    def wait(self) -> list[Path]:
        """The profiles written (py-spy ends by itself after its duration)."""
        done = []
        for out, proc in self.running:
            try:
                proc.wait(self.seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if out.exists():
                done.append(out)
        return done


@dataclass
class Summary:
    samples: int
    idle: int  # samples in the event loop's wait (epoll, select): the process had nothing to do
    own: list[tuple[str, int]]  # functions by samples where they were on top of the stack
    inclusive: list[tuple[str, int]]  # functions by samples where they were anywhere on the stack


_IDLE = ("select (selectors.py", "poll (selectors.py", "_run_once", "run_forever", "epoll", "sleep")


def summarise(path: Path, top: int = 15) -> Summary:
    """Collapsed stacks (``frame;frame;... count`` per line) to the top functions, busy samples only."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    samples = idle = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        samples += count
        frames = stack.split(";")
        leaf = frames[-1]
        if any(word in leaf for word in _IDLE):
            idle += count
            continue
        own[leaf] += count
        for frame in set(frames):
            inclusive[frame] += count
    return Summary(samples, idle, own.most_common(top), inclusive.most_common(top))
