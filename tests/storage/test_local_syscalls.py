"""System calls a local store spends per chunk: on a network or overlay file system each one is
a round trip, and a save or load of a big tree makes hundreds of them per second. These tests
count calls, not time: a change that adds a call per chunk fails them on any machine."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import treestore
from treestore._storage.registry import open_storage

CALLS = ("lstat", "stat", "open", "fstat", "urandom", "mkdir")
CHUNKS = 40


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[collections.Counter[str]]:
    """Counts of the ``os`` functions in CALLS, from every thread, while the test runs: of those
    given a path, the calls on paths under ``tmp_path``, and of those given a descriptor, the
    calls on descriptors opened there (threads that earlier tests left running in this process
    ask about files of their own); every ``urandom``."""
    counts: collections.Counter[str] = collections.Counter()
    root = str(tmp_path)
    opened: set[int] = set()

    def ours(args: tuple[object, ...]) -> bool:
        if not args:
            return True
        first = args[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return first in opened
        if isinstance(first, (str, bytes, os.PathLike)):
            path = os.fsdecode(first)
            return path == root or path.startswith(root + os.sep)
        return True

    for name in CALLS:
        real = getattr(os, name)

        def counted(*args: object, _real=real, _name=name, **kwargs: object) -> object:
            counting = _name == "urandom" or ours(args)  # urandom is given a byte count
            if counting:
                counts[_name] += 1
            result = _real(*args, **kwargs)
            if counting and _name == "open":
                opened.add(result)
            return result

        monkeypatch.setattr(os, name, counted)
    yield counts


def _tree(seed: int) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(seed).standard_normal(CHUNKS * 65536).astype(np.float32)}


OPTIONS = treestore.SaveOptions(chunk_size=256 * 1024)  # CHUNKS chunks of 256 KiB


def test_a_chunk_read_costs_one_lstat_open_and_fstat(tmp_path: Path, calls: collections.Counter[str]):
    """Each object read is reached by an lstat (refusing links), opened and fstat-ed (refusing
    other kinds of file): once a thread holds scratch for a chunk, it asks for no size first."""
    store = treestore.Store(str(tmp_path))
    store.save(_tree(1), "a", options=OPTIONS)
    store.load("a")  # the read threads make their scratch
    calls.clear()
    store.load("a")
    assert calls["open"] >= CHUNKS
    assert calls["lstat"] <= calls["open"], dict(calls)
    assert calls["fstat"] <= calls["open"] + 2, dict(calls)
    assert calls["stat"] == 0, dict(calls)


def test_a_save_draws_randomness_once_not_per_temporary_file(tmp_path: Path, calls: collections.Counter[str]):
    """A save draws randomness once, for its lock's name, not once per chunk's temporary file.
    The temporary names' random prefix is drawn once per process, by the first temporary file
    the process writes: a first save makes it, so the count does not depend on which tests ran
    before in this process."""
    treestore.save(str(tmp_path / "first"), {"w": np.ones(2, np.float32)}, "a")
    calls.clear()
    result = treestore.save(str(tmp_path / "store"), _tree(2), "a", options=OPTIONS)
    assert result.chunks_written >= CHUNKS
    assert calls["urandom"] <= 1, dict(calls)


def test_a_write_into_a_folder_the_store_made_costs_one_lstat(
    tmp_path: Path, calls: collections.Counter[str]
):
    """One lstat per write checks that the folder is still a folder (removed, or replaced by a
    link, under a live Store: tests/storage/test_storage_faults.py); nothing more is asked of it."""
    storage = open_storage(str(tmp_path))
    storage.write("folder/a", [b"first"])
    calls.clear()
    for i in range(10):
        storage.write(f"folder/{i}", [b"more"])
    assert calls["lstat"] == 10, dict(calls)
    assert calls["stat"] == 0, dict(calls)
    assert storage.read("folder/9") == b"more"


def test_a_save_asks_nothing_about_chunks_in_folders_it_made(tmp_path: Path, calls: collections.Counter[str]):
    """A save into a new store makes each chunk folder with one mkdir and asks nothing about the
    chunks it writes into folders it made (no object can be there yet): on a network file system
    the existence check and the folder checks were a quarter of a big save's work. Into an
    existing store, chunks it does not trust are still checked, one request each.

    The first chunks' threads may each find ``chunks/`` itself missing, and each then tries to
    make it: two calls more per thread, once per store, whichever thread wins."""
    threads = 2
    options = dataclasses.replace(OPTIONS, threads=threads)
    result = treestore.save(str(tmp_path), _tree(3), "a", options=options)
    made = dict(calls)
    assert result.chunks_written >= CHUNKS and result.existence_checks == 0
    folders = len({p.parent for p in (tmp_path / "chunks").rglob("*") if p.is_file()})
    # the store's own folders besides, and the race for chunks/ (one thread's tries are counted
    # among the own folders)
    assert made["mkdir"] <= folders + 6 + 2 * (threads - 1), made
    assert made["stat"] <= 10, made
    assert made["lstat"] <= result.chunks_written + 10, made  # a folder check per write
    again = treestore.save(str(tmp_path), _tree(3), "b", options=OPTIONS, trust_previous=False)
    assert again.existence_checks == again.chunks_reused == result.chunks_written
    assert again.chunks_written == 0
    assert treestore.verify(str(tmp_path)).ok


def test_two_writes_into_one_new_folder_make_it_once(tmp_path: Path, calls: collections.Counter[str]):
    """Two threads writing into the same folder the store has not made yet: one mkdir, the other
    write waits for it (a save's threads write chunks whose names share a folder)."""
    import threading
    import time

    storage = open_storage(str(tmp_path))
    storage.write("chunks/first", [b"x"])  # the folder above made
    mkdir = os.mkdir

    def slow_mkdir(*args: object, **kwargs: object) -> None:
        time.sleep(0.05)  # both writes reach the folder before it exists
        mkdir(*args, **kwargs)  # type: ignore[arg-type]

    calls.clear()
    start = threading.Barrier(2)

    def write(name: str) -> None:
        start.wait()
        storage.write(f"chunks/ab/{name}", [name.encode()])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "mkdir", slow_mkdir)
        threads = [threading.Thread(target=write, args=(n,)) for n in ("one", "two")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert calls["mkdir"] == 1, dict(calls)
    assert storage.read("chunks/ab/one") == b"one" and storage.read("chunks/ab/two") == b"two"
