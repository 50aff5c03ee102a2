"""Whole-checkpoint operations over many leaves: verify, copy, derive and timeline beside what the
same work costs with safetensors.

    python -m benchmarks.bench_store_ops [--runs 5] [--sizes 10000 100000]

Each tree is a set of float32[16] leaves (64 bytes) in dicts of 100, saved twice (the second
time with 1% of the leaves changed) in a local temporary store and as two ``.safetensors``
files; each size runs in a fresh process, medians of ``--runs``. safetensors has no such
operations, so its column is the nearest a user of it can do:

* verify: ``treestore.verify`` of one checkpoint (every digest checked) / ``load_file`` (reads
  every tensor, checks nothing);
* copy: ``treestore.copy`` to a new store / ``shutil.copyfile`` of the file;
* derive: ``Store.derive`` dropping 1% of the leaves / ``load_file``, drop the keys,
  ``save_file``;
* timeline: ``Store.timeline`` of the two checkpoints (relative change of each leaf) /
  ``load_file`` of both and the relative L2 change of each tensor in numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.bench_scaling import GROUP, make_tree, median_ms


def measure(n: int, runs: int, tmp: str) -> dict[str, Any]:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    import treestore

    url = os.path.join(tmp, "store")
    a, b = make_tree(n), make_tree(n, changed=0.01)
    treestore.save(url, a, "a")
    treestore.save(url, b, "b")
    store = treestore.Store(url)
    files = []
    for name, tree in (("a", a), ("b", b)):
        path = os.path.join(tmp, f"{name}.safetensors")
        save_file({f"{g}.{k}": v for g, leaves in tree.items() for k, v in leaves.items()}, path)
        files.append(path)
    dropped = [f"g{i}/**" for i in range(0, n // GROUP, 100)] or ["g0/**"]
    count = iter(range(10**9))
    row: dict[str, Any] = {"leaves": f"{n:,}"}

    def ts_copy() -> None:
        treestore.copy(f"{url}#b", os.path.join(tmp, f"copy{next(count)}"))

    def ts_derive() -> None:
        store.derive("b", f"d{next(count)}", drop=dropped)

    def st_copy() -> None:
        shutil.copyfile(files[1], os.path.join(tmp, f"copy{next(count)}.safetensors"))

    def st_derive() -> None:
        prefixes = tuple(p.removesuffix("/**") + "." for p in dropped)
        kept = {k: v for k, v in load_file(files[1]).items() if not k.startswith(prefixes)}
        save_file(kept, os.path.join(tmp, "derived.safetensors"))

    def st_timeline() -> dict[str, float]:
        x, y = load_file(files[0]), load_file(files[1])
        return {k: float(np.linalg.norm(y[k] - v) / (np.linalg.norm(v) or 1.0)) for k, v in x.items()}

    row["verify"] = (
        median_ms(lambda: treestore.verify(f"{url}#b"), runs),
        median_ms(lambda: load_file(files[1]), runs),
    )
    row["copy"] = (median_ms(ts_copy, runs), median_ms(st_copy, runs))
    row["derive"] = (median_ms(ts_derive, runs), median_ms(st_derive, runs))
    row["timeline"] = (median_ms(store.timeline, runs), median_ms(st_timeline, runs))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    ops = ["verify", "copy", "derive", "timeline"]
    lines = [
        "| leaves | " + " | ".join(f"{op} ts / st | ratio" for op in ops) + " |",
        "|---:|" + "---:|---:|" * len(ops),
    ]
    for r in rows:
        cells = [r["leaves"]]
        for op in ops:
            ts, st = r[op]
            cells += [f"{ts:.1f} / {st:.1f} ms", f"{ts / st:.2f}×"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_store_ops")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a row, in this process
    args = ap.parse_args(argv)
    if args.one is not None:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(measure(args.one, args.runs, tmp)))
        return 0
    rows = []
    for n in args.sizes:
        print(f"{n:,} leaves", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "benchmarks.bench_store_ops", "--one", str(n), "--runs", str(args.runs)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
