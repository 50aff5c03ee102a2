"""Multi-process saves: the primary's commit as the job grows, in a job of threads; and, with
``--restores``, restores by the processes of a real job, each replicated byte read once or by
every process (:mod:`benchmarks.multihost_restore`, whose docstring says what it measures).

    python -m benchmarks.bench_multihost [--runs 3] [--leaves 1000] [--processes 1 8 64 256] [--stages 8]
        [--stats on off]
    python -m benchmarks.bench_multihost --restores [--processes 1 2 4 8] [--runs 3]

Each job size N runs N threads in this process, each saving as one process of a multi-process
save (``treestore._engine.group.distributed.joined``, synchronised by a ``LocalRuntime`` as JAX's runtime
would synchronise real processes). The tree is ``--leaves`` float32 leaves of shape (8N, 8), each
sharded along its first axis into one (8, 8) piece per process, so the manifest holds leaves × N
pieces. Every save goes to a local temporary store and to ``memory://``.

The other processes' Python objects share this process's heap, and their threads its CPU, only
because they are threads here: process 0 freezes their objects out of its garbage collections once
every process has shared its pieces, and the others sleep from that barrier until process 0 has
committed (``CountedRuntime``), as on their own hosts they would not take its CPU.

Measured, medians of ``--runs`` saves (a new checkpoint name each, into the same store): process
0's commit — from the moment every process has written its part and sent its summary (the first
barrier) to its commit record written: reading the summaries from the runtime, checking the
coverage fingerprints, building, checking and encoding the frame, and the commit — and the
requests process 0 sends meanwhile: to the store from its own thread, one after another, and from
other threads at once (part reads, which only a failed check makes), and to the runtime. Then the
sizes of the frame and of one part, a reader's ``open`` of the checkpoint (the frame alone is
read), and its ``open`` and read of one leaf (the parts holding pieces of it read and merged).

Each job size runs in two shardings: every process holding a piece of every leaf (the usual data
and model parallel sharding, where a reader of one leaf needs every part), and ``--stages``
pipeline stages (leaf i in stage ``i * stages // leaves``, sharded over that stage's processes
alone, where a reader of one leaf reads only its stage's parts). Issue 13's target: the commit at
256 processes within 2× its time at 8, in the first sharding.

Each configuration runs with statistics recorded (``--stats on``) and without (``off``). With them,
the processes other than 0 combine their children's records before the first barrier
(:mod:`treestore._engine.group.stats_gather`), on hosts of their own in a real job: the table gives
the longest such combine in CPU time of its thread (decode and combine, not the wait for the
children, nor the other threads' turns on this machine's cores), which adds to the job's time
once per level of the tree below process 0, besides process 0's commit.
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

import treestore
from treestore._engine.group import distributed as D
from treestore._engine.group import stats_gather
from treestore._engine.group.group_runtime import LocalRuntime
from treestore._engine.reading.committed import read_commit_record, read_manifest_bytes
from treestore._engine.saving import writing as W
from treestore._engine.write import SaveOptions, write
from treestore._format.manifest.codec import decode_any
from treestore._format.manifest.frame import Frame
from treestore._storage.base import Storage
from treestore._storage.registry import open_storage
from treestore._tree.leaves import ArrayLeaf
from treestore._tree.prepare import Prepared, prepare

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
    """Times process 0's commit: from its first barrier to its commit record; and the longest
    combine of statistics by another process (``gathered``, reset before each save)."""

    def __init__(self) -> None:
        self.watched: Watched | None = None
        self.start = self.end = 0.0
        self.committed = threading.Event()  # cleared before each save
        self.gathered = 0.0
        self._lock = threading.Lock()

    def install(self) -> None:
        barrier, commit, combine = D.Group.barrier, W.commit, stats_gather.combine

        def timed_combine(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()  # its CPU: the threads share this process's cores
            try:
                return combine(*args, **kwargs)
            finally:
                took = time.thread_time() - started
                if threading.current_thread().name != "process-0":
                    with self._lock:
                        self.gathered = max(self.gathered, took)

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
            try:
                out = commit(*args, **kwargs)
            finally:
                self.end = time.perf_counter()
                if self.watched is not None:
                    self.watched.on = False
                self.committed.set()
            return out

        D.Group.barrier = timed_barrier  # type: ignore[method-assign]
        W.commit = timed_commit  # type: ignore[assignment]  # the one door's commit step
        stats_gather.combine = timed_combine  # type: ignore[assignment]


def shares_of(leaves: int, count: int, stages: int = 1) -> list[Prepared]:
    """What each process of the job prepares: every leaf sharded, one piece its own. With
    ``stages`` (pipeline stages), leaf i belongs to stage ``i * stages // leaves`` and is
    sharded over that stage's ``count // stages`` processes alone."""
    rng = np.random.default_rng(0)
    rows, cols = PIECE
    width = count // stages  # processes per stage
    names = [f"layer{i:06d}" for i in range(leaves)]
    tree = {a: rng.standard_normal((rows * width, cols)).astype(np.float32) for a in names}
    stage = {a: i * stages // leaves for i, a in enumerate(names)}

    def prepared(index: int) -> Prepared:
        def leaf(address: str, value: Any) -> ArrayLeaf:
            if stage[address] != index // width:
                return ArrayLeaf("numpy", "float32", None, pieces=(), global_shape=value.shape)
            at = rows * (index % width)
            own = value[at : at + rows]
            return ArrayLeaf("numpy", "float32", None, pieces=(((at, 0), own),), global_shape=value.shape)

        return prepare(tree, leaf=leaf)

    return [prepared(i) for i in range(count)]


class CountedRuntime(LocalRuntime):
    """A LocalRuntime counting the directory reads (``items``) made while ``watched.on``, whose
    other processes behave as if on hosts of their own: at the first barrier they arrive, then
    sleep until process 0 has committed (``committed``) instead of all waking on this process's
    CPU the moment the barrier opens, while process 0's commit is being timed."""

    watched: Watched | None = None
    committed: threading.Event | None = None
    reads = 0

    def items(self, prefix: str) -> dict[str, str]:
        if self.watched is not None and self.watched.on:
            CountedRuntime.reads += 1
        return super().items(prefix)

    def wait(self, barrier: str, timeout: float) -> str | None:
        if self.committed is None or threading.current_thread().name == "process-0":
            return super().wait(barrier, timeout)
        if not barrier.endswith("/written"):
            return super().wait(barrier, timeout)
        with self._cond:
            self._arrived[barrier] = self._arrived.get(barrier, 0) + 1
            self._first.setdefault(barrier, time.monotonic())
            self._cond.notify_all()
        self.committed.wait(timeout)
        with self._cond:
            return None if self._arrived[barrier] >= self.count else "process 0 did not commit"


def save_job(
    storage: Watched, prepared: list[Prepared], name: str, committed: threading.Event, stats: bool
) -> None:
    count = len(prepared)
    runtime = CountedRuntime(count)
    runtime.watched = storage
    runtime.committed = committed
    failures: list[BaseException] = []

    def process(i: int) -> None:
        with D.joined(runtime, i, count):
            try:
                options = SaveOptions(threads=1, stats=stats)
                write(storage, prepared[i], name, options=options)  # type: ignore[arg-type]
            except BaseException as exc:
                failures.append(exc)

    threads = [threading.Thread(target=process, args=(i,), name=f"process-{i}") for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.unfreeze()
    if failures:
        raise failures[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--restores" in argv:  # the other table: restores by real processes (multihost_restore)
        from benchmarks import multihost_restore

        return multihost_restore.main([a for a in argv if a != "--restores"])
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_multihost")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--leaves", type=int, default=1000)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--stages", type=int, default=8, help="pipeline stages of the second sharding")
    ap.add_argument("--stats", nargs="+", choices=["on", "off"], default=["on", "off"])
    args = ap.parse_args(argv)
    rows = []
    clock = Clock()
    clock.install()
    with tempfile.TemporaryDirectory() as tmp:
        for where in ("local", "memory"):
            for count in args.processes:
                for stages in sorted({1, args.stages}):
                    if stages > 1 and (count < stages or count % stages):
                        continue
                    for stats in args.stats:
                        log(f"{where}: {count} processes, {args.leaves} leaves, {stages} stage(s), {stats}")
                        rows.append(measure(where, count, stages, stats == "on", args, tmp, clock))
    print(f"\nprocess 0's commit, {args.leaves} sharded leaves, one piece per process holding it ", end="")
    print(f"(medians of {args.runs}); a reader's open, and open + one leaf\n")
    print(
        "| store | processes | stages | statistics | pieces | commit ms | others' longest combine ms ", end=""
    )
    print("| store requests, one after another ", end="")
    print("| store requests at once | runtime requests | frame KiB | part KiB | reader's open ms ", end="")
    print("| open + one leaf ms | parts it reads |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        (
            where,
            count,
            stages,
            stats,
            pieces,
            ms,
            combine_ms,
            own_n,
            pooled_n,
            asked_n,
            frame_k,
            part_k,
            open_ms,
            leaf_ms,
            read,
        ) = row
        print(
            f"| {where} | {count} | {stages} | {stats} | {pieces} | {ms:.1f} | {combine_ms:.1f} "
            f"| {own_n:.0f} | {pooled_n:.0f} "
            f"| {asked_n:.0f} | {frame_k:.1f} | {part_k:.1f} | {open_ms:.1f} | {leaf_ms:.1f} | {read} |"
        )
    for where in ("local", "memory"):
        for stats in args.stats:
            by = {c: ms for w, c, st, s, _, ms, *_ in rows if w == where and st == 1 and s == stats}
            if 8 in by and 256 in by:
                ratio = by[256] / by[8]
                print(
                    f"\n{where}, statistics {stats}: 256 processes / 8 processes = {ratio:.2f}× (target ≤ 2×)"
                )
    return 0


def measure(
    where: str, count: int, stages: int, stats: bool, args: argparse.Namespace, tmp: str, clock: Clock
) -> tuple[Any, ...]:
    """One row of the table: ``args.runs`` saves of a job of ``count`` processes, then reads."""
    prepared = shares_of(args.leaves, count, stages)
    url = (
        f"{tmp}/{where}-{count}-{stages}-{stats}"
        if where == "local"
        else f"memory://bench-{uuid.uuid4().hex}"
    )
    watched = Watched(open_storage(url))
    clock.watched = watched
    times, combines, own, pooled, asked = [], [], [], [], []
    for run in range(args.runs):
        watched.own = watched.pooled = CountedRuntime.reads = 0
        clock.committed.clear()
        clock.gathered = 0.0
        save_job(watched, prepared, f"run{run}", clock.committed, stats)
        times.append(clock.end - clock.start)
        combines.append(clock.gathered)
        own.append(watched.own)
        pooled.append(watched.pooled)
        asked.append(CountedRuntime.reads)
    del prepared
    storage = open_storage(url)
    record = read_commit_record(storage, "run0")
    frame = decode_any(read_manifest_bytes(storage, record), "run0")
    part, read = 0, 0
    if isinstance(frame, Frame):
        part = max((p.size for p in frame.parts), default=0)
        read = len(frame.needed(np.arange(len(frame.columns)) == 0))
    opened, leaf = [], []
    for _ in range(args.runs):
        started = time.perf_counter()
        ckpt = treestore.open(url, "run0")
        opened.append(time.perf_counter() - started)
        np.asarray(ckpt["layer000000"])
        leaf.append(time.perf_counter() - started)
    return (
        where,
        count,
        stages,
        "on" if stats else "off",
        args.leaves * count // stages,
        statistics.median(times) * 1000,
        statistics.median(combines) * 1000,
        statistics.median(own),
        statistics.median(pooled),
        statistics.median(asked),
        record.manifest_size / 2**10,
        part / 2**10,
        statistics.median(opened) * 1000,
        statistics.median(leaf) * 1000,
        read,
    )


if __name__ == "__main__":
    raise SystemExit(main())
