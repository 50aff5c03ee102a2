"""How tests/data/store-v2-parts was written: format version 2 with a manifest stored in parts
(SPEC.md, section 8), saved by a job of four processes (threads standing in for them). Kept for
the record: never rerun it over the checked-in store — that store must stay as it was written, so
that every later version proves it can still read it. (It was rewritten once, before 0.2 was
released, when a frame's part entries gained their leaf range.)"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from treestore._engine.write import SaveOptions
from treestore._storage.registry import open_storage

from ..support.jobs import prepared, rows, run_job

PROCESSES = 4


def tree() -> dict[str, Any]:
    return {
        "w": (np.arange(256 * 16, dtype=np.float32) / 7).reshape(256, 16),  # 4 KiB a process: chunked
        "b": np.arange(16, dtype=np.int32),  # four pieces, packed
        "grid": np.arange(48, dtype=np.int16).reshape(6, 8),  # process 3 holds it all
        "scale": np.float32(0.5),
        "step": 7,
    }


BOXES = {
    "w": rows(256, PROCESSES, 16),
    "b": rows(16, PROCESSES),
    "grid": [[], [], [], [((0, 0), (6, 8))]],
}

if __name__ == "__main__":
    storage = open_storage(sys.argv[1])
    options = SaveOptions(chunk_size=4096, small_leaf=1024, threads=1)
    trees = [prepared(tree(), BOXES, i) for i in range(PROCESSES)]
    results = run_job(storage, trees, "sharded", options=options)
    assert all(not isinstance(r, BaseException) for r in results), results
