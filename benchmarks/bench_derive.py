"""Derived checkpoints vs re-saving the whole tree, on the GPT-2-small-shaped tree (~498 MB fp32).

    python -m benchmarks.bench_derive [--runs 3] [--tmp-root DIR]

Three edits of the checkpoint ``base``, each done two ways, each run on a fresh copy of a local
store holding only ``base``:

- ``Store.derive`` (only the new leaves' chunks and a manifest are written; the rest is referenced);
- re-saving the edited tree with ``Store.save`` (every leaf is hashed again; content addressing
  still skips the chunks the store holds, so it writes as little data but reads and hashes all).

Edits: swap block ``h/11`` for new weights (28 MB), drop block ``h/11``, rename ``h`` to
``blocks``. Columns: median time of --runs (``os.sync()`` included), and the bytes each added to
the store (chunks, manifest and commit record, from a walk of the store's files).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import treestore

from . import harness as H
from . import trees as T


def store_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def measure(pristine: str, work: str, fn: Callable[[treestore.Store], Any], runs: int) -> tuple[float, int]:
    """(median seconds, median bytes added to the store) of ``fn(store)``, each run on a fresh
    copy of the store ``pristine`` (holding only the base) at ``work``."""
    times, added = [], []
    for _ in range(runs):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        os.sync()
        before = store_bytes(work)
        start = time.perf_counter()
        fn(treestore.Store(work))
        os.sync()
        times.append(time.perf_counter() - start)
        added.append(store_bytes(work) - before)
    return statistics.median(times), int(statistics.median(added))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_derive")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tmp-root", default=None)
    args = ap.parse_args(argv)
    root = H.make_tmp_root(args.tmp_root)
    try:
        tree = T.gpt2_small()
        url = os.path.join(root, "store")
        store = treestore.Store(url)
        store.save(tree, "base")
        os.sync()
        rng = np.random.default_rng(1)
        block = T.map_leaves(
            lambda x: (rng.standard_normal(x.shape) * 0.02).astype(np.float32), tree["h"]["11"]
        )
        swapped = {**tree, "h": {**tree["h"], "11": block}}
        dropped = {**tree, "h": {k: v for k, v in tree["h"].items() if k != "11"}}
        renamed = {("blocks" if k == "h" else k): v for k, v in tree.items()}
        edits = [
            ("swap block h/11 (28.3 MB)", swapped, {"set": {"h/11": block}}),
            ("drop block h/11", dropped, {"drop": "h/11"}),
            ("rename h -> blocks", renamed, {"rename": {"h": "blocks"}}),
        ]
        rows = []
        for i, (label, edited, change) in enumerate(edits):
            H.log(f"{label} ...")
            derived, saved = os.path.join(root, f"d{i}"), os.path.join(root, f"s{i}")
            t_derive, b_derive = measure(
                url, derived, lambda s, c=change: s.derive("base", "new", **c), args.runs
            )
            t_save, b_save = measure(url, saved, lambda s, e=edited: s.save(e, "new"), args.runs)
            d = treestore.diff(f"{url}#base", f"{derived}#new")
            same = not treestore.diff(f"{derived}#new", f"{saved}#new")
            shutil.rmtree(saved)
            shutil.rmtree(derived)
            rows.append((label, t_derive, b_derive, t_save, b_save, same, len(d)))
        print("## Derived checkpoints vs re-saving (GPT-2-small shapes, 497.8 MB fp32)\n")
        print(f"- median of {args.runs} runs, local disk ({H.fs_type(root)}), os.sync() included\n")
        print(
            "| edit | derive | bytes written | re-save | bytes written | speedup | same tree "
            "| leaves differing |"
        )
        print("|---|---:|---:|---:|---:|---:|---|---:|")
        for label, t_d, b_d, t_s, b_s, same, changed in rows:
            print(
                f"| {label} | {t_d * 1e3:.1f} ms | {b_d:,} | {t_s:.3f} s | {b_s:,} | {t_s / t_d:.0f}× | "
                f"{'yes' if same else '**no**'} | {changed} |"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
