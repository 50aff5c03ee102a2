"""How tests/data/store-v1 was written (format version 1). Kept for the record: never rerun it
over the checked-in store — that store must stay as version 1 wrote it, so that every later
version proves it can still read it."""

from __future__ import annotations

import collections
import sys

import jax
import ml_dtypes
import numpy as np

import treestore


def tree() -> dict:
    rng = np.random.default_rng(2026)
    point = collections.namedtuple("Point", "x y")
    return {
        "params": {
            "dense": {
                "w": (rng.standard_normal((96, 80)) * 0.02).astype(np.float32),
                "b": np.zeros(80, np.float32),
            },
            "embed": rng.standard_normal((40, 16)).astype(ml_dtypes.bfloat16),
            "layers": [{"scale": np.float32(i + 0.5)} for i in range(3)],
        },
        "step": 1234,
        "ints": {0: np.arange(5, dtype=np.int8), 1: "one", -7: (1.5, True, None, b"\x00\x01")},
        "key": jax.random.key(7),
        "point": point(np.int4(3) if hasattr(np, "int4") else np.array(3, ml_dtypes.int4), 2 + 3j),
    }


if __name__ == "__main__":
    store = treestore.Store(sys.argv[1])
    options = treestore.SaveOptions(chunk_size=8192, small_leaf=4096)
    store.save(tree(), "first", metadata={"note": "written by format version 1"}, options=options)
    t = tree()
    t["step"] = 1235
    t["params"]["dense"]["b"] = np.ones(80, np.float32)
    store.save(t, "second", options=options)
