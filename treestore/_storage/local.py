"""Stores on this machine: a local folder (written through ``os``) and fsspec's memory filesystem.

A local store is written by temporary file plus ``replace`` (or ``link`` for put-if-absent) in the
destination folder, the file fsynced before it takes its name (so a name never holds a short or
empty file after a crash) and the folder after that (after a ``link``, at the next sync). It is
read only through regular files reached without symlinks, so a hostile store cannot make a load
read, block on or write anything outside it.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import itertools
import os
import stat
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from treestore._format.paths import TEMPORARY_PREFIX, is_temporary, temporary_name
from treestore._storage.base import Buffers, ObjectInfo, Staged, Storage, T
from treestore.errors import StorageError

if TYPE_CHECKING:
    import fsspec


def _is_folder(path: str) -> bool:
    """Whether ``path`` is a folder itself (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


_tmp_names = itertools.count()
_tmp_prefix: tuple[int, str] = (-1, "")


def _tmp_name() -> str:
    """A new temporary file name (``paths.temporary_name``): 64 random bits drawn once per
    process and a counter, rather than a UUID per file (a random draw per file is a system call
    per chunk). Created with O_EXCL, a name that exists already is an error, never another file's bytes."""
    global _tmp_prefix
    pid = os.getpid()
    if _tmp_prefix[0] != pid:  # a forked child draws its own
        _tmp_prefix = (pid, os.urandom(8).hex())
    return temporary_name(f"{_tmp_prefix[1]}{next(_tmp_names):016x}")


class MemoryStorage(Storage):
    """fsspec's in-process memory filesystem: one table of objects shared by every thread.

    One lock serialises every call on that table, so a listing never iterates it while another
    thread adds or removes an object, and put-if-absent is atomic.
    """

    _lock = threading.RLock()  # one table for every instance, so one lock for all of them
    flat_listing = True  # its find reads the objects' table directly: nothing can fail there

    def _call(self, what: str, path: str, fn: Callable[[], T]) -> T:
        def locked() -> T:  # each attempt holds the lock; a retry's backoff does not
            with self._lock:
                return fn()

        return super()._call(what, path, locked)

    def write_new(self, path: str, data: bytes) -> bool:
        self._check_writable(path)
        with self._lock:
            if self.exists(path):
                return self._holds(path, data)
            self.write(path, [data])
            return True


def _fsync(path: str) -> None:
    """fsync the file or folder ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalStaged(Staged):
    """A temporary file waiting for its name. Publishing fsyncs it, renames it and fsyncs its
    folder: the name is durable with no :meth:`LocalStorage.sync`, which would otherwise leave a
    save's folders to its commit, one after another."""

    def __init__(self, storage: LocalStorage, path: str, full: str, tmp: str) -> None:
        self._storage, self._path, self._full, self._tmp = storage, path, full, tmp
        self._named = False

    def publish(self) -> None:
        def put() -> None:
            if not self._named:
                # Durable before it takes the name: after a crash the name holds the old object,
                # none, or the complete new one, never a short or empty file (a chunk's name
                # must only ever hold its bytes).
                _fsync(self._tmp)
                os.replace(self._tmp, self._full)
                self._named = True
            _fsync(os.path.dirname(self._full))

        try:
            self._storage._call("writing", self._path, put)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        if not self._named:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)


