"""Faults injected by real means, never by patching treestore: ``faultmem://``, fsspec's memory
filesystem with the generic walk-based ``find`` most fsspec backends use, whose ``ls`` or
``rm_file`` fail for chosen paths (treestore uses its generic Storage class for it), and what the
tests that use it read and write straight from a store's filesystem."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

MiB = 2**20


class FaultyMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem as ``faultmem://`` (sharing its objects with ``memory://``).

    ``find`` is fsspec's generic one (a walk of ``ls`` calls, as on most fsspec backends), so a
    folder whose listing fails is silently left out of the result, as it is on those backends.
    ``ls`` of a path in ``unlistable`` (or below it), ``rm_file`` of a path starting with one
    of ``undeletable`` and ``cat_file`` of a path starting with one of ``unreadable`` raise
    PermissionError.
    """

    protocol = ("faultmem",)
    unlistable: ClassVar[set[str]] = set()
    undeletable: ClassVar[tuple[str, ...]] = ()
    unreadable: ClassVar[tuple[str, ...]] = ()
    find = fsspec.AbstractFileSystem.find

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("faultmem://"))

    def ls(self, path, detail=True, **kwargs):
        p = self._strip_protocol(path)
        if any(p == bad or p.startswith(bad + "/") for bad in FaultyMemoryFileSystem.unlistable):
            raise PermissionError(f"injected fault: cannot list {p}")
        return super().ls(path, detail=detail, **kwargs)

    def rm_file(self, path):
        p = self._strip_protocol(path)
        if p.startswith(FaultyMemoryFileSystem.undeletable):
            raise PermissionError(f"injected fault: cannot remove {p}")
        return super().rm_file(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        p = self._strip_protocol(path)
        if p.startswith(FaultyMemoryFileSystem.unreadable):
            raise PermissionError(f"injected fault: cannot read {p}")
        return super().cat_file(path, start=start, end=end, **kwargs)


fsspec.register_implementation("faultmem", FaultyMemoryFileSystem, clobber=True)


@pytest.fixture
def faultmem() -> Iterator[str]:
    """A fresh ``faultmem://`` store URL, with no fault armed before or after the test."""
    FaultyMemoryFileSystem.unlistable = set()
    FaultyMemoryFileSystem.undeletable = FaultyMemoryFileSystem.unreadable = ()
    yield f"faultmem://treestore-tests/{uuid.uuid4().hex}"
    FaultyMemoryFileSystem.unlistable = set()
    FaultyMemoryFileSystem.undeletable = FaultyMemoryFileSystem.unreadable = ()


def fs_root(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and root path of a store URL (local, memory:// or faultmem://)."""
    if url.startswith("faultmem://"):
        return FaultyMemoryFileSystem(), FaultyMemoryFileSystem._strip_protocol(url)
    return fsspec.core.url_to_fs(url)


def objects(url: str, folder: str = "") -> set[str]:
    """Every object (file) of the store under ``folder``, as paths relative to the store root,
    read straight from the filesystem (never through treestore)."""
    fs, root = fs_root(url)
    top = f"{root}/{folder}".rstrip("/")
    if not fs.exists(top):
        return set()
    names = MemoryFileSystem.find(fs, top) if isinstance(fs, MemoryFileSystem) else fs.find(top)
    return {n[len(root) + 1 :] for n in names}


def chunk_objects(url: str) -> list[str]:
    return sorted(p for p in objects(url, "chunks") if not os.path.basename(p).startswith(".tmp-"))


def put_object(url: str, path: str, data: bytes) -> None:
    """Write ``data`` at ``path`` of the store in place (as a broken writer or disk would)."""
    fs, root = fs_root(url)
    full = f"{root}/{path}"
    fs.makedirs(os.path.dirname(full), exist_ok=True)
    fs.pipe_file(full, data)


def get_object(url: str, path: str) -> bytes:
    fs, root = fs_root(url)
    return bytes(fs.cat_file(f"{root}/{path}"))


def chunked_tree(seed: int, n: int = 50_000) -> dict[str, Any]:
    """A tree with a chunked leaf (over the 64 KiB small-leaf limit) and packed small leaves."""
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal(n).astype(np.float32),
        "b": rng.integers(0, 1000, 17).astype(np.int64),
        "step": seed,
    }


def outcome(fn: Callable[[], Any]) -> BaseException | None:
    """The exception ``fn`` raised, or None."""
    try:
        fn()
    except Exception as exc:  # the tests assert on what it was
        return exc
    return None
