"""Give the C heap's free pages back to the system after a burst of TLS handshakes.

OpenSSL allocates an ``SSL`` object of about 17 KB per handshake from the C heap, and the
lean TLS transport frees it as soon as the connection is established. After a connection
storm the heap is full of those freed holes: glibc keeps them (it only returns the top of
the heap by itself), so the server's memory stays at the storm's high-water mark, tens of
megabytes that no idle connection uses. ``malloc_trim(0)`` returns every whole free page
(``madvise(MADV_DONTNEED)``); it walks the heap once, so it is called after many frees,
not after each.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

__all__ = ["trim"]


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, other systems)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        function = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


_TRIM = _malloc_trim()


def trim() -> bool:
    """Return the heap's free pages to the system; False where that cannot be done (or nothing was)."""
    return bool(_TRIM(0)) if _TRIM is not None else False
