"""Many leaves: treestore's public API beside safetensors, from 1k to 1M leaves and for leaves in pieces.

    python -m benchmarks.bench_scaling [--full] [--runs 3] [--sizes N ...] [--pieces]

Each tree is a set of float32[16] leaves (64 bytes) in dicts of 100; ``--full`` adds 1M leaves
and 10k leaves × 64 pieces (``--pieces`` adds 1k × 64 pieces alone). A row is measured in a
fresh process (so its peak memory is its own), on a local temporary store, medians of
``--runs``:

* save: ``treestore.save`` of the tree under a new name (every chunk already stored after the
  first run, so this is the per-leaf cost) / safetensors ``save_file`` of the same leaves flattened
  to ``g0.w0`` keys;
* load: ``treestore.load`` / ``load_file``;
* open + one leaf: ``treestore.open`` + ``np.asarray`` of its last leaf / ``safe_open`` +
  ``get_tensor``;
* diff: ``treestore.diff`` of two checkpoints of the tree with 1% of the leaves changed (only
  manifests are read);
* manifest bytes per leaf, and the process's peak resident memory once treestore's part is done
  (the tree, its saves, loads and diffs; before safetensors runs).

Pieces: each leaf is a float32[64, 4] ``jax.Array`` sharded over 64 CPU devices (one piece per
device, 16 bytes each) — the manifest cost of a checkpoint of sharded leaves, not its bytes. safetensors
cannot store a sharded array: its column holds the gathered arrays.

Issue 13's targets at 100k leaves: save and load ≤ 1.5× safetensors, open + one leaf ≤ 2×,
manifest-only diff ≤ 100 ms; 1M leaves within 2 GB.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

GROUP = 100
PIECES = 64


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_tree(n: int, changed: float = 0.0) -> dict[str, dict[str, Any]]:
    import numpy as np

    rng = np.random.default_rng(0)
    tree = {
        f"g{i}": {f"w{j}": np.full(16, i * GROUP + j, np.float32) for j in range(min(GROUP, n - i * GROUP))}
        for i in range((n + GROUP - 1) // GROUP)
    }
    for k in rng.choice(n, int(n * changed), replace=False).tolist():
        tree[f"g{k // GROUP}"][f"w{k % GROUP}"] = np.full(16, -1, np.float32)
    return tree


def sharded(tree: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each leaf as a float32[64, 4] array sharded over every device along its first axis."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("x",))
    spec = NamedSharding(mesh, PartitionSpec("x"))
    return {
        g: {k: jax.device_put(np.resize(v, (PIECES, 4)), spec) for k, v in leaves.items()}
        for g, leaves in tree.items()
    }


def median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        gc.collect()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(n: int, runs: int, pieces: bool, tmp: str) -> dict[str, Any]:
    """One row, in this process."""
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    import treestore
    from treestore._engine.reading.committed import read_commit_record

    url = os.path.join(tmp, "store")
    row: dict[str, Any] = {"leaves": f"{n:,}" + (f" × {PIECES} pieces" if pieces else "")}
    log(f"{row['leaves']}: treestore")
    other = make_tree(n, changed=0.01)
    treestore.save(url, sharded(other) if pieces else other, "b")
    del other  # one tree in memory from here on: the peak is the tree, a save's and a load's
    gc.collect()
    tree = sharded(make_tree(n)) if pieces else make_tree(n)
    address = f"g{(n - 1) // GROUP}/w{(n - 1) % GROUP}"
    treestore.save(url, tree, "a")
    names = iter(range(10**9))
    row["ts save"] = median_ms(lambda: treestore.save(url, tree, f"s{next(names)}"), runs)
    row["ts load"] = median_ms(lambda: treestore.load(url, "a"), runs)
    row["ts open+leaf"] = median_ms(lambda: np.asarray(treestore.open(url, "a")[address]), runs)
    row["ts diff"] = median_ms(lambda: treestore.diff(f"{url}#a", f"{url}#b"), runs)
    changed = len(treestore.diff(f"{url}#a", f"{url}#b"))
    assert changed == int(n * 0.01), changed
    row["B/leaf"] = read_commit_record(treestore.Store(url)._storage, "a").manifest_size / n
    row["peak MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before safetensors
    log(f"{row['leaves']}: safetensors")
    flat = {f"{g}.{k}": np.asarray(v) for g, leaves in tree.items() for k, v in leaves.items()}
    path = os.path.join(tmp, "st.safetensors")
    key = address.replace("/", ".")
    row["st save"] = median_ms(lambda: save_file(flat, path), runs)
    row["st load"] = median_ms(lambda: load_file(path), runs)

    def one() -> object:
        with safe_open(path, framework="np") as f:
            return f.get_tensor(key)

    row["st open+get"] = median_ms(one, runs)
    return row


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b else "-"


def table(rows: list[dict[str, Any]]) -> str:
    head = [
        "leaves",
        "save ts / st",
        "ratio",
        "load ts / st",
        "ratio",
        "open + one leaf ts / st",
        "ratio",
        "manifest-only diff",
        "manifest B/leaf",
        "peak RSS (treestore)",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        out.append(
            "| "
            + " | ".join(
                [
                    r["leaves"],
                    f"{r['ts save']:.1f} / {r['st save']:.1f} ms",
                    ratio(r["ts save"], r["st save"]),
                    f"{r['ts load']:.1f} / {r['st load']:.1f} ms",
                    ratio(r["ts load"], r["st load"]),
                    f"{r['ts open+leaf']:.1f} / {r['st open+get']:.1f} ms",
                    ratio(r["ts open+leaf"], r["st open+get"]),
                    f"{r['ts diff']:.1f} ms",
                    f"{r['B/leaf']:.0f}",
                    f"{r['peak MiB']:.0f} MiB",
                ]
            )
            + " |"
        )
    return "\n".join(out)


def run_row(n: int, runs: int, pieces: bool) -> dict[str, Any]:
    """One row in a fresh process (with 64 CPU devices for a row of pieces)."""
    env = dict(os.environ)
    if pieces:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={PIECES}"
    cmd = [sys.executable, "-m", "benchmarks.bench_scaling", "--row", str(n), "--runs", str(runs)]
    done = subprocess.run(cmd + (["--pieces"] if pieces else []), env=env, stdout=subprocess.PIPE, check=True)
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_scaling")
    ap.add_argument("--full", action="store_true", help="also 1M leaves and 10k leaves × 64 pieces")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="*", help="leaf counts (overrides the defaults)")
    ap.add_argument("--pieces", action="store_true", help="add (or, with --row, measure) leaves in pieces")
    ap.add_argument("--row", type=int, help=argparse.SUPPRESS)  # measure one row here, print JSON
    args = ap.parse_args(argv)
    if args.row is not None:
        with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
            print(json.dumps(measure(args.row, args.runs, args.pieces, tmp)))
        return 0
    sizes = args.sizes or [1_000, 10_000, 100_000] + ([1_000_000] if args.full else [])
    rows = [run_row(n, args.runs, False) for n in sizes]
    if args.full:
        rows.append(run_row(10_000, args.runs, True))
    elif args.pieces:
        rows.append(run_row(1_000, args.runs, True))
    print(f"Many leaves, {args.runs} runs (medians), float32[16] leaves in dicts of {GROUP}, local store:\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
