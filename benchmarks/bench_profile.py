"""Where a treestore save and load spend their CPU, beside the LIMIT's components.

    python -m benchmarks.bench_profile [--runs 5] [--trees minilm-fp32,minilm-bf16,gpt2]

For each tree it saves (statistics on and off) and loads a local checkpoint ``--runs`` times and
counts, per save or load, the CPU time each thread spends in each step of treestore's pipeline:
copying a leaf's bytes before hashing, statistics, BLAKE3, the byte-plane transform and zstd
(``encode``), reading a chunk's object, decoding it, checking its digest. What no step accounts
for is the rest of the process's CPU (user and kernel): planning, the manifest, file creation,
writes and fsync, page faults of new arrays. Beside each step, the LIMIT component of the same
name (``benchmarks.limits``, on one core): the floor that step could reach.

The steps are counted by wrapping treestore's functions, which adds a few microseconds per
call; medians of the runs. One table per tree goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import treestore
from treestore._engine.reading import read
from treestore._engine.saving import chunk_writer, packs

from . import limits as L
from . import trees as T

_lock = threading.Lock()


@contextlib.contextmanager
def _counting(targets: list[tuple[Any, str, str]]) -> Iterator[dict[str, float]]:
    """Wrap each ``(module, function name, step)`` so its calls add their thread CPU time to
    the step; restore them on exit."""
    spent: dict[str, float] = collections.defaultdict(float)
    saved = []
    for module, name, step in targets:
        real = getattr(module, name)
        saved.append((module, name, real))

        def counted(*args: Any, _real: Callable[..., Any] = real, _step: str = step, **kw: Any) -> Any:
            t0 = time.thread_time()
            try:
                return _real(*args, **kw)
            finally:
                took = time.thread_time() - t0
                with _lock:
                    spent[_step] += took

        setattr(module, name, counted)
    try:
        yield spent
    finally:
        for module, name, real in saved:
            setattr(module, name, real)


SAVE_STEPS = [
    (chunk_writer, "_private_copy", "copy"),
    (chunk_writer._stats, "measure", "stats"),
    (packs._stats, "measure_segments", "stats"),
    (chunk_writer, "digest", "hash"),
    (chunk_writer, "encode", "encode"),
]
LOAD_STEPS = [
    (read, "fetch_object", "read"),
    (read, "fetch_object_into", "read"),
    (read, "decode_into", "decode"),
    (read, "decode_in_place", "decode"),
    (read, "digest", "verify"),
]
LIMIT_OF = {"hash": ("hash",), "encode": ("transform", "compress"), "read": ("read",)}
LIMIT_OF |= {"decode": ("decompress", "untransform"), "verify": ("verify",)}


def _profile(run: Callable[[], None], steps: list[tuple[Any, str, str]], runs: int) -> dict[str, float]:
    """Median seconds per run: wall, user and kernel CPU, and each step's CPU."""
    samples: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(runs):
        with _counting(steps) as spent:
            before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            run()
            wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        user, kernel = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
        samples["wall"].append(wall)
        samples["user"].append(user)
        samples["kernel"].append(kernel)
        samples["rest"].append(user + kernel - sum(spent.values()))
        for step in {s for _, _, s in steps}:
            samples[step].append(spent.get(step, 0.0))
    return {k: statistics.median(v) for k, v in samples.items()}


def _table(name: str, rows: dict[str, dict[str, float]], limit: dict[str, float]) -> str:
    cols = list(rows)
    order = ["wall", "user", "kernel", "copy", "stats", "hash", "encode", "read", "decode", "verify", "rest"]
    lines = [
        f"### {name}",
        "",
        "| ms | " + " | ".join(cols) + " | LIMIT (one core) |",
        "|---|" + "---:|" * (len(cols) + 1),
    ]
    for key in order:
        if not any(key in r for r in rows.values()):
            continue
        cells = [f"{r[key] * 1e3:.1f}" if key in r else "" for r in rows.values()]
        floor = LIMIT_OF.get(key)
        lim = f"{sum(limit.get(c, 0.0) for c in floor) * 1e3:.1f}" if floor else ""
        if key == "rest":
            lim = f"write {limit.get('write', 0.0) * 1e3:.1f}"
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {lim} |")
    return "\n".join(lines)


def _profile_tree(name: str, runs: int, root: str) -> str:
    """The table of tree ``name``: saves with statistics off and on, and loads."""
    tree = T.build(name)
    rows: dict[str, dict[str, float]] = {}
    for stats in (False, True):
        options = treestore.SaveOptions(stats=stats)

        def save(options: treestore.SaveOptions = options) -> None:
            folder = tempfile.mkdtemp(dir=root)
            try:
                treestore.save(folder, tree, "c", options=options)
            finally:
                shutil.rmtree(folder, ignore_errors=True)

        save()  # warm up: pools, page cache
        rows["save" + (", stats" if stats else "")] = _profile(save, SAVE_STEPS, runs)
        print(f"{name}: save stats={stats} done", file=sys.stderr)
    store = os.path.join(root, "load")
    treestore.save(store, tree, "c")
    treestore.load(store + "#c")
    rows["load"] = _profile(lambda: treestore.load(store + "#c"), LOAD_STEPS, runs)
    shutil.rmtree(store, ignore_errors=True)
    return _table(name, rows, L.components(list(T.flatten(tree).values()), root))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--trees", default="minilm-fp32,minilm-bf16,gpt2")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench-profile-")
    print(f"Wall and CPU time per save or load in ms, medians of {args.runs}; {os.cpu_count()} cores.\n")
    try:
        for name in args.trees.split(","):
            print(_profile_tree(name, args.runs, root) + "\n", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
