"""Partial reads and diffs on the GPT-2-small-shaped checkpoint (~498 MB fp32), side by side.

    python -m benchmarks.bench_partial [--runs 5] [--tmp-root DIR]

Rows (medians of --runs, warm page cache):
- one leaf (``wte``, 154 MB): treestore ``open(url)["wte"]`` read whole vs safetensors
  ``safe_open(...).get_tensor("wte")``; bytes read vs that leaf's chunks plus the manifest;
- a 100-row slice of ``wte``: chunk bytes read vs the chunks the rows intersect;
- diff of two checkpoints that differ in one of the 12 blocks, without and with values, vs the
  time to load both checkpoints.
Targets (issue 3): one leaf ≤ 2× safetensors; diff ≤ 50 ms without values; with values ≤ loading both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

import numpy as np

import treestore
from treestore._engine.reading.committed import read_commit_record
from treestore._format.paths import manifest_path

from . import harness as H
from . import trees as T


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_partial")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tmp-root", default=None)
    args = ap.parse_args(argv)
    from safetensors import safe_open
    from safetensors.numpy import save_file

    root = H.make_tmp_root(args.tmp_root)
    try:
        tree = T.gpt2_small()
        flat = T.flatten(tree)
        st_path = os.path.join(root, "model.safetensors")
        save_file({k: np.ascontiguousarray(v) for k, v in flat.items()}, st_path)
        url = os.path.join(root, "store")
        store = treestore.Store(url)
        store.save(tree, "a")
        changed = dict(tree)
        changed["h"] = dict(tree["h"])
        changed["h"]["5"] = T.map_leaves(lambda x: x + np.float32(1e-3), tree["h"]["5"])
        store.save(changed, "b")
        os.sync()

        def st_one() -> Any:
            with safe_open(st_path, framework="np") as f:
                return H.touch(f.get_tensor("wte"))

        def ts_one() -> Any:
            return H.touch(np.asarray(treestore.open(url, "a")["wte"]))

        manifest = store.manifest("a")
        entry = {e.address: e for e in manifest.leaves}["wte"]
        ckpt = treestore.open(url, "a")
        np.asarray(ckpt["wte"])
        one_read = ckpt.bytes_read
        msize = (
            store._storage.object_size(manifest_path(read_commit_record(store._storage, "a").manifest)) or 0
        )

        ckpt = treestore.open(url, "a")
        ckpt["wte"][20000:20100]
        slice_read = ckpt.bytes_read
        row = 768 * 4
        lo, hi, at, want = 20000 * row, 20100 * row, 0, 0
        for c in entry.chunks:
            if at < hi and at + c.raw_size > lo:
                want += c.stored_size
            at += c.raw_size

        t_st = H.median_time(st_one, args.runs)
        t_ts = H.median_time(ts_one, args.runs)
        t_slice = H.median_time(lambda: treestore.open(url, "a")["wte"][20000:20100], args.runs)
        t_diff = H.median_time(lambda: treestore.diff(f"{url}#a", f"{url}#b"), args.runs)
        t_stats = H.median_time(
            lambda: treestore.diff(f"{url}#a", f"{url}#b", values=True), max(1, args.runs // 2)
        )
        t_both = H.median_time(lambda: (store.load("a"), store.load("b")), max(1, args.runs // 2))
        d = treestore.diff(f"{url}#a", f"{url}#b")

        def met(ok: bool) -> str:
            return "met" if ok else "**not met**"

        print("## Partial reads and diffs (GPT-2-small shapes, 497.8 MB fp32)\n")
        print(
            f"- median of {args.runs} runs, warm page cache, local disk; diff: {len(d.changed)} of "
            f"{len(d.leaves)} leaves differ (block h.5)\n"
        )
        print("| operation | treestore | peer | ratio | bytes read | bound | target |")
        print("|---|---:|---:|---:|---:|---:|---|")
        print(
            f"| one leaf `wte` (154 MB) | {t_ts:.3f} s | safetensors get_tensor {t_st:.3f} s | "
            f"{t_ts / t_st:.2f}× | {one_read + msize:,} | {entry.stored_bytes + msize:,} "
            f"(its chunks + manifest) | ≤ 2× safetensors: {met(t_ts <= 2 * t_st)}; "
            f"bytes: {met(one_read <= entry.stored_bytes)} |"
        )
        print(
            f"| 100-row slice of `wte` | {t_slice * 1e3:.1f} ms | | | {slice_read:,} | {want:,} "
            f"(intersecting chunks) | {met(slice_read <= want)} |"
        )
        print(
            f"| diff a b (manifests only) | {t_diff * 1e3:.1f} ms | | | 0 chunk bytes | | "
            f"≤ 50 ms: {met(t_diff <= 0.05)} |"
        )
        print(
            f"| diff a b --values | {t_stats:.3f} s | load both {t_both:.3f} s | "
            f"{t_stats / t_both:.2f}× | | | ≤ load both: {met(t_stats <= t_both)} |"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
