"""A save on a full chip: the cases where a training job's checkpoint cost it device memory, its
first minute or its step, with treestore and orbax side by side in the same run.

    python -m benchmarks.bench_full_chip [--quick] [--cases squeeze,full,shapes,stall,step]
        [--methods treestore,orbax] [--tmp-root DIR]

Every case runs each method in a process of its own, one at a time (one process holds the
accelerator, and each starts cold). The device's capacity is its ``bytes_limit``; a device that
reports none (a CPU) is taken to have 1 GiB, and ``--quick`` takes 256 MiB and scales every size
with it, for a run in CI. Cases:

* **squeeze**: bfloat16 leaves of 256 MiB filling 28% of the device (4.5 GB of a 16 GB chip), and
  a step whose temporaries fill the room beside them (a sort of float32 values, as many as run
  alone). Five times: an async save, then at once a step. Reported: the steps that ran (the
  others failed with ``RESOURCE_EXHAUSTED``) and the median time ``save`` blocked.
* **full**: leaves filling 80% of the device, one of them 4 GiB (the rest of 256 MiB); a default
  synchronous save, then an async save. Reported: whether each succeeded, for treestore
  whether every leaf read back equals the device's, bit for bit, and the most device memory
  each save took above what the device held before it (buffers and programs' reserved
  temporaries, sampled every 2 ms; none on a device without memory statistics).
* **shapes**: N float32 leaves of distinct shapes, about 2 MB each (N = 8, 64, 256): the first
  save of a fresh process and its second save.
* **stall**: a tree of half the device (no room for a copy beside it); five async saves. Reported:
  the median time ``save`` blocked over the last four, and the host memory held once the last
  save is written (resident memory above the baseline, as a multiple of the tree), for treestore
  with ``keep_host_copies`` True and False; and what is still held once the manager is closed
  (its copies dropped): the process's own, which is not the snapshot's.
* **step**: a dispatch-bound step (200 small jitted calls) timed alone, then while a background
  save of a tree of 6% of the device runs. Reported: the median step time with the save running
  over the median alone.

Progress goes to stderr; one markdown table per case to stdout.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks.async_managers import AsyncManager

MiB, GiB = 1 << 20, 1 << 30
CASES = ["squeeze", "full", "shapes", "stall", "step"]
METHODS = ["treestore", "orbax"]


def _log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def capacity(quick: bool) -> int:
    """Bytes the device may hold (256 MiB with ``--quick``; 1 GiB where the device does not say)."""
    import jax

    if quick:
        return 256 * MiB
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", GiB))


def _leaves(total: int, size: int, seed: int, dtype: str = "bfloat16", big: int = 0) -> dict[str, Any]:
    """Device leaves of ``size`` bytes (one of ``big`` bytes first, if any) up to ``total`` bytes,
    made on the device, one compiled generator per leaf shape."""
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    sizes = ([big] if big else []) + [size] * max(0, (total - big) // size)
    out = {}
    for i, nbytes in enumerate(sizes):
        key = jax.random.key(seed * 1000 + i)
        out[f"l{i:03d}"] = _generate(nbytes // dt.itemsize // 1024, dtype)(key)
    jax.block_until_ready(out)
    return out


@functools.cache
def _generate(rows: int, dtype: str) -> Any:
    """One generator program per leaf shape: a program per leaf would hold the device's memory
    for its temporaries (on a TPU, a loaded program reserves them)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda key: (jax.random.normal(key, (rows, 1024), jnp.float32) * 0.02).astype(dtype))


def _refresh(tree: dict[str, Any]) -> None:
    """A training step's update: every leaf replaced by a new array, written over the old one's
    memory (donated, as a training step does), so a device with no room beside the tree can run
    it. A save of the same arrays again would find jax's host copies of the last save cached on
    them, which no training loop does."""
    for k in tree:
        tree[k] = _bump()(tree[k])
    for x in tree.values():
        x.block_until_ready()


@functools.cache
def _bump() -> Any:
    import jax

    return jax.jit(lambda x: x + 1, donate_argnums=0)


