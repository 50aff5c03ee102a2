"""Manifest scaling: version-1 manifests against version-2 (columnar) ones, beside safetensors.

    python -m benchmarks.bench_scaling [--full] [--runs 5]

Trees of 1k, 10k and 100k leaves (1M with ``--full``), each a float32[16] array (64 bytes), in
dicts of 100. Each tree is saved once with treestore into a ``memory://`` store and its version-1
manifest read back; then, medians of ``--runs``:

* v1 / v2 encode and decode: ``encode_manifest`` / ``decode_manifest`` against ``encode_columns``
  / ``decode_columns`` (decoding includes all validation); bytes per leaf of each encoding; peak
  memory of one decode (tracemalloc, a separate untimed run);
* v1→v2: ``columns_from_manifest``, the bridge today's writer would use (phase 1 only);
* v2 open+leaf: decode, find one leaf by address, make its leaf entry;
* v2 diff: decode two manifests (1% of the leaves changed), match leaves by address
  (``Columns.match``) and compare them all (``Columns.same_leaves``);
* ts save / load / open+leaf / diff: the whole of ``treestore.save`` (a new name each run, every
  chunk already stored after the first), ``load``, ``open`` + ``np.asarray`` of one leaf, and a
  manifest-only ``diff`` of two checkpoints (1% of leaves changed), on a local temporary store;
* safetensors, same tree flattened to ``g0.w0`` keys, on a local temporary file: ``save_file``,
  ``load_file``, and ``safe_open`` + ``get_tensor`` of one tensor.

Issue 13's targets at 100k leaves: save and load ≤ 1.5× safetensors, open + one leaf ≤ 2×
safetensors' safe_open + get_tensor, manifest-only diff ≤ 100 ms, 1M leaves within 2 GB. This table
measures the manifest's share of those and the whole operations through the public API.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import treestore
from treestore._format.columns import columns_from_manifest, decode_columns, encode_columns
from treestore._format.manifest import Manifest, decode_manifest, encode_manifest

GROUP = 100


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_tree(n: int, changed: float = 0.0) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    tree = {
        f"g{i}": {f"w{j}": np.full(16, i * GROUP + j, np.float32) for j in range(min(GROUP, n - i * GROUP))}
        for i in range((n + GROUP - 1) // GROUP)
    }
    for k in rng.choice(n, int(n * changed), replace=False).tolist():
        tree[f"g{k // GROUP}"][f"w{k % GROUP}"] = np.full(16, -1, np.float32)
    return tree


def saved(tree: Any) -> Manifest:
    url = f"memory://bench-scaling/{uuid.uuid4().hex}"
    treestore.save(url, tree, "ckpt")
    return treestore.Store(url).manifest("ckpt")


def median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        gc.collect()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def peak_mib(fn: Callable[[], object]) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def diff_v2(a: bytes, b: bytes) -> int:
    x, y = decode_columns(a, "a"), decode_columns(b, "b")
    ia, ib = x.match(y)
    return int(np.count_nonzero(~x.same_leaves(ia, y, ib)))


def open_leaf(data: bytes, address: str) -> object:
    c = decode_columns(data, "ckpt")
    i = c.find(address)
    assert i is not None
    return c.leaf(i)


def measure(n: int, runs: int, tmp: str) -> dict[str, float]:
    log(f"{n} leaves: saving")
    tree = make_tree(n)
    m = saved(tree)
    other = saved(make_tree(n, changed=0.01))
    v1 = encode_manifest(m)
    columns = columns_from_manifest(m)
    v2 = encode_columns(columns)
    v2_other = encode_columns(columns_from_manifest(other))
    address = f"g{(n - 1) // GROUP}/w{(n - 1) % GROUP}"
    changed = diff_v2(v2, v2_other)
    assert changed == int(n * 0.01), changed
    flat = {f"{g}.{k}": v for g, leaves in tree.items() for k, v in leaves.items()}
    path = os.path.join(tmp, f"{n}.safetensors")
    key = address.replace("/", ".")
    row: dict[str, float] = {"leaves": n}
    log(f"{n} leaves: version 1")
    row["v1 enc"] = median_ms(lambda: encode_manifest(m), runs)
    row["v1 dec"] = median_ms(lambda: decode_manifest(v1, "ckpt"), runs)
    row["v1 B/leaf"] = len(v1) / n
    row["v1 peak"] = peak_mib(lambda: decode_manifest(v1, "ckpt"))
    log(f"{n} leaves: version 2")
    row["v1→v2"] = median_ms(lambda: columns_from_manifest(m), runs)
    row["v2 enc"] = median_ms(lambda: encode_columns(columns), runs)
    row["v2 dec"] = median_ms(lambda: decode_columns(v2, "ckpt"), runs)
    row["v2 B/leaf"] = len(v2) / n
    row["v2 peak"] = peak_mib(lambda: decode_columns(v2, "ckpt"))
    row["v2 open+leaf"] = median_ms(lambda: open_leaf(v2, address), runs)
    row["v2 diff"] = median_ms(lambda: diff_v2(v2, v2_other), runs)
    log(f"{n} leaves: treestore, through the public API (local store, format version 2)")
    url = os.path.join(tmp, f"{n}.store")
    names = iter(range(10**9))
    row["ts save"] = median_ms(lambda: treestore.save(url, tree, f"s{next(names)}"), runs)
    treestore.save(url, tree, "a")
    treestore.save(url, make_tree(n, changed=0.01), "b")
    row["ts load"] = median_ms(lambda: treestore.load(url, "a"), runs)
    row["ts open+leaf"] = median_ms(lambda: np.asarray(treestore.open(url, "a")[address]), runs)
    row["ts diff"] = median_ms(lambda: treestore.diff(f"{url}#a", f"{url}#b"), runs)
    log(f"{n} leaves: safetensors")
    row["st save"] = median_ms(lambda: save_file(flat, path), runs)
    row["st load"] = median_ms(lambda: load_file(path), runs)

    def one() -> object:
        with safe_open(path, framework="np") as f:
            return f.get_tensor(key)

    row["st open+get"] = median_ms(one, runs)
    os.remove(path)
    return row


UNITS = {"B/leaf": "{:.0f}", "peak": "{:.1f} MiB", "leaves": "{:,.0f}"}


def table(rows: list[dict[str, float]]) -> str:
    heads = list(rows[0])
    out = ["| " + " | ".join(heads) + " |", "|" + "---:|" * len(heads)]
    for row in rows:
        cells = []
        for h in heads:
            unit = next((f for suffix, f in UNITS.items() if h.endswith(suffix)), "{:.1f} ms")
            cells.append(unit.format(row[h]))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_scaling")
    ap.add_argument("--full", action="store_true", help="also 1M leaves")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="*", help="leaf counts (overrides the defaults)")
    args = ap.parse_args(argv)
    sizes = args.sizes or [1_000, 10_000, 100_000] + ([1_000_000] if args.full else [])
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        rows = [measure(n, args.runs, tmp) for n in sizes]
    print(f"Manifest scaling, {args.runs} runs (medians), float32[16] leaves in dicts of {GROUP}:\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
