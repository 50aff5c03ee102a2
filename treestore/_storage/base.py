"""Objects on an fsspec filesystem: whole-object atomic writes, put-if-absent, ranged reads.

The store never renames. On object stores a PUT is atomic by itself; on a local disk an object is
written to a temporary name in its final folder and then linked (put-if-absent) or replaced into
place, so a reader never sees a half-written object under its final name.

:func:`open_storage` picks the class for a URL: ``LocalStorage`` and ``MemoryStorage`` in
``_local.py``, the object stores (S3, GCS, Azure) and read-only HTTP in ``_backends.py``, and the generic
:class:`Storage` for any other fsspec filesystem. Every class keeps the same contract: ``write``
replaces an object whole; ``write_new`` writes only if absent and returns False when the object
exists; ``read``/``read_range`` return None when it is missing (and a range past the end reads as
short or empty, never as an error); ``list`` gives sizes and mtimes; failures raise StorageError,
after retries with backoff when they look transient."""

from __future__ import annotations

import builtins
import concurrent.futures as cf
import contextlib
import datetime as _dt
import errno
import posixpath
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from treestore.errors import StorageError

if TYPE_CHECKING:
    import fsspec

T = TypeVar("T")


Buffers = Sequence[bytes | memoryview]


_RETRIES = 4  # attempts of one operation (fsspec clients retry inside each attempt too)


_BACKOFF = 0.05  # seconds before the second attempt; x4 per attempt, with jitter


_DELETE_THREADS = 16


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


class Staged:
    """An object :meth:`Storage.stage` wrote under no name yet. :meth:`publish` gives it its name,
    durably; :meth:`discard` drops it (a save that fails). This base class is an object that
    already has its name: both do nothing."""

    def publish(self) -> None:
        """Give the object its name; once this returns, a crash leaves it under that name."""

    def discard(self) -> None:
        """Drop an object never published (idempotent; never raises)."""


PUBLISHED = Staged()


