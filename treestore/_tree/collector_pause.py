"""Python's cyclic garbage collector, paused while a save or load makes its per-leaf objects.

A tree of 100k leaves makes a few objects per leaf (addresses, leaf records, index entries):
each 700 allocations start a collection, and every so often one that walks every object of the
process — the caller's tree included — so the collector's work grows with the square of the
number of leaves (at 100k leaves, a large share of a save's time). Flattening and converting a tree
always run with the collector paused; a whole save or load does when its tree has at least
:data:`MANY_LEAVES` leaves, where per-leaf work is most of its time. One pause over the whole
operation, not one per phase: each pause that ends leaves every object made during it to the
next collection. Nested and concurrent pauses (a background save while the caller loads) share
one count: the collector runs again when the last one ends, and only if it was on when the
first began. Reference counting frees everything outside cycles meanwhile.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_resume = False  # whether the collector was on when the outermost pause began
MANY_LEAVES = 1000


@contextlib.contextmanager
def paused_collector(leaves: int | None = None) -> Iterator[None]:
    """Run the body with Python's cyclic garbage collector off; with ``leaves``, only if that
    many leaves are at least :data:`MANY_LEAVES`."""
    global _depth, _resume
    if leaves is not None and leaves < MANY_LEAVES:
        yield
        return
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
