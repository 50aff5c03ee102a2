"""Each thread's reusable buffers: a fresh 4 MiB array per chunk costs more in page faults than
the work done in it."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

_tls = threading.local()

SCRATCH_KEPT = 16 * 2**20  # the largest scratch buffer a thread keeps between uses


def scratch(size: int, name: str = "scratch") -> np.ndarray[Any, Any]:
    """This thread's reusable buffer ``name`` of at least ``size`` bytes: a fresh 4 MiB array per
    chunk costs more in page faults than the byte-plane transpose itself. treestore's threads
    live as long as the process (see treestore._engine.threads), so a buffer over
    :data:`SCRATCH_KEPT` (chunks over 8 MiB) is made for each use and not kept."""
    buf = getattr(_tls, name, None)
    if buf is None or buf.nbytes < size:
        buf = np.empty(size, np.uint8)
        if size > SCRATCH_KEPT:
            return buf
        setattr(_tls, name, buf)
    return buf[:size]


def scratch_held(size: int, name: str = "scratch") -> bool:
    """Whether :func:`scratch` would hand this thread a buffer it holds already (no allocation)."""
    buf = getattr(_tls, name, None)
    return buf is not None and buf.nbytes >= size
