"""Put-if-absent (SPEC.md §2, §2.2), on a local disk and ``memory://``: an object of that name
with other bytes is never replaced and the writer is told; one holding exactly the bytes being
written counts as written; of writers racing for one new name exactly one succeeds.

The race is forced: every writer's existence check waits until all of them have made it, so
put-if-absent done as check-then-write would let all of them write.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest

import treestore
from treestore._format import paths as _paths
from treestore._storage.base import Storage
from treestore._storage.local import LocalStorage, MemoryStorage

PATH = _paths.record_path("race")
WRITERS = 4


def storages(url: str, n: int) -> list[Any]:
    """``n`` independent Store objects' storages on one store, as ``n`` writers would have."""
    return [treestore.Store(url)._storage for _ in range(n)]


def test_an_object_with_other_bytes_is_never_replaced(store_url):
    storage = treestore.Store(store_url)._storage
    assert storage.write_new(PATH, b"first") is True
    assert storage.write_new(PATH, b"second") is False
    assert storage.write_new(PATH, b"firs") is False  # a prefix of it is other bytes too
    assert storage.write_new(PATH, b"first!") is False
    assert storage.read(PATH) == b"first"
    assert storage.write_new(PATH, b"first") is True  # a retried write finds its own object
    assert storage.read(PATH) == b"first"
    assert [o.path for o in storage.list(_paths.CHECKPOINTS)] == [PATH]


@pytest.fixture
def slow_existence_checks(monkeypatch):
    """Make every existence check of PATH wait (up to a second) until WRITERS checks have been
    made, after making its own: writers that hold no lock across check and write all find the
    name free. A writer that does hold one makes the others wait for it, so the barrier breaks
    and everyone goes on."""
    barrier = threading.Barrier(WRITERS, timeout=1.0)
    for cls in (Storage, LocalStorage, MemoryStorage):
        for name in ("exists", "object_size"):
            if name not in vars(cls):
                continue  # inherited: patched where it is defined
            real = vars(cls)[name]

            def slow(self, path, *args, _real=real, **kwargs):
                found = _real(self, path, *args, **kwargs)
                if path == PATH:
                    with contextlib.suppress(threading.BrokenBarrierError):
                        barrier.wait()
                return found

            monkeypatch.setattr(cls, name, slow)
    return barrier


def test_of_racing_writers_exactly_one_succeeds(store_url, slow_existence_checks):
    writers = storages(store_url, WRITERS)
    results: list[Any] = [None] * WRITERS

    def write(i: int) -> None:
        try:
            results[i] = writers[i].write_new(PATH, f"writer {i}".encode())
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=write, args=(i,)) for i in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results, key=str) == [False] * (WRITERS - 1) + [True], results
    winner = results.index(True)
    assert writers[0].read(PATH) == f"writer {winner}".encode()


def test_racing_writers_of_the_same_bytes_all_succeed(store_url, slow_existence_checks):
    """A writer whose bytes are already there (its own retried write, or an identical commit)
    counts as written: none of them is told another writer won."""
    writers = storages(store_url, WRITERS)
    results: list[Any] = [None] * WRITERS

    def write(i: int) -> None:
        results[i] = writers[i].write_new(PATH, b"the same bytes")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [True] * WRITERS
    assert writers[0].read(PATH) == b"the same bytes"
