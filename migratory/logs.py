"""JSON-lines log files with size rotation (schema in docs/logs.md).

Several worker processes append to the same files, so a writer never hands the
kernel a partial line: lines are collected in memory and written by one
``os.write`` on an ``O_APPEND`` descriptor (appends of whole buffers do not
interleave). Rotation happens under an ``flock`` on a lock file, and a writer
whose file was rotated away by another process reopens the new one, so no line is
ever split or lost. Lines are flushed once per second (the server's housekeeping
tick), when 64 KiB are pending, and at close.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA_VERSION", "JsonLineHandler", "JsonLineWriter", "utc_timestamp"]

SCHEMA_VERSION = 1
FLUSH_BYTES = 65536


def utc_timestamp(when: float | None = None) -> str:
    """ISO 8601 UTC with milliseconds and Z, as every log line's ``ts``."""
    now = time.time() if when is None else when
    seconds = int(now)
    millis = int((now - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


MAX_QUEUED_LINES = 100_000


class JsonLineWriter:
    """Appends JSON objects as lines to ``folder/name``, rotating by size."""

    __slots__ = ("_fd", "_lines", "_pending", "max_bytes", "max_files", "path")

    def __init__(self, folder: str | os.PathLike[str], name: str, max_bytes: int, max_files: int) -> None:
        self.path = Path(folder) / name
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lines: list[bytes] = []
        self._pending = 0
        self._fd = -1
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        """Queue one record; ``v`` and ``ts`` are put first (``ts`` added when missing)."""
        if self._fd < 0:
            return
        head: dict[str, Any] = {"v": SCHEMA_VERSION, "ts": record.pop("ts", None) or utc_timestamp()}
        line = (json.dumps({**head, **record}, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")
        self._lines.append(line)
        self._pending += len(line)
        if self._pending >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write every pending line, rotating first when the file would grow past the limit.

        When writing fails (a full disk, a folder that became read-only), the lines that
        were not written stay queued (at most MAX_QUEUED_LINES, the oldest dropped first)
        and the error is raised for the caller to report; the next flush tries again.
        """
        if not self._lines or self._fd < 0:
            return
        lines = self._lines
        self._lines = []
        self._pending = 0
        written = 0
        try:
            self._follow_rotation()
            size = os.fstat(self._fd).st_size
            batch: list[bytes] = []
            batch_size = 0
            for line in lines:
                if size + batch_size + len(line) > self.max_bytes and size + batch_size > 0:
                    if batch:
                        os.write(self._fd, b"".join(batch))
                        written += len(batch)
                        batch, batch_size = [], 0
                    self._rotate(len(line))
                    size = os.fstat(self._fd).st_size
                batch.append(line)
                batch_size += len(line)
            if batch:
                os.write(self._fd, b"".join(batch))
                written += len(batch)
        except OSError:
            keep = (lines[written:] + self._lines)[-MAX_QUEUED_LINES:]
            self._lines = keep
            self._pending = sum(len(line) for line in keep)
            raise

    def _follow_rotation(self) -> None:
        """Reopen when another process has rotated our file away."""
        try:
            current = os.stat(self.path).st_ino
        except FileNotFoundError:
            current = -1
        if current != os.fstat(self._fd).st_ino:
            os.close(self._fd)
            self._open()

    def _rotate(self, incoming: int) -> None:
        lock_path = self.path.with_name(f".{self.path.name}.lock")
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._follow_rotation()
            size = os.fstat(self._fd).st_size
            if size and size + incoming > self.max_bytes:
                for index in range(self.max_files - 1, 0, -1):
                    older = self.path.with_name(f"{self.path.name}.{index}")
                    if older.exists():
                        os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
                os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
                os.close(self._fd)
                self._open()
            fcntl.flock(lock, fcntl.LOCK_UN)

    def close(self) -> None:
        self.flush()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class JsonLineHandler(logging.Handler):
    """``logging`` handler writing server.log through a :class:`JsonLineWriter`."""

    def __init__(self, writer: JsonLineWriter) -> None:
        super().__init__()
        self.writer = writer
        self.failures = 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            payload: dict[str, Any] = {
                "ts": utc_timestamp(record.created),
                "level": record.levelname,
                "logger": record.name,
                "msg": record.getMessage(),
                "pid": record.process,
            }
            extra = getattr(record, "data", None)
            if isinstance(extra, dict):
                payload.update(extra)
            if record.exc_info:
                payload["exc"] = logging.Formatter().formatException(record.exc_info)
            self.writer.write(payload)
            self.writer.flush()  # server.log is rare and read by people: no delay
        except Exception:
            # The line stays queued for the next flush and the console handler still shows
            # it; logging's own handleError would print a traceback on the console.
            self.failures += 1

    def close(self) -> None:
        self.writer.close()
        super().close()