class Storage:
    """The objects under one store root on one fsspec filesystem."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.read_only = False
        self.protocol = self._protocol()

    def _protocol(self) -> str:
        """The filesystem's (first) protocol name."""
        protocol = self.fs.protocol
        return str(protocol[0] if isinstance(protocol, (tuple, list)) else protocol)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def location(self) -> tuple[str, str, str]:
        """Where this store lies, however its URL was spelt: the filesystem's protocol, the
        service it talks to (an object store's endpoint or account; "" where there is one per
        process) and the store's folder without ``.`` and ``..`` segments."""
        return self.protocol, self._service(), posixpath.normpath("/" + self.root.lstrip("/"))

    def _service(self) -> str:
        options = getattr(self.fs, "storage_options", None) or {}
        client = options.get("client_kwargs") or {}
        for found in (options.get("endpoint_url"), client.get("endpoint_url"), options.get("account_name")):
            if found:
                return str(found)
        return ""

    def overlaps(self, other: Storage) -> bool:
        """Whether ``other`` is this store, or lies inside it, or holds it (where that can be
        known: two URLs of one service spelt with different endpoints are not recognised)."""
        (kind, service, here), (other_kind, other_service, there) = self.location(), other.location()
        if (kind, service) != (other_kind, other_service):
            return False
        here, there = here.rstrip("/") + "/", there.rstrip("/") + "/"
        return here.startswith(there) or there.startswith(here)

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
        delay = _BACKOFF
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
                time.sleep(delay * random.uniform(0.5, 1.5))
                delay *= 4
        raise AssertionError("unreachable")

    # -- reads ---------------------------------------------------------------------------------
    def read(self, path: str, *, limit: int | None = None) -> bytes | None:
        """The whole object, or None if it does not exist. More than ``limit`` bytes is an error.

        With a limit, one ranged read of ``limit + 1`` bytes tells both the content and whether
        the object is too big.
        """
        if limit is not None:
            data = self.read_range(path, 0, limit + 1)
            if data is not None and len(data) > limit:
                raise StorageError(f"{self.url}/{path} is over the limit of {limit} bytes")
            return data
        full = self._full(path)
        try:
            found = self._call("reading", path, lambda: self.fs.cat_file(full))
        except FileNotFoundError:
            return None
        return bytes(found)

    def read_range(self, path: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of the object (fewer when it is shorter, ``b""`` when ``start`` is
        at or past its end), or None if it does not exist. ``end`` may exceed the object's size:
        callers bound a read by the most they accept without knowing the size first."""
        if start < 0 or end < start:
            raise ValueError(f"bad byte range [{start}, {end}) of {path}")
        full = self._full(path)

        def get() -> bytes:
            try:
                return bytes(self._cat_range(full, start, end))
            except FileNotFoundError:
                raise
            except Exception as exc:
                # Some backends refuse a range wholly past the end (S3 InvalidRange, Azure and
                # HTTP 416) instead of returning nothing; ask for the size only then.
                if not _past_end(exc):
                    raise
                info = self.fs.info(full)
                if info.get("size") is not None and start >= int(info["size"]):
                    return b""
                raise

        if end == start:
            return b"" if self.exists(path) else None
        try:
            return self._call("reading", path, get)
        except FileNotFoundError:
            return None

    def _cat_range(self, full: str, start: int, end: int) -> bytes:
        data: bytes = self.fs.cat_file(full, start=start, end=end)
        return data

    # Whether :meth:`read_into` reads straight into the caller's buffer (local files); elsewhere
    # it reads a copy first, so callers with bytes of their own to keep use :meth:`read_range`.
    reads_into = False

    def read_into(self, path: str, buf: memoryview) -> int | None:
        """Fill ``buf`` (writable bytes) with the object's first bytes; how many it holds (fewer
        at its end), or None if it does not exist."""
        data = self.read_range(path, 0, len(buf))
        if data is None:
            return None
        buf[: len(data)] = data
        return len(data)

    def object_size(self, path: str) -> int | None:
        """The stored size of an object in bytes, or None if it does not exist."""
        full = self._full(path)
        try:
            info = self._call("inspecting", path, lambda: self.fs.info(full))
        except FileNotFoundError:
            return None
        if info.get("type", "file") != "file":
            return None
        if info.get("size") is None:  # e.g. an HTTP server that sends no Content-Length
            data = self.read(path)
            return None if data is None else len(data)
        return int(info["size"])

    def exists(self, path: str) -> bool:
        full = self._full(path)
        return bool(self._call("inspecting", path, lambda: self.fs.exists(full)))

    # A backend whose ``find`` is one listing that raises every failure (object stores, fsspec's
    # memory filesystem) sets this; the rest are walked folder by folder (see :meth:`list`).
    flat_listing = False

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under the folder ``prefix`` (recursively), with sizes and mtimes.

        A prefix that does not exist lists as empty (so does a subfolder removed while it is
        listed); any other failure raises StorageError naming the folder, never a partial list.
        fsspec's generic ``find`` leaves out a folder it cannot list (its ``walk`` drops errors
        below the top), so unless :attr:`flat_listing` is set this walks with ``ls`` itself.
        """
        if self.flat_listing:
            return self._list_flat(prefix)
        out: list[ObjectInfo] = []
        todo, seen = [prefix.rstrip("/")], set()
        while todo:
            folder = todo.pop()
            seen.add(folder)
            for rel, info in self._entries(folder):
                if info.get("type") == "directory":
                    if rel not in seen:
                        todo.append(rel)
                elif info.get("type", "file") == "file":
                    out.append(ObjectInfo(rel, int(info.get("size") or 0), _mtime(info)))
        return sorted(out, key=lambda o: o.path)

    def _entries(self, folder: str) -> builtins.list[tuple[str, dict[str, Any]]]:
        """The entries ``ls`` gives directly under ``folder`` as (path relative to the root,
        info); none for a missing folder. Entries that do not lie under ``folder`` (the folder
        itself, a link elsewhere) are left out."""
        full = self._full(folder)
        try:
            found = self._call("listing", folder, lambda: self.fs.ls(full, detail=True))
        except FileNotFoundError:
            return []
        inside = folder + "/" if folder else ""
        out = []
        for info in found:
            rel = self._rel(str(info.get("name", "")))
            if rel.startswith(inside) and len(rel) > len(inside):
                out.append((rel, info))
        return out

    def _list_flat(self, prefix: str) -> builtins.list[ObjectInfo]:
        """:meth:`list` by one ``find`` (for backends whose ``find`` reports every failure)."""
        full = self._full(prefix)
        try:
            found = self._call("listing", prefix, lambda: self.fs.find(full, detail=True, withdirs=False))
        except FileNotFoundError:
            return []
        inside = prefix.rstrip("/") + "/" if prefix.rstrip("/") else ""
        out = []
        for name, info in found.items():
            rel = self._rel(name)
            if info.get("type", "file") != "file" or not rel.startswith(inside):
                continue
            out.append(ObjectInfo(rel, int(info.get("size") or 0), _mtime(info)))
        return sorted(out, key=lambda o: o.path)

    # -- writes --------------------------------------------------------------------------------
    def _check_writable(self, path: str) -> None:
        if self.read_only:
            raise StorageError(
                f"cannot write {self.url}/{path}: this store is read-only "
                f"({self.protocol}:// stores can be loaded, opened and diffed, not written)"
            )

    def write(self, path: str, buffers: Buffers) -> None:
        """Write an object whole, replacing any object of that name."""
        self._check_writable(path)
        data = b"".join(buffers)
        full = self._full(path)
        self._call("writing", path, lambda: self._put(full, data))

    stages = False  # whether stage() leaves the waiting (for the disk) to Staged.publish

    def new_folder(self, path: str) -> bool:
        """Make the folder that ``path`` goes in, where the backend has folders, and say whether
        this call made it: then no object was under ``path`` a moment ago, and a writer need not
        ask (only another writer, racing, can have put one there since). Object stores have no
        folders: False."""
        return False

    def stage(self, path: str, buffers: Buffers) -> Staged:
        """Write an object's bytes now and give them the name ``path`` later, with
        :meth:`Staged.publish`: on a local disk the bytes go to a temporary file, and publishing
        (fsync, rename, fsync of the folder) is what waits for the disk, so a save can leave it to
        threads that do nothing else. Where a write is visible at once (object stores), this is
        :meth:`write` and publishing does nothing.
        """
        self.write(path, buffers)
        return PUBLISHED

    def _put(self, full: str, data: bytes) -> None:
        """One whole-object write (backends override it to work around client quirks)."""
        self.fs.pipe_file(full, data)

    def write_new(self, path: str, data: bytes) -> bool:
        """Write an object only if none of that name exists; False if one with other bytes does.

        An object that already holds exactly ``data`` counts as written (True): on object stores
        that is how a retried write whose first answer was lost finds its own object, and every
        backend answers the same way. Generic fsspec filesystems have no conditional write:
        check-then-write is racy there (SPEC.md lists what each backend guarantees).
        """
        self._check_writable(path)
        if self.exists(path):
            return self._holds(path, data)
        self.write(path, [data])
        return True

    def _holds(self, path: str, data: bytes) -> bool:
        """Whether the object ``path`` holds exactly ``data`` (reads at most one byte more)."""
        return self.read_range(path, 0, len(data) + 1) == data

    def temporaries(self, prefix: str) -> builtins.list[ObjectInfo]:
        """Leftovers of writes that never finished (only local disks have them)."""
        return []

    def sync(self) -> None:
        """Make every write so far durable before the next one (a commit) is made."""

    def delete(self, path: str) -> None:
        self._check_writable(path)
        full = self._full(path)
        with contextlib.suppress(FileNotFoundError):
            self._call("deleting", path, lambda: self.fs.rm_file(full))

    def delete_many(self, paths: Iterable[str]) -> None:
        """Delete every path (missing ones are fine), a bounded number at a time."""
        todo = list(paths)
        if todo:
            self._check_writable(todo[0])
        if len(todo) <= 1:
            for path in todo:
                self.delete(path)
            return
        with cf.ThreadPoolExecutor(min(_DELETE_THREADS, len(todo))) as pool:
            list(pool.map(self.delete, todo))