class LocalStorage(Storage):
    """A local folder, written through ``os`` for atomic replace and put-if-absent by link."""

    def __init__(self, fs: fsspec.AbstractFileSystem | None, root: str, url: str) -> None:
        self._fs: fsspec.AbstractFileSystem | None = None  # (None: made on first use)
        super().__init__(fs, root, url)
        self._made: set[str] = set()
        self._dirty_dirs: set[str] = set()
        self._dirty_lock = threading.Lock()
        self._inside: set[str] = set()
        self._making: dict[str, threading.Lock] = {}  # a lock per folder, so one thread makes it

    # A store opened by a plain path has no fsspec filesystem until something needs one: its
    # reads, writes and listings go through ``os``, and fsspec takes a tenth of a second to import
    # (most of what `treestore ls` waits for besides numpy).
    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._fs is None:
            import fsspec

            self._fs = fsspec.filesystem("file")
        return self._fs

    @fs.setter
    def fs(self, value: fsspec.AbstractFileSystem | None) -> None:
        self._fs = value

    def _protocol(self) -> str:
        return "file"

    def location(self) -> tuple[str, str, str]:
        """The folder with every link and ``..`` resolved (as far as it exists)."""
        return self.protocol, "", os.path.realpath(self.root or ".")

    # A store never holds links or special files: reads open only regular files reached without
    # symlinks, so a hostile store cannot make a load read (or block on) anything outside it.
    def _check_inside(self, folder: str) -> None:
        """StorageError unless ``folder`` lies in the store without passing a symlink: no folder
        between the store's root and it is a link (one ``lstat`` per folder, once per Storage;
        links above the root are the caller's business). A folder that does not exist (yet) is
        not checked: nothing can be read through it, and a write makes it first."""
        if folder in self._inside:
            return
        root = self.root or "."
        rel = os.path.relpath(folder, root)
        if rel == ".":
            return
        if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
            raise StorageError(f"{folder} leads outside the store {self.url}")
        here = root
        for part in rel.split(os.sep):
            here = os.path.join(here, part)
            if here in self._inside:
                continue
            try:
                mode = os.lstat(here).st_mode
            except FileNotFoundError:
                return
            if stat.S_ISLNK(mode):
                raise StorageError(
                    f"{here} in store {self.url} is a symlink, which may lead outside the store; "
                    "a store holds no links"
                )
            self._inside.add(here)

    def _open_regular(self, full: str) -> int:
        """A read-only descriptor of the regular file ``full``, reached without symlinks (the
        caller closes it); FileNotFoundError if there is none, StorageError for a link or any
        other kind of file."""
        self._check_inside(os.path.dirname(full))
        mode = os.lstat(full).st_mode  # refuse links before opening anything through them
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
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StorageError(f"{full} is not a regular file; a store holds only regular files")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _cat_range(self, full: str, start: int, end: int) -> bytes:
        fd = self._open_regular(full)
        try:
            stop = min(end, os.fstat(fd).st_size)
            return os.pread(fd, max(stop - start, 0), start) if stop > start else b""
        finally:
            os.close(fd)

    reads_into = True

    def read_into(self, path: str, buf: memoryview) -> int | None:
        full = self._full(path)

        def get() -> int:
            fd = self._open_regular(full)
            try:
                done = 0
                while done < len(buf):  # a regular file: short reads only at its end
                    n = os.preadv(fd, [buf[done:]], done)
                    if not n:
                        break
                    done += n
                return done
            finally:
                os.close(fd)

        try:
            return self._call("reading", path, get)
        except FileNotFoundError:
            return None

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
        return [o for o in self._walk(prefix) if is_temporary(os.path.basename(o.path))]

    def _walk(self, prefix: str) -> builtins.list[ObjectInfo]:
        """Regular files under ``prefix``, not following symlinks.

        A missing prefix (or a folder removed while it is walked) lists as empty; a folder that
        cannot be listed (not a folder, no permission, an I/O error) raises StorageError, never
        a partial listing: gc must not take unlisted objects for absent ones.
        """
        top = self._full(prefix)
        if not os.path.lexists(top):
            return []
        self._check_inside(top)

        def failed(exc: OSError) -> None:
            if isinstance(exc, FileNotFoundError):
                return  # removed since it was seen: nothing there to list
            where = self._rel(os.fsdecode(exc.filename)) if exc.filename else prefix
            raise StorageError(
                f"listing {self.url}/{where} failed: {type(exc).__name__}: {exc.strerror or exc}"
            ) from exc

        out = []
        for folder, dirs, files in os.walk(top, onerror=failed, followlinks=False):
            for name in files:
                full = os.path.join(folder, name)
                try:
                    info = os.lstat(full)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    failed(exc)
                    continue
                if stat.S_ISREG(info.st_mode):
                    out.append(ObjectInfo(self._rel(full), info.st_size, info.st_mtime))
            dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        return sorted(out, key=lambda o: o.path)

    def _tmp(self, full: str) -> str:
        """A temporary name in ``full``'s folder, creating the folder if it is missing.

        Folders made once are remembered, but a store folder can be removed, or replaced by a
        link, under a live Store (by hand, or another tool): one ``lstat`` per write checks that
        it is still a folder, and one that is not is made (and checked for containment) again.
        """
        folder = os.path.dirname(full)
        if folder in self._made and not _is_folder(folder):
            self._made.discard(folder)
            self._inside.discard(folder)
        if folder not in self._made:
            with self._dirty_lock:
                making = self._making.setdefault(folder, threading.Lock())
            with making:  # a write into the same new folder waits for this one to make it
                if folder not in self._made:
                    self._folder(folder)
        return os.path.join(folder, _tmp_name())

    def new_folder(self, path: str) -> bool:
        self._check_writable(path)
        folder = os.path.dirname(self._full(path))
        if folder in self._made:
            return False
        return self._call("writing", path, lambda: self._folder(folder))

    def _folder(self, folder: str) -> bool:
        """Make ``folder`` unless it exists, check that it lies in the store (never write through
        a symlinked folder) and remember it; whether this call made it."""
        made = self._make_folder(folder)
        if made:  # a folder mkdir just made is no link: only the folders above it need a look
            self._check_inside(os.path.dirname(folder))
            self._inside.add(folder)
        else:
            self._check_inside(folder)
        self._made.add(folder)
        return made

    def _make_folder(self, folder: str) -> bool:
        """Make ``folder`` and any missing folder above it; whether ``folder`` was missing. A
        folder that exists costs one call (a mkdir that finds it), a missing one whose parent
        exists one too. The parent of each folder made is left for :meth:`sync`: fsyncing a
        folder makes the names in it durable, not its own name in its parent, and a commit must
        not name chunks in a folder a crash can lose."""
        try:
            os.mkdir(folder)
        except FileExistsError:
            return False
        except FileNotFoundError:
            parent = os.path.dirname(folder)
            if not parent or parent == folder:
                raise
            self._make_folder(parent)
            try:
                os.mkdir(folder)
            except FileExistsError:
                return False
        with self._dirty_lock:
            self._dirty_dirs.add(os.path.dirname(folder) or ".")
        return True

    def _write_tmp(self, full: str, buffers: Buffers) -> str:
        """The bytes of ``buffers`` in a new temporary file in ``full``'s folder (removed again
        if writing them fails)."""
        tmp = self._tmp(full)
        try:
            with open(tmp, "xb") as f:
                for buf in buffers:
                    f.write(buf)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp

    def _durable(self, full: str, tmp: str) -> None:
        """fsync ``tmp`` now (it is about to be linked into place); remember the folder for
        :meth:`sync`."""
        _fsync(tmp)
        with self._dirty_lock:
            self._dirty_dirs.add(os.path.dirname(full))

    def sync(self) -> None:
        """fsync the folders of every object linked by :meth:`write_new` since the last sync
        (each was fsynced before it took its name), so that their names are durable too, and
        the parents of the folders made since; :meth:`write` makes its folder durable itself."""
        with self._dirty_lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        for d in sorted(dirs):
            with contextlib.suppress(FileNotFoundError):  # removed since: nothing to make durable
                _fsync(d)

    def write(self, path: str, buffers: Buffers) -> None:
        self.stage(path, buffers).publish()

    stages = True

    def stage(self, path: str, buffers: Buffers) -> Staged:
        self._check_writable(path)
        full = self._full(path)
        tmp = self._call("writing", path, lambda: self._write_tmp(full, buffers))
        return _LocalStaged(self, path, full, tmp)

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
        return [o for o in self._walk(prefix) if not os.path.basename(o.path).startswith(TEMPORARY_PREFIX)]

    def delete_many(self, paths: Iterable[str]) -> None:
        for path in paths:  # unlinks are fast; threads would not help
            self.delete(path)
