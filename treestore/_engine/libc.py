"""The C library's memory calls that Python does not offer, best effort: each is ``None`` where
the platform lacks it (off Linux, or a C library without it), and callers then do without.

Loaded once, at import: never while reading a store or saving one.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any


def _load(name: str, argtypes: list[Any]) -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


madvise = _load("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
malloc_trim = _load("malloc_trim", [ctypes.c_size_t])  # glibc: free heap pages back to the system


__all__ = ["madvise", "malloc_trim"]
