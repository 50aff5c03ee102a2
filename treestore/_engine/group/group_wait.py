"""How a process of a multi-process save waits at a barrier: for how long, and with its save lock
kept fresh meanwhile, so that gc never takes the chunks of a save in flight for abandoned ones."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

from treestore._engine import locks as _locks

BARRIER_TIMEOUT = 600.0  # seconds a process waits at each step; TREESTORE_BARRIER_TIMEOUT replaces it
KEEP_FRESH = 30.0  # seconds between looks at the save lock while waiting (it is rewritten every 900 s)
_log = logging.getLogger("treestore")


def barrier_timeout() -> float:
    """``BARRIER_TIMEOUT``, or the seconds the environment variable ``TREESTORE_BARRIER_TIMEOUT``
    gives (every process of a job should see the same)."""
    text = os.environ.get("TREESTORE_BARRIER_TIMEOUT", "").strip()
    if text:
        with contextlib.suppress(ValueError):
            return max(float(text), 0.001)
    return BARRIER_TIMEOUT


@contextlib.contextmanager
def kept_fresh(lock: _locks.Lock | None) -> Iterator[None]:
    """Keep ``lock`` from going stale while this thread waits."""
    if lock is None:
        yield
        return
    stop = threading.Event()

    def keep() -> None:
        while not stop.wait(KEEP_FRESH):
            try:
                lock.refresh(_locks.STALE_AFTER)
            except Exception as exc:  # tried again at the next look; logged, as a release is
                _log.warning("%s/%s: could not rewrite this save lock (%s)", lock.storage.url, lock.path, exc)

    keeper = threading.Thread(target=keep, name=f"{threading.current_thread().name} (lock)", daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()
