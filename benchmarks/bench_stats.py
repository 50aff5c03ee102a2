"""What recording per-leaf statistics costs a save (``SaveOptions(stats=...)``).

    python -m benchmarks.bench_stats [--runs 3] [--pairs 11] [--trees minilm,gpt2] [--store DIR]

For each tree (MiniLM-L6 in fp32 and bf16; GPT-2-small-shaped fp32, ~498 MB) it saves a fresh
checkpoint into a new local store with statistics and without, alternating the two so that
noise spreads evenly (``--pairs`` of each: on a machine whose saves swing by ±20%, a few pairs
cannot resolve a 5% target), and reports the median wall time of each, their ratio, and the time of the
statistics alone (every leaf measured as the save measures it, on one thread). The target is
at most 5% of the save time. One table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import treestore
from treestore._format import stats as _stats
from treestore._kernels.digest import digest

from . import trees


def _trees(names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        if name == "minilm":
            out["minilm-fp32"] = trees.minilm(np.float32)
            out["minilm-bf16"] = trees.minilm("bf16")
        elif name == "gpt2":
            out["gpt2-fp32"] = trees.gpt2_small()
        else:
            raise SystemExit(f"unknown tree {name!r}")
    return out


def _save_time(tree: Any, stats: bool, root: Path) -> float:
    folder = Path(tempfile.mkdtemp(dir=root))
    try:
        options = treestore.SaveOptions(stats=stats)
        start = time.perf_counter()
        treestore.save(str(folder), tree, "c", options=options)
        return time.perf_counter() - start
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _measure_time(tree: Any) -> float:
    """The statistics alone: every leaf measured chunk by chunk, as a save does, on one thread."""
    leaves = [np.asarray(x) for _, x in trees.iter_leaves(tree)]
    start = time.perf_counter()
    for x in leaves:
        flat = x.reshape(-1)
        step = max(1, (4 << 20) // max(1, x.itemsize))
        for i in range(0, flat.size, step):
            _stats.measure(flat[i : i + step])
    return time.perf_counter() - start


WIDTHS = (-14, 8, 16, 13, 10, 13, 8)


def _parts(runs: int) -> list[tuple[str, float]]:
    """Microseconds per 1 MiB float32 chunk (normal values), one thread, best of ``runs`` x 50:
    each pass the statistics make, beside BLAKE3 of the same bytes and a float32 dot product,
    which the statistics do not use (its error breaks SPEC section 6.8's check on some leaves)."""
    import timeit

    x = np.random.default_rng(0).standard_normal(2**18).astype(np.float32)
    blocks = _stats._sumsq_blocks
    passes = [
        ("min", lambda: x.min()),
        ("max", lambda: x.max()),
        ("sum of squares in float64 (as saved)", lambda: blocks(x)),
        ("all statistics (as saved)", lambda: _stats.measure(x)),
        ("BLAKE3 (as saved)", lambda: digest(x.view(np.uint8))),
        ("float32 dot product (not used)", lambda: float(np.dot(x, x))),
    ]
    return [(what, min(timeit.repeat(fn, number=50, repeat=runs)) / 50 * 1e6) for what, fn in passes]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="repeats of the per-pass timings")
    parser.add_argument("--pairs", type=int, default=11, help="saves with and without statistics, each")
    parser.add_argument("--trees", default="minilm,gpt2")
    parser.add_argument("--store", default=None, help="folder for the stores (default: a temporary one)")
    args = parser.parse_args(argv)
    root = Path(args.store or tempfile.mkdtemp(prefix="bench-stats-"))
    root.mkdir(parents=True, exist_ok=True)
    parts = _parts(max(args.runs, 5))  # first: before the saves leave the kernel writing back
    rows = []
    for name, tree in _trees(args.trees.split(",")).items():
        times: dict[bool, list[float]] = {True: [], False: []}
        _save_time(tree, True, root)  # warm up: page cache, thread pools
        for run in range(args.pairs):
            for stats in (run % 2 == 0, run % 2 != 0):
                times[stats].append(_save_time(tree, stats, root))
                print(f"{name}: run {run} stats={stats}: {times[stats][-1]:.3f} s", file=sys.stderr)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        alone = _measure_time(tree)
        rows.append(
            (name, trees.nbytes(tree) / 2**20, off, on, (on - off) / off * 100, alone, alone / off * 100)
        )
    head = ("tree", "MiB", "save, no stats", "save, stats", "overhead", "stats alone", "share")
    print("".join(f"{h:>{w}}" if w > 0 else f"{h:<{-w}}" for h, w in zip(head, WIDTHS, strict=True)))
    for name, mib, off, on, extra, alone, share in rows:
        print(f"{name:<14}{mib:>8.0f}{off:>15.3f}s{on:>12.3f}s{extra:>9.1f}%{alone:>12.3f}s{share:>7.1f}%")
    print("\nper 1 MiB float32 chunk, one thread (best of runs):")
    for what, us in parts:
        print(f"  {what:<38}{us:>8.1f} µs")
    if not args.store:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
