"""What a file per chunk object costs a save: the kernel's per-file work, measured on a tree's own
chunk objects.

    python -m benchmarks.bench_files [--runs 5] [--trees minilm-fp32,minilm-bf16,gpt2]

For each tree, treestore saves it once; its chunk objects (the bytes a save writes, one file each)
are then written again, timed, in three ways that keep SPEC §8's crash guarantee (a name never
holds a short or empty object) — each ending with every byte and name durable:

* **a file per object** (what a save does): per object, a temporary file created in its fan-out
  folder, written, fsynced, linked to its name and unlinked; then each folder fsynced;
* **a file per object, one sync**: every temporary file created and written, then one
  ``syncfs`` of the filesystem, then every link and unlink, then each folder fsynced — the
  kernel batches the writeback and the journal commits once;
* **one file** (the save LIMIT's write, as safetensors stores a tree): all objects appended to one
  temporary file, fsynced once, renamed, its folder fsynced.

Single-threaded, medians of --runs, a fresh folder per run; ``os.sync()`` before each run so that
no earlier writeback lands in it. The difference between the first and the last row is what a file
per object costs; the middle row is what batching durability would win back.

A second table asks whether that shows in a real save, whose threads overlap each fsync with the
other chunks' hashing and compression: ``treestore.save`` (with ``os.sync()``, as the side-by-side
benchmark times it) beside the same save with its per-object fsyncs replaced by one ``syncfs``
before the commit (an experiment patched in here, not a mode treestore offers), alternated.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import treestore
from treestore._storage import local as _local
from treestore._storage.local import _fsync

from . import harness as H
from . import trees as T

_libc = ctypes.CDLL(None, use_errno=True)


def _syncfs(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        if _libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs failed")
    finally:
        os.close(fd)


def _objects(tree: T.Tree, root: str) -> list[tuple[str, bytes]]:
    """(path relative to the store, bytes) of every chunk object a save of ``tree`` writes."""
    store = os.path.join(root, "source")
    treestore.save(store, tree, "c")
    out = []
    for path in sorted(Path(store, "chunks").rglob("*")):
        if path.is_file():
            out.append((str(path.relative_to(store)), path.read_bytes()))
    shutil.rmtree(store)
    return out


def _write_tmp(folder: str, data: bytes) -> str:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return tmp


def _staged(dest: str, objects: list[tuple[str, bytes]], folders: set[str]) -> Iterator[tuple[str, str]]:
    """Each object written to a temporary file in its folder (made when first met, and added to
    ``folders``): (the temporary file, the object's name), one at a time."""
    for rel, data in objects:
        full = os.path.join(dest, rel)
        folder = os.path.dirname(full)
        if folder not in folders:
            os.makedirs(folder, exist_ok=True)
            folders.add(folder)
        yield _write_tmp(folder, data), full


def file_per_object(dest: str, objects: list[tuple[str, bytes]]) -> None:
    folders: set[str] = set()
    for tmp, full in _staged(dest, objects, folders):
        _fsync(tmp)
        os.link(tmp, full)
        os.unlink(tmp)
    for folder in sorted(folders):
        _fsync(folder)


def file_per_object_one_sync(dest: str, objects: list[tuple[str, bytes]]) -> None:
    folders: set[str] = set()
    staged = list(_staged(dest, objects, folders))
    _syncfs(dest)
    for tmp, full in staged:
        os.link(tmp, full)
        os.unlink(tmp)
    for folder in sorted(folders):
        _fsync(folder)


def one_file(dest: str, objects: list[tuple[str, bytes]]) -> None:
    os.makedirs(dest, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dest)
    with os.fdopen(fd, "wb") as f:
        for _, data in objects:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(dest, "objects"))
    _fsync(dest)


WAYS: dict[str, Callable[[str, list[tuple[str, bytes]]], None]] = {
    "a file per object (a save)": file_per_object,
    "a file per object, one sync": file_per_object_one_sync,
    "one file (LIMIT's write)": one_file,
}


def _save_times(root: str, tree: T.Tree, runs: int) -> tuple[float, float]:
    """Median seconds of a save + os.sync(): as treestore saves, and with durability batched."""
    durable, sync = _local.LocalStorage._durable, _local.LocalStorage.sync

    def batched_durable(self: _local.LocalStorage, full: str, tmp: str) -> None:
        with self._dirty_lock:  # no fsync of the object: syncfs below makes it durable
            self._dirty_dirs.add(os.path.dirname(full))

    def batched_sync(self: _local.LocalStorage) -> None:
        _syncfs(root)
        sync(self)

    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(runs):
            for batched in (False, True):
                _local.LocalStorage._durable = batched_durable if batched else durable  # type: ignore[method-assign]
                _local.LocalStorage.sync = batched_sync if batched else sync  # type: ignore[method-assign]
                dest = tempfile.mkdtemp(dir=root)
                os.sync()
                t0 = time.perf_counter()
                treestore.save(dest, tree, "c")
                os.sync()
                times[batched].append(time.perf_counter() - t0)
                shutil.rmtree(dest)
    finally:
        _local.LocalStorage._durable, _local.LocalStorage.sync = durable, sync  # type: ignore[method-assign]
    return statistics.median(times[False]), statistics.median(times[True])


def _times(root: str, objects: list[tuple[str, bytes]], runs: int) -> dict[str, tuple[float, float]]:
    """Per way of writing: (median wall seconds, median kernel seconds), the ways alternated."""
    walls: dict[str, list[float]] = {name: [] for name in WAYS}
    kernel: dict[str, list[float]] = {name: [] for name in WAYS}
    for _ in range(runs):
        for name, write in WAYS.items():
            dest = tempfile.mkdtemp(dir=root)
            os.sync()
            c0, t0 = os.times(), time.perf_counter()
            write(dest, objects)
            t1, c1 = time.perf_counter(), os.times()
            walls[name].append(t1 - t0)
            kernel[name].append(c1.system - c0.system)
            shutil.rmtree(dest)
    return {n: (statistics.median(walls[n]), statistics.median(kernel[n])) for n in WAYS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_files")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--trees", default="minilm-fp32,minilm-bf16,gpt2")
    ap.add_argument("--tmp-root", default=None)
    args = ap.parse_args(argv)
    root = H.make_tmp_root(args.tmp_root)
    try:
        print(f"medians of {args.runs} runs, one thread, local disk ({H.fs_type(root)})\n")
        print("| tree | objects | MB | written as | wall s | kernel s | ÷ one file |")
        print("|---|---:|---:|---|---:|---:|---:|")
        saves = {}
        for name in args.trees.split(","):
            H.log(f"[files] {name}")
            tree = T.build(name)
            saves[name] = _save_times(root, tree, args.runs)
            objects = _objects(tree, root)
            size = sum(len(d) for _, d in objects) / 1e6
            times = _times(root, objects, args.runs)
            base = times["one file (LIMIT's write)"][0]
            for way, (wall, sys_s) in times.items():
                print(
                    f"| {name} | {len(objects)} | {size:.1f} | {way} | {wall:.3f} | {sys_s:.3f} "
                    f"| {wall / base:.2f}× |"
                )
        print("\n| tree | save s | save, one syncfs s | ÷ save |")
        print("|---|---:|---:|---:|")
        for name, (plain, batched) in saves.items():
            print(f"| {name} | {plain:.3f} | {batched:.3f} | {batched / plain:.2f}× |")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
