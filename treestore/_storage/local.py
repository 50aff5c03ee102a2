"""Stores on this machine: a local folder (written through ``os``) and fsspec's memory filesystem.

A local store is written by temporary file plus ``replace`` (or ``link`` for put-if-absent) in the
destination folder, fsynced at commit time; it is read only through regular files reached
without symlinks, so a hostile store cannot make a load read, block on or write anything outside
it.
"""

from __future__ import annotations

import builtins
import concurrent.futures as cf
import contextlib
import errno
import os
import re
import stat
import threading
import uuid
from collections.abc import Iterable

import fsspec

from treestore._storage.base import Buffers, ObjectInfo, Storage
from treestore.errors import StorageError

_TMP = re.compile(r"\.tmp-[0-9a-f]{32}")


class MemoryStorage(Storage):
    """fsspec's in-process memory filesystem; a lock makes put-if-absent atomic."""

    _lock = threading.Lock()

    def write_new(self, path: str, data: bytes) -> bool:
        self._check_writable(path)
        with self._lock:
            if self.exists(path):
                return self._holds(path, data)
            self.write(path, [data])
            return True


class LocalStorage(Storage):
    """A local folder, written through ``os`` for atomic replace and put-if-absent by link."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        super().__init__(fs, root, url)
        self._made: set[str] = set()
        self._dirty_files: list[str] = []
        self._dirty_dirs: set[str] = set()
        self._dirty_lock = threading.Lock()
        self._inside: set[str] = set()

    # A store never holds links or special files: reads open only regular files reached without
    # symlinks, so a hostile store cannot make a load read (or block on) anything outside it.
    def _check_inside(self, folder: str) -> None:
        if folder in self._inside:
            return
        real_root = os.path.realpath(self.root or ".")
        real = os.path.realpath(folder)
        if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
            raise StorageError(f"{folder} leads outside the store {self.url} (a symlinked folder)")
        if os.path.realpath(os.path.join(real_root, os.path.relpath(folder, self.root or "."))) != real:
            raise StorageError(f"{folder} in store {self.url} is reached through a symlink")
        self._inside.add(folder)

    def _cat_range(self, full: str, start: int, end: int) -> bytes:
        self._check_inside(os.path.dirname(full))
        try:
            mode = os.lstat(full).st_mode  # refuse links before opening anything through them
        except FileNotFoundError:
            raise
        if not stat.S_ISREG(mode):
            raise StorageError(f"{full} is not a regular file; a store holds only regular files")
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(full, flags | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise FileNotFoundError(full) from None
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise StorageError(f"{full} is a symlink; a store holds only regular files") from None
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise StorageError(f"{full} is not a regular file; a store holds only regular files")
            stop = min(end, info.st_size)
            return os.pread(fd, max(stop - start, 0), start) if stop > start else b""
        finally:
            os.close(fd)

    def read(self, path: str, *, limit: int | None = None) -> bytes | None:
        if limit is None:
            return self.read_range(path, 0, 2**62)  # bounded by the file's size, checked open
        return super().read(path, limit=limit)

    def object_size(self, path: str) -> int | None:
        try:
            info = os.lstat(self._full(path))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"inspecting {self.url}/{path} failed: {exc}") from exc
        return info.st_size if stat.S_ISREG(info.st_mode) else None  # a link is no object

    def temporaries(self, prefix: str) -> builtins.list[ObjectInfo]:
        return [o for o in self._walk(prefix) if _TMP.fullmatch(os.path.basename(o.path))]

    def _walk(self, prefix: str) -> builtins.list[ObjectInfo]:
        """Regular files under ``prefix``, not following symlinks."""
        top = self._full(prefix)
        if not os.path.lexists(top):
            return []
        self._check_inside(top)
        out = []
        for folder, dirs, files in os.walk(top, followlinks=False):
            for name in files:
                full = os.path.join(folder, name)
                try:
                    info = os.lstat(full)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(info.st_mode):
                    out.append(ObjectInfo(self._rel(full), info.st_size, info.st_mtime))
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        return sorted(out, key=lambda o: o.path)

    def _tmp(self, full: str) -> str:
        folder = os.path.dirname(full)
        if folder not in self._made:
            os.makedirs(folder, exist_ok=True)
            self._check_inside(folder)  # never write through a symlinked folder
            self._made.add(folder)
        return os.path.join(folder, f".tmp-{uuid.uuid4().hex}")

    def _write_tmp(self, full: str, buffers: Buffers) -> str:
        tmp = self._tmp(full)
        with open(tmp, "wb") as f:
            for buf in buffers:
                f.write(buf)
        return tmp

    def _durable(self, full: str, tmp: str) -> None:
        """fsync ``tmp`` now (it is about to be linked); remember the folder for :meth:`sync`."""
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        with self._dirty_lock:
            self._dirty_dirs.add(os.path.dirname(full))

    def sync(self) -> None:
        """fsync every file written since the last sync (in parallel), then their folders."""
        with self._dirty_lock:
            files, self._dirty_files = self._dirty_files, []
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        dirs.update(os.path.dirname(f) for f in files)

        def fsync(path: str) -> None:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # replaced or collected since: nothing to make durable
                return
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        if len(files) > 1:
            with cf.ThreadPoolExecutor(min(8, len(files))) as pool:
                list(pool.map(fsync, files))
        else:
            for f in files:
                fsync(f)
        for d in dirs:
            fsync(d)

    def write(self, path: str, buffers: Buffers) -> None:
        self._check_writable(path)
        full = self._full(path)

        def put() -> None:
            tmp = self._write_tmp(full, buffers)
            try:
                os.replace(tmp, full)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            with self._dirty_lock:
                self._dirty_files.append(full)

        self._call("writing", path, put)

    def write_new(self, path: str, data: bytes) -> bool:
        self._check_writable(path)
        full = self._full(path)

        def put() -> bool:
            tmp = self._write_tmp(full, [data])
            try:
                self._durable(full, tmp)
                os.link(tmp, full)
                return True
            except FileExistsError:
                return False
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

        return self._call("writing", path, put) or self._holds(path, data)

    def list(self, prefix: str) -> list[ObjectInfo]:
        # Temporary files of writes in flight are not objects.
        return [o for o in self._walk(prefix) if not os.path.basename(o.path).startswith(".tmp-")]

    def delete_many(self, paths: Iterable[str]) -> None:
        for path in paths:  # unlinks are fast; threads would not help
            self.delete(path)
