"""Where one ordinary leaf's read goes: open, lookup and read, beside safetensors.

    python -m benchmarks.bench_one_leaf [--runs 9] [--trees minilm-fp32,gpt2]

For each tree, each run saves it afresh in both formats, loads it whole, reads its largest leaf
(as the side-by-side benchmark does just before its median-leaf row), then times, in that
order: opening the checkpoint (``treestore.open`` / ``safe_open``), finding the leaf
(``checkpoint[address]``; safetensors has no separate step) and reading it into a numpy array,
for the median-size leaf and for a leaf of a few MB. Then the lookup and the read again on the
same open checkpoint ("again"): what a reader that keeps its checkpoint open pays per leaf; and,
for treestore, all three once more on a checkpoint opened anew ("reopened": a warm open).
Beside each leaf, its LIMIT: one read of its stored bytes, zstd decompression, joining the byte
planes and BLAKE3 of the result, timed on that leaf's own chunks with the functions treestore
calls (``benchmarks/limits.py``), split over as many cores as the leaf has chunks (one chunk is
one core's work). Medians of --runs; one table.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

import treestore

from . import harness as H
from . import limits as L
from . import trees as T

MIDDLE = {  # a leaf of a few MB, as users pick them
    "minilm-fp32": "encoder.layer.3.intermediate.dense.weight",
    "gpt2": "h.5.mlp.c_fc.w",
}


def _treestore(c: Any, path: str, key: str) -> tuple[float, float, float]:
    """(open, lookup, read) seconds of leaf ``key``; ``c``: a checkpoint already open, or None."""
    t0 = time.perf_counter()
    if c is None:
        c = treestore.open(path, "ckpt")
    t1 = time.perf_counter()
    leaf = c[key.replace(".", "/")]
    t2 = time.perf_counter()
    H.touch(np.asarray(leaf))
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def _safetensors(path: str, keys: list[str]) -> list[tuple[float, float, float]]:
    from safetensors import safe_open

    rows = []
    for key in keys:
        t0 = time.perf_counter()
        with safe_open(path, "np") as f:
            t1 = time.perf_counter()
            H.touch(f.get_tensor(key))
            t3 = time.perf_counter()
        rows.append((t1 - t0, 0.0, t3 - t1))
    return rows


def _limit(leaf: np.ndarray, root: str) -> float:
    """Seconds of the load side's components for ``leaf``'s chunks, split over as many cores as
    it has chunks (at most the machine's); after a first pass that warms the buffers and code,
    as treestore's timed reads come after reads of their own."""
    L.components([leaf], root)
    t = L.components([leaf], root)
    chunks = -(-leaf.nbytes // treestore.SaveOptions().chunk_size)
    return sum(t.get(k, 0.0) for k in L.LOAD) / max(1, min(chunks, os.cpu_count() or 1))


def run(name: str, runs: int, root: str) -> list[tuple[str, str, str, float, float, float]]:
    tree = T.build(name)
    largest, median, middle = T.one_leaf_key(name), T.median_leaf_key(tree), MIDDLE[name]
    flat = {k: np.ascontiguousarray(v) for k, v in T.flatten(tree).items()}
    plan = [("median", median), ("a few MB", middle)]
    times: dict[tuple[str, str, str], list[tuple[float, float, float]]] = {}
    for _ in range(runs):
        for what, key in plan:
            times.setdefault(("LIMIT", what, "-"), []).append((0.0, 0.0, _limit(flat[key], root)))
        folder = tempfile.mkdtemp(dir=root)
        try:
            ts, st = os.path.join(folder, "ts"), os.path.join(folder, "model.safetensors")
            treestore.save(ts, tree, "ckpt")
            from safetensors.numpy import save_file

            save_file(flat, st)
            os.sync()
            for lib in ("treestore", "safetensors"):
                gc.collect()
                if lib == "treestore":
                    H.materialize(treestore.load(ts, "ckpt"))
                    _treestore(None, ts, largest)
                else:
                    from safetensors.numpy import load_file

                    H.materialize(load_file(st))
                    _safetensors(st, [largest])
                for what, key in plan:
                    if lib == "treestore":
                        first = _treestore(None, ts, key)
                        c = treestore.open(ts, "ckpt")
                        _treestore(c, ts, key)  # this checkpoint has read the leaf once
                        again = _treestore(c, ts, key)
                        times.setdefault((lib, what, "reopened"), []).append(_treestore(None, ts, key))
                    else:
                        first = _safetensors(st, [key])[0]
                        again = _safetensors(st, [key])[0]
                    times.setdefault((lib, what, "first"), []).append(first)
                    times.setdefault((lib, what, "again"), []).append(again)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    out = []
    for (lib, what, when), rows in times.items():
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        out.append((lib, what, when, med[0], med[1], med[2]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_one_leaf")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--trees", default="minilm-fp32,gpt2")
    ap.add_argument("--tmp-root", default=None)
    args = ap.parse_args(argv)
    root = H.make_tmp_root(args.tmp_root)
    try:
        print(f"medians of {args.runs} runs, ms\n")
        print("| tree | leaf | library | when | open | lookup | read | total | ÷ safetensors |")
        print("|---|---|---|---|---:|---:|---:|---:|---:|")
        for name in args.trees.split(","):
            H.log(f"[one leaf] {name}")
            rows = run(name, args.runs, root)
            totals = {(r[0], r[1], r[2]): r[3] + r[4] + r[5] for r in rows}
            for lib, what, when, o, lk, rd in sorted(
                rows, key=lambda r: (r[1], r[2] == "-", r[2], r[0] != "treestore")
            ):
                total = o + lk + rd
                ref = totals[("safetensors", what, "again" if when in ("reopened", "-") else when)]
                print(
                    f"| {name} | {what} | {lib} | {when} | {o * 1e3:.3f} | {lk * 1e3:.3f} | "
                    f"{rd * 1e3:.3f} | {total * 1e3:.3f} | {total / ref:.2f}× |"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
