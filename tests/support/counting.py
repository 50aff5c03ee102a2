"""An fsspec filesystem that counts what is read, to prove partial reads touch only what they need."""

from __future__ import annotations

import threading
from typing import ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class CountingFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem under the protocol ``counting://``, counting reads."""

    protocol = ("counting",)
    _lock = threading.Lock()
    reads: ClassVar[list[tuple[str, int]]] = []  # (path, bytes returned) of every read request

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start=start, end=end, **kwargs)
        with self._lock:
            CountingFileSystem.reads.append((self._strip_protocol(path), len(data)))
        return data

    @classmethod
    def reset(cls) -> None:
        with cls._lock:
            cls.reads = []

    @classmethod
    def bytes_read(cls, under: str = "") -> int:
        return sum(n for p, n in cls.reads if under in p)

    @classmethod
    def paths_read(cls) -> list[str]:
        return [p for p, _ in cls.reads]


fsspec.register_implementation("counting", CountingFileSystem, clobber=True)
