"""Objects on an fsspec filesystem: whole-object atomic writes, put-if-absent, ranged reads.

The store never renames. On object stores a PUT is atomic by itself; on a local disk an object is
written to a temporary name in its final folder and then linked (put-if-absent) or replaced into
place, so a reader never sees a half-written object under its final name.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import datetime as _dt
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec

from ._errors import InvalidInputError, StorageError

T = TypeVar("T")
Buffers = Sequence[bytes | memoryview]

# Extras that provide each protocol, for a clear error when one is missing.
_EXTRAS = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
    "http": "http",
    "https": "http",
}
_RETRIES = 4


@dataclass(frozen=True)
class ObjectInfo:
    path: str  # relative to the store root
    size: int
    mtime: float | None  # seconds since the epoch, when the backend reports it


def _epoch(value: object) -> float | None:
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, _dt.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=_dt.timezone.utc)
        return value.timestamp()
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return _epoch(_dt.datetime.fromisoformat(value.replace("Z", "+00:00")))
    return None


def _mtime(info: dict[str, Any]) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        if key in info:
            found = _epoch(info[key])
            if found is not None:
                return found
    return None


class Storage:
    """The objects under one store root on one fsspec filesystem."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.read_only = False

    # -- paths ---------------------------------------------------------------------------------
    def _full(self, path: str) -> str:
        return f"{self.root}/{path}" if self.root else path

    def _rel(self, full: str) -> str:
        full = full.rstrip("/")
        prefix = self.root + "/" if self.root else ""
        return full[len(prefix) :] if full.startswith(prefix) else full

    # -- error handling ------------------------------------------------------------------------
    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient failures with backoff; FileNotFoundError passes through."""
        delay = 0.05
        for attempt in range(_RETRIES):
            try:
                return fn()
            except FileNotFoundError:
                raise
            except (FileExistsError, StorageError):
                raise
            except Exception as exc:  # fsspec backends raise many unrelated types
                if attempt == _RETRIES - 1 or not _transient(exc):
                    raise StorageError(
                        f"{what} {self.url}/{path} failed: {type(exc).__name__}: {exc}"
                    ) from exc
                time.sleep(delay)
                delay *= 4
        raise AssertionError("unreachable")

    # -- reads ---------------------------------------------------------------------------------
    def read(self, path: str, *, limit: int | None = None) -> bytes | None:
        """The whole object, or None if it does not exist. More than ``limit`` bytes is an error."""
        full = self._full(path)
        if limit is not None:
            size = self.size(path)
            if size is None:
                return None
            if size > limit:
                raise StorageError(f"{self.url}/{path} is {size} bytes, over the limit of {limit}")
        try:
            data = self._call("reading", path, lambda: self.fs.cat_file(full))
        except FileNotFoundError:
            return None
        return bytes(data)

    def read_range(self, path: str, start: int, end: int) -> bytes | None:
        full = self._full(path)
        try:
            data = self._call("reading", path, lambda: self.fs.cat_file(full, start=start, end=end))
        except FileNotFoundError:
            return None
        return bytes(data)

    def size(self, path: str) -> int | None:
        full = self._full(path)
        try:
            info = self._call("inspecting", path, lambda: self.fs.info(full))
        except FileNotFoundError:
            return None
        return int(info["size"])

    def exists(self, path: str) -> bool:
        full = self._full(path)
        return bool(self._call("inspecting", path, lambda: self.fs.exists(full)))

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under the folder ``prefix`` (recursively), with sizes and mtimes."""
        full = self._full(prefix)
        try:
            found = self._call("listing", prefix, lambda: self.fs.find(full, detail=True, withdirs=False))
        except FileNotFoundError:
            return []
        out = []
        for name, info in found.items():
            if info.get("type", "file") != "file":
                continue
            out.append(ObjectInfo(self._rel(name), int(info.get("size") or 0), _mtime(info)))
        return sorted(out, key=lambda o: o.path)

    # -- writes --------------------------------------------------------------------------------
    def _check_writable(self, path: str) -> None:
        if self.read_only:
            raise StorageError(f"cannot write {self.url}/{path}: this store is read-only")

    def write(self, path: str, buffers: Buffers) -> None:
        """Write an object whole, replacing any object of that name."""
        self._check_writable(path)
        data = b"".join(buffers)
        full = self._full(path)
        self._call("writing", path, lambda: self.fs.pipe_file(full, data))

    def write_new(self, path: str, data: bytes) -> bool:
        """Write an object only if none of that name exists; False if one does.

        Generic fsspec filesystems have no conditional write: check-then-write is racy there
        (SPEC.md lists what each backend guarantees).
        """
        self._check_writable(path)
        if self.exists(path):
            return False
        self.write(path, [data])
        return True

    def sync(self) -> None:
        """Make every write so far durable before the next one (a commit) is made."""

    def delete(self, path: str) -> None:
        self._check_writable(path)
        full = self._full(path)
        with contextlib.suppress(FileNotFoundError):
            self._call("deleting", path, lambda: self.fs.rm_file(full))

    def delete_many(self, paths: Iterable[str]) -> None:
        for path in paths:
            self.delete(path)


class MemoryStorage(Storage):
    """fsspec's in-process memory filesystem; a lock makes put-if-absent atomic."""

    _lock = threading.Lock()

    def write_new(self, path: str, data: bytes) -> bool:
        self._check_writable(path)
        with self._lock:
            if self.exists(path):
                return False
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

    def _tmp(self, full: str) -> str:
        folder = os.path.dirname(full)
        if folder not in self._made:
            os.makedirs(folder, exist_ok=True)
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

        return self._call("writing", path, put)

    def list(self, prefix: str) -> list[ObjectInfo]:
        # Temporary files of writes in flight are not objects.
        return [o for o in super().list(prefix) if not os.path.basename(o.path).startswith(".tmp-")]


def _transient(exc: Exception) -> bool:
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError, ValueError)):
        return False
    text = f"{type(exc).__name__} {exc}".lower()
    return any(
        word in text
        for word in (
            "timeout",
            "timed out",
            "connection",
            "temporar",
            "throttl",
            "slowdown",
            "503",
            "500",
            "reset",
            "broken pipe",
        )
    )


def open_storage(url: str, storage_options: dict[str, Any] | None = None) -> Storage:
    """The :class:`Storage` for a store URL (any fsspec URL or a local path)."""
    if not isinstance(url, (str, os.PathLike)):
        raise InvalidInputError(f"a store URL is a str or path, got {type(url).__name__}")
    url = os.fspath(url)
    if not url:
        raise InvalidInputError("a store URL cannot be empty")
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        extra = _EXTRAS.get(protocol)
        hint = f"; install it with: pip install 'treestore[{extra}]'" if extra else ""
        raise InvalidInputError(f"no filesystem for {url!r}: {exc}{hint}") from None
    except ValueError as exc:
        raise InvalidInputError(f"not a usable store URL {url!r}: {exc}") from None
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if "file" in protocols or "local" in protocols:
        return LocalStorage(fs, root, url.rstrip("/"))
    if "memory" in protocols:
        return MemoryStorage(fs, root, url.rstrip("/"))
    storage = Storage(fs, root, url.rstrip("/"))
    storage.read_only = bool(set(protocols) & {"http", "https"})
    return storage
