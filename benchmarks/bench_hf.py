"""The Hugging Face shard set: treestore's export and import beside safetensors' own.

    python -m benchmarks.bench_hf [--runs 3] [--shard-size 100MB]

GPT-2-small shapes (124M fp32 parameters, 498 MB) in shards of ``--shard-size``:

* **export**: ``treestore.export_file(store#ckpt, folder/, max_shard_size=...)`` from a local
  store, beside ``safetensors.numpy.save_file`` writing the same shards (the same tensors per
  file, as the index treestore wrote assigns them) from arrays already in memory;
* **import**: ``treestore.import_file(folder, store#name)`` into a fresh local store, beside
  ``safetensors.numpy.load_file`` of every shard.

Each operation runs in a fresh process; reported are the median wall time, the median peak
resident memory above the process's baseline just before the operation (VmHWM after resetting
it; it counts the pages of memory-mapped shards an import reads, which the kernel can drop), and
the peak of anonymous memory alone (sampled every 2 ms). For safetensors' export the arrays it
writes from are its input, part of the baseline.
One table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from . import trees as T
from .harness import _peak_bytes, _reset_hwm, _rss_bytes

MB = 1e6
INDEX = "model.safetensors.index.json"


def child(op: str, store: str, folder: str, shard_size: str) -> dict[str, Any]:
    """Run one operation in this (fresh) process: its seconds and peak bytes above baseline."""
    import safetensors.numpy

    import treestore

    work: Any
    if op == "treestore export":
        work = lambda: treestore.export_file(f"{store}#gpt2", f"{folder}/", max_shard_size=shard_size)  # noqa: E731
    elif op == "safetensors save_file":
        flat = T.flatten(T.gpt2_small())
        index = json.loads((Path(store).parent / "plan.json").read_text())
        files: dict[str, dict[str, Any]] = {}
        for name, file in index["weight_map"].items():
            files.setdefault(file, {})[name] = flat[name]

        def work() -> None:
            os.makedirs(folder, exist_ok=True)
            for file, tensors in files.items():
                safetensors.numpy.save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})

    elif op == "treestore import":
        work = lambda: treestore.import_file(folder, f"{store}-imported-{os.getpid()}#gpt2")  # noqa: E731
    else:  # safetensors load_file

        def work() -> dict[str, Any]:
            out: dict[str, Any] = {}
            for p in sorted(Path(folder).glob("*.safetensors")):
                out.update(safetensors.numpy.load_file(p))
            return out

    _reset_hwm()
    base, anon_base = _rss_bytes(), _anon_bytes()
    anon_peak = [anon_base]
    done = threading.Event()

    def sample() -> None:  # anonymous memory, which VmHWM mixes with mapped file pages
        while not done.wait(0.002):
            anon_peak[0] = max(anon_peak[0], _anon_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    result = work()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    peak = _peak_bytes() - base
    del result
    return {"seconds": seconds, "peak": peak, "anon": max(anon_peak[0], _anon_bytes()) - anon_base}


def _anon_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


def spawn(op: str, store: str, folder: str, shard_size: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_hf", "--child", op, store, folder, shard_size],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_hf")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shard-size", default="100MB")
    ap.add_argument("--child", nargs=4, metavar=("OP", "STORE", "FOLDER", "SIZE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    import treestore

    with tempfile.TemporaryDirectory(prefix="treestore-hf-") as tmp:
        store = os.path.join(tmp, "store")
        treestore.save(store, T.gpt2_small(), "gpt2")
        plan = os.path.join(tmp, "plan")
        treestore.export_file(f"{store}#gpt2", f"{plan}/", max_shard_size=args.shard_size)
        shutil.copy(os.path.join(plan, INDEX), os.path.join(tmp, "plan.json"))
        shards = len(list(Path(plan).glob("*.safetensors")))
        results: dict[str, list[dict[str, Any]]] = {}
        for run in range(args.runs):
            print(f"run {run + 1}/{args.runs}", file=sys.stderr, flush=True)
            for fmt, (write, read) in {
                "treestore": ("treestore export", "treestore import"),
                "safetensors": ("safetensors save_file", "safetensors load_file"),
            }.items():
                folder = os.path.join(tmp, f"{fmt}-{run}")
                for op in (write, read):
                    results.setdefault(op, []).append(spawn(op, store, folder, args.shard_size))
                shutil.rmtree(folder)
        size = json.loads(Path(tmp, "plan.json").read_text())["metadata"]["total_size"]
        print(f"\nHugging Face shard set: GPT-2-small shapes ({size / MB:.0f} MB fp32), ", end="")
        print(f"{shards} shards of {args.shard_size}, medians of {args.runs} fresh processes\n")
        print("| operation | wall (s) | peak RSS above baseline (MB) | of it anonymous (MB) |")
        print("|---|---:|---:|---:|")
        for op, rows in results.items():
            t = statistics.median(r["seconds"] for r in rows)
            m = statistics.median(r["peak"] for r in rows) / MB
            a = statistics.median(r["anon"] for r in rows) / MB
            print(f"| {op} | {t:.2f} | {m:.0f} | {a:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
