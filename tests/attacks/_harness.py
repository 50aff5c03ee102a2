"""The guards every hostile-store case runs under, and the reader operations it runs.

:func:`check_readers` runs every reader operation (list, manifest, load, load of the newest, a lazy
open that reads every leaf and slices, diff with values against a good checkpoint, verify) on a
store, each under these guards:

- only TreestoreError subclasses may escape, and a corruption or unsupported-format error names
  the checkpoint it is about;
- an audit hook (``sys.addaudithook``) records every file the process opens, lists, removes,
  renames or creates, following symlinks: all of it must lie inside the store (and readers must
  not modify anything); the hook also records any import of a module not loaded before, any
  ``exec``/``compile``, any unpickling (``pickle.find_class``), subprocess, socket or ctypes use;
  ``pickle.load(s)`` and ``pickle.Unpickler`` are replaced by stubs that fail;
- tracemalloc bounds the peak of Python and numpy allocations;
- the test's ``@pytest.mark.timeout`` bounds the time.

The audit hook blocks (with PermissionError) what it reports outside the store, so a failing case
damages nothing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import pickle
import pkgutil
import sys
import threading
import traceback
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import treestore
import treestore.types

# The API is imported on first use (PEP 562): load all of it now, so that the guard below, which
# refuses any import of a module not loaded before, sees only what a store makes a reader do.
for _name in treestore.__all__:
    getattr(treestore, _name)

MiB = 2**20
DEFAULT_MEMORY = 64 * MiB

_FORBIDDEN = frozenset(
    {
        "import",
        "exec",
        "compile",
        "pickle.find_class",
        "marshal.loads",
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "pty.spawn",
        "socket.connect",
        "socket.bind",
        "socket.getaddrinfo",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "urllib.Request",
        "webbrowser.open",
    }
)
# events whose first argument is a path the operation changes (the entry itself, not a link target)
_MODIFY = frozenset(
    {
        "os.remove",
        "os.rmdir",
        "os.mkdir",
        "os.truncate",
        "os.chmod",
        "os.chown",
        "os.utime",
        "os.chflags",
        "os.setxattr",
        "os.removexattr",
        "shutil.rmtree",
        "shutil.chown",
    }
)
_TWO_PATHS = frozenset({"os.rename", "os.link", "os.symlink", "shutil.move", "shutil.copyfile"})
_LIST = frozenset({"os.listdir", "os.scandir", "glob.glob", "os.walk"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass
class Guard:
    """What the audit hook checks while armed: the folders the process may touch."""

    roots: tuple[str, ...]
    may_modify: bool
    modules: frozenset[str] = field(default_factory=lambda: frozenset(sys.modules))
    violations: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def inside(self, path: Any, *, entry: bool = False) -> bool:
        """Whether ``path`` (following symlinks; with ``entry`` all but the last part) lies in a
        root."""
        if isinstance(path, int):  # an open file descriptor
            return True
        text = os.fsdecode(path)
        if entry:
            real = os.path.join(os.path.realpath(os.path.dirname(text) or "."), os.path.basename(text))
        else:
            real = os.path.realpath(text)
        return any(real == r or real.startswith(r + os.sep) for r in self.roots)

    def report(self, what: str) -> None:
        with self._lock:
            self.violations.append(what)
        raise PermissionError(f"blocked by the hostile-store guard: {what}")

    def event(self, name: str, args: tuple[Any, ...]) -> None:
        if name in _FORBIDDEN:
            if name == "import" and args and args[0] in self.modules:
                return
            self.report(f"{name} {str(args[0] if args else '')[:120]}")
        elif name == "open":
            path, mode, flags = [*args, None, None][:3]
            if path is None or isinstance(path, int):
                return
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            if not writes and _source_file(path):
                return  # linecache reading Python source for a traceback (jax does, when raising)
            if not self.inside(path):
                self.report(f"open {path!r} (mode {mode!r}) reaches {os.path.realpath(path)!r}")
            elif writes and not self.may_modify:
                self.report(f"a reader opened {path!r} for writing (mode {mode!r}, flags {flags!r})")
        elif name in _LIST:
            if args and args[0] is not None and not self.inside(args[0]):
                self.report(f"{name} {args[0]!r} reaches {os.path.realpath(args[0])!r}")
        elif name in _MODIFY or name in _TWO_PATHS:
            paths = args[:2] if name in _TWO_PATHS else args[:1]
            for p in paths:
                if p is None or isinstance(p, int):
                    continue
                if not self.may_modify:
                    self.report(f"a reader called {name} on {p!r}")
                elif not self.inside(p, entry=True):
                    self.report(f"{name} {p!r} reaches outside the store")


_SOURCE_ROOTS = tuple(
    os.path.realpath(p) + os.sep for p in {*sys.path, sys.prefix, sys.base_prefix} if p and os.path.isdir(p)
)


def _source_file(path: Any) -> bool:
    text = os.fsdecode(path)
    return text.endswith(".py") and os.path.realpath(text).startswith(_SOURCE_ROOTS)


_armed: Guard | None = None
_installed = False
_install_lock = threading.Lock()


def _hook(name: str, args: tuple[Any, ...]) -> None:
    guard = _armed
    if guard is not None:
        guard.event(name, args)


def _install() -> None:
    global _installed
    with _install_lock:
        if not _installed:
            sys.addaudithook(_hook)
            _installed = True


def _no_unpickling(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("treestore unpickled something")


@functools.cache
def _load_treestore() -> None:
    """Import every module of treestore: the guard watches what a store makes the code do, and
    the code imports some of its own modules on first use (a ``Store`` method its engine)."""
    for found in pkgutil.walk_packages(treestore.__path__, "treestore."):
        if not found.name.endswith(".__main__"):  # that one runs the command line
            importlib.import_module(found.name)


@contextlib.contextmanager
def guarded(roots: list[str] | tuple[str, ...], *, may_modify: bool = False) -> Iterator[Guard]:
    """Arm the audit hook for the block; afterwards the guard holds what it found (treestore's
    own modules are imported before: any other import in the block is a violation)."""
    global _armed
    _install()
    _load_treestore()
    guard = Guard(tuple(os.path.realpath(os.fspath(r)) for r in roots), may_modify)
    saved = pickle.loads, pickle.load, pickle.Unpickler
    pickle.loads = pickle.load = pickle.Unpickler = _no_unpickling  # type: ignore[assignment,misc]
    _armed = guard
    try:
        yield guard
    finally:
        _armed = None
        pickle.loads, pickle.load, pickle.Unpickler = saved  # type: ignore[misc]


@contextlib.contextmanager
def memory_peak(enabled: bool = True) -> Iterator[list[int]]:
    """The peak of traced (Python and numpy) allocations in the block, in bytes: ``box[0]``."""
    box = [0]
    if not enabled:
        yield box
        return
    was = tracemalloc.is_tracing()
    if not was:
        tracemalloc.start(1)
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield box
    finally:
        box[0] = tracemalloc.get_traced_memory()[1] - base
        if not was:
            tracemalloc.stop()


# --- reader operations -------------------------------------------------------------------------------
def _read_lazily(ckpt: treestore.Checkpoint) -> None:
    _ = ckpt.tree
    for leaf in ckpt.leaves.values():
        if isinstance(leaf, treestore.LazyLeaf):
            np.asarray(leaf)
            leaf.read()
            if leaf.ndim and leaf.shape[0]:
                leaf[0]
                leaf[-1:]
                leaf[::2]


def reader_ops(url: str, name: str, good: str | None = "good") -> dict[str, Callable[[], Any]]:
    store = treestore.Store(url)
    ops: dict[str, Callable[[], Any]] = {
        "list": store.list,
        "latest": store.latest,
        "manifest": lambda: store.manifest(name),
        "load": lambda: store.load(name),
        "load newest": lambda: treestore.load(url),
        "load select": lambda: store.load(name, select="**"),
        "open": lambda: _read_lazily(store.open(name)),
        "verify": lambda: _check_report(treestore.verify(f"{url}#{name}"), name),
        "verify all": lambda: _check_report(treestore.verify(url), None),
    }
    if good is not None:
        ops["diff"] = lambda: treestore.diff(f"{url}#{good}", f"{url}#{name}", values=True).to_json()
    return ops


def _check_report(report: Any, name: str | None) -> Any:
    for p in report.problems:
        assert p.message, f"verify reported a problem without a message: {p}"
        assert p.checkpoint is None or name is None or p.checkpoint == name, p
    return report


@dataclass
class Outcome:
    """The result of one reader operation: its value, or the TreestoreError it raised."""

    op: str
    value: Any = None
    error: treestore.TreestoreError | None = None


def _clear(exc: treestore.TreestoreError) -> str | None:
    """Why ``exc`` is not a clear error, or None."""
    if not str(exc).strip():
        return "has an empty message"
    if isinstance(exc, (treestore.DamagedError, treestore.UnsupportedFormatError)) and (
        exc.checkpoint is None or repr(exc.checkpoint) not in str(exc)
    ):
        return f"does not name its checkpoint (checkpoint={exc.checkpoint!r})"
    return None


def check_readers(
    url: str,
    name: str = "bad",
    *,
    root: str | os.PathLike[str] | None = None,
    good: str | None = "good",
    ops: list[str] | None = None,
    memory: int | None = DEFAULT_MEMORY,
) -> dict[str, Outcome]:
    """Run the reader operations on a hostile store; AssertionError listing every breach.

    ``root`` is the store's folder for the audit (default: ``url`` when it is a local path);
    ``memory`` bounds the peak of traced allocations (None: not traced, which is much faster).
    """
    if root is None and "://" not in url:
        root = url
    roots = [os.fspath(root)] if root is not None else []  # a memory store opens no file at all
    problems: list[str] = []
    outcomes: dict[str, Outcome] = {}
    for op, fn in reader_ops(url, name, good).items():
        if ops is not None and op not in ops:
            continue
        escaped: Exception | None = None
        with guarded(roots) as guard, memory_peak(memory is not None) as peak:
            try:
                outcomes[op] = Outcome(op, value=fn())
            except treestore.TreestoreError as exc:
                outcomes[op] = Outcome(op, error=exc)
            except Exception as exc:
                escaped = exc
        # (formatting reads source files and compiles: only once the guard is off)
        error = outcomes[op].error if op in outcomes else None
        if error is not None and _clear(error):
            problems.append(f"{op}: {type(error).__name__} {_clear(error)}: {error}")
        if escaped is not None:
            where = " <- ".join(
                f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                for f in reversed(traceback.extract_tb(escaped.__traceback__)[-4:])
            )
            problems.append(f"{op}: {type(escaped).__name__} escaped: {str(escaped)[:300]} (at {where})")
        problems += [f"{op}: {v}" for v in dict.fromkeys(guard.violations)]
        if memory is not None and peak[0] > memory:
            problems.append(f"{op}: allocated {peak[0] / MiB:.0f} MiB at the peak (bound {memory / MiB:.0f})")
    assert not problems, "the hostile store broke a guarantee:\n" + "\n".join(problems)
    return outcomes


def errors(outcomes: dict[str, Outcome]) -> dict[str, str]:
    """op -> the name of the error class it raised (ops that succeeded are left out)."""
    return {op: type(o.error).__name__ for op, o in outcomes.items() if o.error is not None}
