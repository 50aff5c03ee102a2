"""The one rule for how many threads a save, load, verify or copy uses by default."""

from __future__ import annotations

import os


def default_threads() -> int:
    """Hashing, compression and I/O overlap: twice the cores, at least 4."""
    return max(4, 2 * (os.cpu_count() or 2))
