"""Every benchmark, one after the other, each table side by side with its peers.

    python -m benchmarks [--quick]

Runs, each in its own process (so one's memory and device settings cannot skew another's): the
format comparison (``run_peers``: save, load, one leaf, size, files), partial reads and diffs
(``bench_partial``), the training-loop manager (``bench_manager``), checkpoints of sharded arrays on
8 CPU devices (``bench_sharding``), restores onto meshes of up to 64 devices (``bench_mesh``),
derived checkpoints (``bench_derive``), many small leaves and leaves in pieces (``bench_scaling``),
verify, copy, derive and timeline over many leaves (``bench_store_ops``), multi-process commits
and restores by real processes sharing replicated bytes (``bench_multihost``, ``--restores``:
moto), the Hugging Face shard set (``bench_hf``), the cost of recording statistics
(``bench_stats``), a run's health from its manifests (``bench_health``), where a save's and a load's
CPU goes (``bench_profile``), what a file per chunk object costs a save (``bench_files``), where one
leaf's read goes (``bench_one_leaf``), start-up in a new virtualenv holding the newest dependency
versions the project allows (``bench_startup --fresh``: ``pip install .`` from the package index)
and, when its server is installed, S3 (``bench_s3``). ``--quick`` takes fewer runs. Tables go to
stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks")
    ap.add_argument("--quick", action="store_true", help="fewer runs (3 instead of 5)")
    args = ap.parse_args(argv)
    runs = "3" if args.quick else "5"
    suites = [
        ["benchmarks.run_peers", "--runs", runs],
        ["benchmarks.bench_partial", "--runs", runs],
        ["benchmarks.bench_manager"],
        ["benchmarks.bench_sharding", "--runs", "3"],
        ["benchmarks.bench_mesh", "--runs", "3"],
        ["benchmarks.bench_derive"],
        ["benchmarks.bench_scaling", "--runs", "3", "--pieces"],
        ["benchmarks.bench_store_ops", "--runs", runs],
        ["benchmarks.bench_multihost"],
        ["benchmarks.bench_multihost", "--restores"],
        ["benchmarks.bench_hf", "--runs", "3"],
        ["benchmarks.bench_stats", "--runs", runs],
        ["benchmarks.bench_health", "--runs", runs],
        ["benchmarks.bench_profile", "--runs", runs],
        ["benchmarks.bench_files", "--runs", runs],
        ["benchmarks.bench_one_leaf", "--runs", "9"],
        ["benchmarks.bench_startup", "--runs", "7", "--fresh"],
    ]
    if importlib.util.find_spec("benchmarks.bench_s3") and importlib.util.find_spec("moto"):
        suites.append(["benchmarks.bench_s3"])
    failed = 0
    for suite in suites:
        print(f"\n<!-- python -m {' '.join(suite)} -->\n", flush=True)
        failed |= subprocess.call([sys.executable, "-m", *suite]) != 0
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
