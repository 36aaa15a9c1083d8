"""migratory.server.transport.heap: freed C-heap memory in the middle of the heap goes back to the system."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest

from migratory.server.transport import heap


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_returns_the_holes_a_storm_of_handshakes_leaves() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    # 4,000 blocks of an SSL object's size, every other one freed: holes glibc keeps by itself
    blocks = [libc.malloc(17_000) for _ in range(4000)]
    for block in blocks:
        libc.memset(block, 1, 17_000)
    for block in blocks[::2]:
        libc.free(block)
    before = _rss_kb()
    assert heap.trim() is True
    after = _rss_kb()
    for block in blocks[1::2]:
        libc.free(block)
    assert before - after > 20_000, (before, after)  # most of the 34 MB of holes