def _save(method: str, path: str, tree: Any) -> None:
    if method == "treestore":
        import treestore

        treestore.save(path, tree, "c")
    else:
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()
        checkpointer.close()


class _DeviceMemory:
    """The most device memory taken above what the device held when the block began: buffers
    (``bytes_in_use``) plus what programs reserved for their temporaries (``bytes_reserved``, a
    TPU's), sampled every 2 ms on a thread. None where the device gives no statistics (a CPU)."""

    def __init__(self) -> None:
        import jax

        self.device = jax.devices()[0]
        self.most: int | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _used(self) -> int | None:
        stats = self.device.memory_stats()
        return None if not stats else int(stats.get("bytes_in_use", 0)) + int(stats.get("bytes_reserved", 0))

    def _sample(self, base: int) -> None:
        while not self._done.is_set():
            used = self._used()
            self.most = max(self.most or 0, (base if used is None else used) - base)
            time.sleep(0.002)

    def __enter__(self) -> _DeviceMemory:
        base = self._used()
        if base is not None:
            self.most = 0
            self._thread = threading.Thread(target=self._sample, args=(base,), daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def _oom(e: BaseException) -> bool:
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


# -- the cases, each in a process of its own --------------------------------------------------------
def squeeze(method: str, quick: bool, root: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    cap = capacity(quick)
    tree = _leaves(int(cap * 0.28), cap // 64, 1)
    tree_bytes = sum(int(x.nbytes) for x in tree.values())

    def step_of(n: int) -> Any:
        return jax.jit(lambda key: jnp.sort(jax.random.uniform(key, (n,))).sum())

    n = (cap - tree_bytes) // 4 // 2  # float32 values; shrunk until the step runs alone
    step = None
    while n > 1024:
        try:
            step = step_of(n)
            step(jax.random.key(0)).block_until_ready()
            break
        except Exception as e:
            if not _oom(e):
                raise
            n = n * 7 // 8
    assert step is not None
    manager = AsyncManager(method, os.path.join(root, "squeeze"))
    ran, blocked = 0, []
    try:
        for i in range(5):
            blocked.append(manager.save(i, tree))
            try:
                step(jax.random.key(i + 1)).block_until_ready()
                ran += 1
            except Exception as e:
                if not _oom(e):
                    raise
            manager.wait()
            _refresh(tree)
    finally:
        manager.close()
    return {"steps_ran": ran, "blocked": statistics.median(blocked), "tree": tree_bytes, "sorted": n}


def full(method: str, quick: bool, root: str) -> dict[str, Any]:
    import numpy as np

    cap = capacity(quick)
    _log(f"[full:{method}] making the tree")
    tree = _leaves(int(cap * 0.8), cap // 64, 2, big=cap // 4)
    out: dict[str, Any] = {"tree": sum(int(x.nbytes) for x in tree.values())}
    for mode in ("sync", "async"):
        path = os.path.join(root, mode)
        _log(f"[full:{method}] {mode} save")  # where a run cut short stopped
        t = time.perf_counter()
        try:
            with _DeviceMemory() as device_memory:
                if mode == "sync":
                    _save(method, path, tree)
                else:
                    manager = AsyncManager(method, path)
                    manager.save(1, tree)
                    manager.wait()
                    manager.close()
            out[mode] = round(time.perf_counter() - t, 3)
            out[f"{mode}_device_mib"] = None if device_memory.most is None else device_memory.most / MiB
        except Exception as e:
            out[mode] = f"failed: {str(e)[:120]}"
            shutil.rmtree(path, ignore_errors=True)
            continue
        if method == "treestore":
            import treestore
            from treestore._engine.saving import device_fetch

            _log(f"[full:{method}] {mode} save took {out[mode]} s; reading it back")
            store = treestore.Store(path)
            checkpoint = store.open(store.list()[-1].name)
            exact = all(
                np.array_equal(
                    checkpoint[k].region().view(np.uint16),  # host memory: the chip has no room
                    np.asarray(device_fetch.whole(x)).view(np.uint16),  # no copy left on x
                )
                for k, x in tree.items()
            )
            out[f"{mode}_exact"] = exact
        shutil.rmtree(path, ignore_errors=True)  # one 80%-of-the-chip checkpoint on disk at a time
    return out


def shapes(method: str, quick: bool, root: str, count: int) -> dict[str, Any]:
    import jax
    import numpy as np

    rng = np.random.default_rng(count)
    rows = 16 if quick else 512
    times = []
    for name in ("first", "second"):  # new arrays for each save, as after a training step
        tree = {
            f"w{i:03d}": jax.device_put(rng.standard_normal((rows + i, 1024), np.float32))
            for i in range(count)
        }
        jax.block_until_ready(tree)
        t = time.perf_counter()
        _save(method, os.path.join(root, name), tree)
        times.append(time.perf_counter() - t)
    return {"first": times[0], "second": times[1]}


def stall(method: str, quick: bool, root: str, keep_host_copies: bool = True) -> dict[str, Any]:
    import psutil

    cap = capacity(quick)
    tree = _leaves(cap // 2, cap // 64, 3)
    tree_bytes = sum(int(x.nbytes) for x in tree.values())
    process = psutil.Process()
    baseline = process.memory_info().rss
    manager = AsyncManager(method, os.path.join(root, "stall"), keep_host_copies)
    blocked = []
    try:
        for i in range(5):
            blocked.append(manager.save(i, tree))
            manager.wait()
            if i < 4:
                _refresh(tree)
        held = (process.memory_info().rss - baseline) / tree_bytes
    finally:
        manager.close()
    # what the process keeps once the manager is closed (its copies dropped): not the snapshot's
    gc.collect()
    closed = (process.memory_info().rss - baseline) / tree_bytes
    return {"blocked": statistics.median(blocked[1:]), "held": held, "closed": closed, "tree": tree_bytes}


def step_time(method: str, quick: bool, root: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    cap = capacity(quick)
    tree = _leaves(int(cap * 0.06), cap // 64, 4)
    small = jax.jit(lambda x: x * 1.0001 + 1.0)
    x0 = jnp.ones(256)

    def step() -> float:
        t = time.perf_counter()
        x = x0
        for _ in range(200):
            x = small(x)
        x.block_until_ready()
        return time.perf_counter() - t

    for _ in range(20):
        step()
    alone = [step() for _ in range(50)]
    manager = AsyncManager(method, os.path.join(root, "step"))
    during: list[float] = []
    try:
        t = time.perf_counter()
        manager.save(0, tree)  # the first save: warm (compiles, imports), and how long a save takes
        manager.wait()
        took = time.perf_counter() - t
        _refresh(tree)
        manager.save(1, tree)
        t_end = time.perf_counter() + 0.8 * took  # steps while the save runs, not after
        while time.perf_counter() < t_end or not during:
            during.append(step())
        manager.wait()
    finally:
        manager.close()
    ms = 1e3
    return {
        "alone": statistics.median(alone) * ms,
        "during": statistics.median(during) * ms,
        "steps": len(during),
    }


# -- the run --------------------------------------------------------------------------------------
def _share_compiles() -> None:
    """The squeeze's step (its sort took 54 s to compile on a v5e) compiled once for the run's
    processes, in jax's persistent cache. Only the squeeze's processes use the cache, and only
    programs that take 5 s or more to compile are kept there; the cases that time saves compile
    everything anew in each cold process, as a training job's first save does."""
    import jax

    cache = os.environ.get("BENCH_FULL_CHIP_CACHE")
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 5.0)


def child(what: str, quick: bool, tmp_root: str | None = None) -> Any:
    case, method, *rest = what.split(":")
    root = tempfile.mkdtemp(dir=tmp_root, prefix="bench-full-chip-")
    try:
        if case == "squeeze":
            return squeeze(method, quick, root)
        if case == "full":
            return full(method, quick, root)
        if case == "shapes":
            return shapes(method, quick, root, int(rest[0]))
        if case == "stall":
            return stall(method, quick, root, rest == ["keep"] or not rest)
        return step_time(method, quick, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _child(what: str, quick: bool, tmp_root: str | None = None) -> Any:
    _log(f"[{what}]")
    cmd = [sys.executable, "-m", "benchmarks.bench_full_chip", "--child", what] + (
        ["--quick"] if quick else []
    )
    if tmp_root:
        cmd += ["--tmp-root", tmp_root]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if out.returncode:
        return {"error": f"exit {out.returncode}"}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    _log(f"[{what}] {json.dumps(result)}")  # each figure as it comes, for a run cut short
    return result


def table(case: str, results: dict[str, Any]) -> str:
    def cell(r: dict[str, Any], key: str, fmt: str = "{:.3f}") -> str:
        if "error" in r:
            return r["error"]
        value = r.get(key)
        if value is None:
            return "—"
        return (
            fmt.format(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            else str(value)
        )

    lines = [f"**{case}**", ""]
    if case == "squeeze":
        lines += ["| method | steps that ran (of 5) | save blocked (s) |", "|---|---:|---:|"]
        lines += [
            f"| {m} | {cell(r, 'steps_ran', '{}')} | {cell(r, 'blocked')} |" for m, r in results.items()
        ]
    elif case == "full":
        lines += [
            "| method | sync save (s) | exact | device MiB above the tree | async save (s) | exact "
            "| device MiB above the tree |",
            "|---|---:|---|---:|---:|---|---:|",
        ]
        lines += [
            f"| {m} | {cell(r, 'sync')} | {cell(r, 'sync_exact')} | {cell(r, 'sync_device_mib', '{:.0f}')} | "
            f"{cell(r, 'async')} | {cell(r, 'async_exact')} | {cell(r, 'async_device_mib', '{:.0f}')} |"
            for m, r in results.items()
        ]
    elif case == "shapes":
        lines += ["| method, shapes | first save (s) | second save (s) |", "|---|---:|---:|"]
        lines += [f"| {m} | {cell(r, 'first')} | {cell(r, 'second')} |" for m, r in results.items()]
    elif case == "stall":
        lines += [
            "| method | save blocked (s) | host memory held (× tree) | after the manager closed (× tree) |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {m} | {cell(r, 'blocked')} | {cell(r, 'held', '{:.3f}')} | {cell(r, 'closed', '{:.3f}')} |"
            for m, r in results.items()
        ]
    else:
        lines += ["| method | step alone (ms) | during a save (ms) | ratio |", "|---|---:|---:|---:|"]
        for m, r in results.items():
            ratio = r["during"] / r["alone"] if "error" not in r else float("nan")
            lines.append(
                f"| {m} | {cell(r, 'alone', '{:.3f}')} | {cell(r, 'during', '{:.3f}')} | {ratio:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a nominal 256 MiB device (a CPU run in CI)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--methods", default=",".join(METHODS), help="of treestore,orbax")
    ap.add_argument("--tmp-root", default=None, help="where the checkpoints are written")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        if args.child.startswith("squeeze:"):
            _share_compiles()
        print(json.dumps(child(args.child, args.quick, args.tmp_root)), flush=True)
        os._exit(0)  # skip the accelerator runtime's teardown
    methods = args.methods.split(",")
    cache = tempfile.mkdtemp(dir=args.tmp_root, prefix="bench-full-chip-compiles-")
    os.environ["BENCH_FULL_CHIP_CACHE"] = cache

    def run(what: str) -> Any:
        return _child(what, args.quick, args.tmp_root)

    for case in args.cases.split(","):
        runs: dict[str, Any] = {}
        if case == "shapes":
            for count in (8, 64, 256):
                for m in methods:
                    runs[f"{m}, {count}"] = run(f"shapes:{m}:{count}")
        elif case == "stall":
            if "treestore" in methods:
                runs["treestore"] = run("stall:treestore:keep")
                runs["treestore keep_host_copies=False"] = run("stall:treestore:release")
            if "orbax" in methods:
                runs["orbax"] = run("stall:orbax")
        else:
            for m in methods:
                runs[m] = run(f"{case}:{m}")
        print(table(case, runs), flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
