"""How tests/data/store-v2 was written (format version 2, the columnar manifest). Kept for the
record: never rerun it over the checked-in store — that store must stay as version 2 wrote it, so
that every later version proves it can still read it. It holds the same trees as store-v1."""

from __future__ import annotations

import sys

import numpy as np

import treestore

from .make_store_v1 import tree

if __name__ == "__main__":
    store = treestore.Store(sys.argv[1])
    options = treestore.SaveOptions(chunk_size=8192, small_leaf=4096)
    store.save(tree(), "first", metadata={"note": "written by format version 2"}, options=options)
    t = tree()
    t["step"] = 1235
    t["params"]["dense"]["b"] = np.ones(80, np.float32)
    store.save(t, "second", options=options)
