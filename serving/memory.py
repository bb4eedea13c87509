"""Giving memory back to the system after a large request.

glibc keeps what a process freed in its heaps (one arena per thread that allocated: the event
loop's and each tokenizer thread's), so one burst of large prompts leaves a server hundreds of MB
larger for good (measured: +282 MB after twenty 1 MB prompts, docs/benchmarks.md "Hostile
requests"). ``trim`` asks glibc to return the free pages at the top of its heaps and the
unused ones inside them (``malloc_trim(0)``), at most once per ``TRIM_EVERY_S``: a few ms, paid
only after a request of ``LARGE_BODY_BYTES`` or more. A libc without it (musl): nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

TRIM_EVERY_S = 1.0

try:
    _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc
    _malloc_trim = None
_last = 0.0


def trim(clock=time.monotonic) -> bool:
    """Return freed heap memory to the system (glibc); False when skipped (too soon, or no
    ``malloc_trim``)."""
    global _last
    now = clock()
    if _malloc_trim is None or now - _last < TRIM_EVERY_S:
        return False
    _last = now
    _malloc_trim(0)
    return True
