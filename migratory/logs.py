"""JSON-lines log files with size rotation (schema in docs/logs.md).

The access and message logs are written on the event loop's thread, so the writer
is a plain buffered file: one ``write`` per line into Python's buffer, a flush per
second (and at rotation and close), and rotation only between lines so that no
line is ever split or lost.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["SCHEMA_VERSION", "JsonFormatter", "JsonLineWriter", "utc_timestamp"]

SCHEMA_VERSION = 1


def utc_timestamp(when: float | None = None) -> str:
    """ISO 8601 UTC with milliseconds and Z, as every log line's ``ts``."""
    now = time.time() if when is None else when
    seconds = int(now)
    millis = int((now - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


class JsonLineWriter:
    """Appends JSON objects as lines to ``folder/name``, rotating by size."""

    __slots__ = ("_file", "_size", "max_bytes", "max_files", "path")

    def __init__(self, folder: str | os.PathLike[str], name: str, max_bytes: int, max_files: int) -> None:
        self.path = Path(folder) / name
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = None
        self._size = 0
        self._open()

    def _open(self) -> None:
        self._file = open(self.path, "a", encoding="utf-8", buffering=65536)  # noqa: SIM115
        self._size = self.path.stat().st_size

    def write(self, record: dict[str, Any]) -> None:
        """Write one record; ``v`` and ``ts`` are added when missing."""
        if self._file is None:
            return
        head: dict[str, Any] = {
            "v": SCHEMA_VERSION,
            "ts": record.pop("ts", None) or utc_timestamp(),
        }
        line = json.dumps({**head, **record}, ensure_ascii=False, separators=(",", ":")) + "\n"
        size = len(line.encode("utf-8"))
        if self._size and self._size + size > self.max_bytes:
            self._rotate()
        self._file.write(line)
        self._size += size

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        for index in range(self.max_files - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._open()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class JsonFormatter(logging.Formatter):
    """Formats server.log records as schema-v1 JSON lines."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "v": SCHEMA_VERSION,
            "ts": utc_timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "data", None)
        if isinstance(extra, dict):
            payload.update(extra)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