_TRANSIENT_WORDS = (
    "timeout",
    "timed out",
    "connect",  # connection refused/reset/aborted, "cannot connect to host", disconnected
    "temporar",
    "throttl",
    "slowdown",
    "slow down",
    "too many requests",
    "serverbusy",
    "server busy",
    "internalerror",
    "internal error",
    "serviceunavailable",
    "service unavailable",
    "bad gateway",
    "incompleteread",
    "incomplete read",
    "payload",  # aiohttp ClientPayloadError: the body stopped half-way
    "reset",
    "broken pipe",
    "eof occurred",
    "remote end closed",
)


_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


def _status(exc: BaseException) -> int | None:
    """The HTTP status an fsspec client attached to ``exc`` (or its cause), if any."""
    for e in (exc, exc.__cause__):
        if e is None:
            continue
        for attr in ("status", "status_code", "code"):
            value = getattr(e, attr, None)
            if isinstance(value, int) and 100 <= value < 600:
                return value
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # botocore ClientError
            value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(value, int):
                return value
    return None


def _transient(exc: Exception) -> bool:
    """Whether retrying may help: network failures, timeouts, throttling, 5xx answers."""
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    status = _status(exc)
    if status is not None:
        return status in _TRANSIENT_STATUS
    text = f"{type(exc).__name__} {exc}".lower()
    return any(word in text for word in _TRANSIENT_WORDS) or any(
        str(code) in text.split() for code in _TRANSIENT_STATUS
    )


def _past_end(exc: BaseException) -> bool:
    """Whether ``exc`` is a backend refusing a byte range that starts past the object's end."""
    if _status(exc) == 416:
        return True
    if isinstance(exc, OSError) and exc.errno == errno.EINVAL:  # s3fs maps InvalidRange to EINVAL
        return True
    text = f"{type(exc).__name__} {exc}".lower()
    return "not satisfiable" in text or "invalidrange" in text
