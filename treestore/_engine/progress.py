"""Progress callbacks: their one type, and a counter that several threads advance."""

from __future__ import annotations

import threading
from collections.abc import Callable

Progress = Callable[[int, int], None]  # (bytes done so far, total bytes)


def counter(progress: Progress | None, total: int) -> Callable[[int], None] | None:
    """A function adding its argument to the bytes done and calling ``progress(done, total)``
    (first with 0), safe from several threads; None without ``progress``."""
    if progress is None:
        return None
    lock = threading.Lock()
    done = [0]
    progress(0, total)

    def advance(n: int) -> None:
        with lock:
            done[0] += n
            progress(done[0], total)

    return advance
