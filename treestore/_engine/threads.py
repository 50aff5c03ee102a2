"""The one rule for how many threads a save, load, verify or copy uses by default."""

from __future__ import annotations

import os


def default_threads() -> int:
    """Hashing, compression and I/O overlap: twice the cores, at least 4."""
    return max(4, 2 * (os.cpu_count() or 2))


def compute_threads(threads: int, waits_elsewhere: bool) -> int:
    """How many of ``threads`` hash and compress a save's chunks. Where their writes block (an
    object store's PUT) they need all of them, to overlap; where the waiting for the disk is done
    by threads of its own (:meth:`Storage.stage` on a local disk), one per core keeps every core
    busy without the switching, page faults and scratch memory of more."""
    return min(threads, os.cpu_count() or 1) if waits_elsewhere else threads
