"""Multi-process saves: the primary's commit as the job grows, in a job of threads.

    python -m benchmarks.bench_multihost [--runs 3] [--leaves 1000] [--processes 1 8 64 256]

Each job size N runs N threads in this process, each saving as one process of a multi-process
save (``treestore._engine.distributed.joined``, synchronised by a ``LocalRuntime`` as JAX's runtime
would synchronise real processes). The tree is ``--leaves`` float32 leaves of shape (8N, 8), each
sharded along its first axis into one (8, 8) piece per process, so the manifest holds leaves × N
pieces. Every save goes to a local temporary store and to ``memory://``.

The other processes' Python objects share this process's heap only because they are threads
here, so process 0 freezes them out of its garbage collections once every process has shared its
pieces. Measured, medians of ``--runs`` saves (a new checkpoint name each, into the same store): process
0's commit — from the moment every process has shared its pieces (the first barrier) to its commit
record written: reading the other processes' staging records, merging them, checking and encoding
the manifest, and the commit — and the requests process 0 sends meanwhile: those from its own
thread, one after another, and the staging record reads its pool sends at once (up to
``READERS`` at a time). Issue 13's target: the commit at 256 processes within 2× its time at 8.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import numpy as np

from treestore._engine import distributed as D
from treestore._engine.group_runtime import LocalRuntime
from treestore._engine.write import Prepared, SaveOptions, prepare, write
from treestore._storage.base import Storage
from treestore._storage.registry import open_storage
from treestore._tree.leaves import ArrayLeaf

PIECE = (8, 8)


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


class Watched:
    """A storage whose requests are counted while ``on``: from the thread ``main``, and from others."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self.on = False
        self.main: int | None = None
        self.own = self.pooled = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._storage, name)
        if not callable(found) or name.startswith("_"):
            return found

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                with self._lock:
                    if threading.get_ident() == self.main:
                        self.own += 1
                    else:
                        self.pooled += 1
            return found(*args, **kwargs)

        return counted


class Clock:
    """Times process 0's commit: from its first barrier to its commit record."""

    def __init__(self) -> None:
        self.watched: Watched | None = None
        self.start = self.end = 0.0

    def install(self) -> None:
        barrier, commit = D.Group.barrier, D.commit

        def timed_barrier(group: D.Group, step: str, lock: Any = None) -> None:
            barrier(group, step, lock)
            if group.primary and step == "written" and self.watched is not None:
                # The other processes' objects live in this process only because they are
                # threads here: keep them out of process 0's garbage collections.
                gc.collect()
                gc.freeze()
                self.watched.main = threading.get_ident()
                self.watched.on = True
                self.start = time.perf_counter()

        def timed_commit(*args: Any, **kwargs: Any) -> Any:
            out = commit(*args, **kwargs)
            self.end = time.perf_counter()
            if self.watched is not None:
                self.watched.on = False
            return out

        D.Group.barrier = timed_barrier  # type: ignore[method-assign]
        D.commit = timed_commit  # type: ignore[assignment]


def shares_of(leaves: int, count: int) -> list[Prepared]:
    """What each process of the job prepares: every leaf sharded, one piece its own."""
    rng = np.random.default_rng(0)
    rows, cols = PIECE
    tree = {f"layer{i}": rng.standard_normal((rows * count, cols)).astype(np.float32) for i in range(leaves)}

    def prepared(index: int) -> Prepared:
        def leaf(address: str, value: Any) -> ArrayLeaf:
            own = value[rows * index : rows * (index + 1)]
            return ArrayLeaf(
                "numpy", "float32", None, pieces=(((rows * index, 0), own),), global_shape=value.shape
            )

        return prepare(tree, leaf=leaf)

    return [prepared(i) for i in range(count)]


def save_job(storage: Watched, prepared: list[Prepared], name: str) -> None:
    count = len(prepared)
    runtime = LocalRuntime(count)
    failures: list[BaseException] = []

    def process(i: int) -> None:
        with D.joined(runtime, i, count):
            try:
                write(storage, prepared[i], name, options=SaveOptions(threads=1))  # type: ignore[arg-type]
            except BaseException as exc:
                failures.append(exc)

    threads = [threading.Thread(target=process, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.unfreeze()
    if failures:
        raise failures[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_multihost")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--leaves", type=int, default=1000)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 8, 64, 256])
    args = ap.parse_args(argv)
    rows = []
    clock = Clock()
    clock.install()
    with tempfile.TemporaryDirectory() as tmp:
        for where in ("local", "memory"):
            for count in args.processes:
                log(f"{where}: {count} processes, {args.leaves} leaves")
                prepared = shares_of(args.leaves, count)
                url = f"{tmp}/{where}-{count}" if where == "local" else f"memory://bench-{uuid.uuid4().hex}"
                watched = Watched(open_storage(url))
                clock.watched = watched
                times, own, pooled = [], [], []
                for run in range(args.runs):
                    watched.own = watched.pooled = 0
                    save_job(watched, prepared, f"run{run}")
                    times.append(clock.end - clock.start)
                    own.append(watched.own)
                    pooled.append(watched.pooled)
                manifests = watched.list("manifests")
                size = max(m.size for m in manifests)
                rows.append(
                    (
                        where,
                        count,
                        args.leaves * count,
                        statistics.median(times) * 1000,
                        statistics.median(own),
                        statistics.median(pooled),
                        size / 2**20,
                    )
                )
                del prepared
    print(f"\nprocess 0's commit, {args.leaves} sharded leaves, one piece per process ", end="")
    print(f"(medians of {args.runs})\n")
    print("| store | processes | pieces | commit ms | requests, one after another | reads at once ", end="")
    print("| manifest MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for where, count, pieces, ms, own_n, pooled_n, mib in rows:
        print(f"| {where} | {count} | {pieces} | {ms:.1f} | {own_n:.0f} | {pooled_n:.0f} | {mib:.2f} |")
    for where in ("local", "memory"):
        by = {count: ms for w, count, _, ms, *_ in rows if w == where}
        if 8 in by and 256 in by:
            print(f"\n{where}: 256 processes / 8 processes = {by[256] / by[8]:.2f}× (target ≤ 2×)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
