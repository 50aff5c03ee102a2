"""Lock records and how gc keeps its own lock (SPEC.md section 9): at the engine's level, and
through the public API against saves and gcs racing, locks that cannot be removed and gc locks
whose pid now belongs to another process."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import treestore
from tests.support.faults import (
    FaultyMemoryFileSystem,
    chunked_tree,
    fs_root,
    outcome,
)
from tests.support.helpers import assert_tree_equal
from treestore._engine import gc as _gc
from treestore._engine import locks as _locks
from treestore._format import paths as _paths


def _store() -> treestore.Store:
    store = treestore.Store(f"memory://treestore-locks/{uuid.uuid4().hex}")
    store.save({"x": np.zeros(3)}, "init")
    return store


def test_gc_rewrites_its_lock_during_a_long_run(monkeypatch: pytest.MonkeyPatch):
    """Saves judge a gc lock by the default stale limit, so a gc running longer than that must
    rewrite its lock as a save does (here the limit is shrunk so every check finds it due)."""
    store = _store()
    for i in range(3):
        store.save({"x": np.full(3, float(i))}, f"c{i}")
    writes: list[str] = []
    real = store._storage.write

    def write(path: str, buffers: Any) -> None:
        writes.append(path)
        real(path, buffers)

    monkeypatch.setattr(store._storage, "write", write)
    monkeypatch.setattr(_gc, "STALE_AFTER", 0.0, raising=False)
    store.gc(grace=0)
    gc_writes = [p for p in writes if p.startswith(f"{_paths.LOCKS}/gc-")]
    assert len(set(gc_writes)) == 1 and len(gc_writes) > 1, f"gc never rewrote its lock: {gc_writes}"


def test_a_lock_record_names_its_process_identity():
    store = _store()
    with _locks.Lock(store._storage, "save") as lock:
        record = msgpack.unpackb(store._storage.read(lock.path), raw=False)
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    if os.path.exists("/proc/self/stat"):
        boot, _, ticks = record["start"].partition(":")
        assert boot == Path("/proc/sys/kernel/random/boot_id").read_text().strip() and ticks.isdigit()


def _lock(store: treestore.Store, record: Any, raw: bytes | None = None) -> str:
    path = _paths.lock_path("gc", uuid.uuid4().hex)
    store._storage.write(path, [raw if raw is not None else msgpack.packb(record)])
    return path


def test_lock_ages():
    store = _store()
    s = store._storage
    now = time.time()
    mine = {"kind": "gc", "created": now, "host": socket.gethostname(), "pid": os.getpid()}
    assert _locks.lock_time(s, _lock(store, mine), None) == now  # a live process of this host
    other = {**mine, "start": "another-boot:1"}
    assert _locks.lock_time(s, _lock(store, other), None) == 0.0  # this pid, another process
    for bad in ({**mine, "created": float("inf")}, {**mine, "created": float("nan")}):
        assert _locks.lock_time(s, _lock(store, bad), 123.0) == 123.0  # ages by its mtime
    assert _locks.lock_time(s, _lock(store, None, raw=b"\x00" * 5000), 456.0) == 456.0
    assert _locks.lock_time(s, _paths.lock_path("gc", "0" * 32), 789.0) == 0.0  # removed since listed


# --- 12.6: gc with grace=0 must not delete the temporary file of a save's lock ---------------------
_armed_rename: Callable[[str, str], None] | None = None
_hook_installed = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    hold = _armed_rename
    if hold is None or event != "os.rename":
        return
    try:
        src, dst = os.fsdecode(args[0]), os.fsdecode(args[1])
    except Exception:  # an fd or something odd: not ours
        return
    hold(src, dst)


@contextlib.contextmanager
def holding_renames(hold: Callable[[str, str], None]) -> Iterator[None]:
    """Call ``hold(src, dst)`` before every ``os.rename``/``os.replace`` of the process in the
    block (from the thread doing it, through an audit hook installed once and disarmed after)."""
    global _armed_rename, _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit)
        _hook_installed = True
    _armed_rename = hold
    try:
        yield
    finally:
        _armed_rename = None


@pytest.mark.timeout(60)
def test_saves_survive_gc_with_no_grace_in_a_tight_loop(tmp_path: Path):
    """A thread runs ``Store(url).gc(grace=0)`` in a bounded tight loop while 50 small saves run.

    The race is narrow: the lock's temporary file exists only between its write and the
    ``replace`` that puts it in place. To make it show on every run, an audit hook holds the
    saving thread (once per save) just before that ``replace`` until the gc thread has completed
    two more rounds, as a busy machine may deschedule a process at exactly that point.
    Every save must then succeed or raise a TreestoreError, and every committed one loads.
    """
    url = str(tmp_path / "store")
    treestore.save(url, {"x": np.zeros(3)}, "init")
    locks = os.path.realpath(os.path.join(url, "locks"))
    main = threading.get_ident()
    rounds = [0]
    cond = threading.Condition()
    stop = threading.Event()
    gc_errors: list[BaseException] = []

    def gc_loop() -> None:
        try:
            deadline = time.monotonic() + 30
            for _ in range(200_000):
                if stop.is_set() or time.monotonic() > deadline:
                    return
                try:
                    treestore.Store(url).gc(grace=0)
                except treestore.errors.StoreBusyError:
                    pass
                except Exception as exc:  # asserted below
                    gc_errors.append(exc)
                with cond:
                    rounds[0] += 1
                    cond.notify_all()
        finally:
            stop.set()
            with cond:
                cond.notify_all()

    pending = [False]

    def hold(src: str, dst: str) -> None:
        if threading.get_ident() != main or not pending[0]:
            return
        if os.path.dirname(os.path.realpath(dst)) != locks or not os.path.basename(dst).startswith("save-"):
            return
        pending[0] = False
        with cond:
            target = rounds[0] + 2
            cond.wait_for(lambda: rounds[0] >= target or stop.is_set(), timeout=2)

    gc_thread = threading.Thread(target=gc_loop, daemon=True)
    results: dict[str, BaseException | None] = {}
    trees = {f"s{i:02d}": {"x": np.full(3, float(i)), "i": i} for i in range(50)}
    with holding_renames(hold):
        gc_thread.start()
        try:
            for name, t in trees.items():
                pending[0] = True
                results[name] = outcome(lambda name=name, t=t: treestore.save(url, t, name))
        finally:
            stop.set()
            gc_thread.join(10)
    bare = {
        n: e
        for n, e in results.items()
        if e is not None and not isinstance(e, treestore.errors.TreestoreError)
    }
    assert not bare, f"{len(bare)} of {len(results)} saves raised a non-TreestoreError, first: " + repr(
        next(iter(bare.values()), None)
    )
    assert not [e for e in gc_errors if not isinstance(e, treestore.errors.TreestoreError)], gc_errors[:3]
    for name, exc in results.items():
        if exc is None:
            assert_tree_equal(treestore.load(url, name), trees[name])


def test_gc_keeps_a_fresh_temporary_file_under_locks_until_it_is_an_hour_old(tmp_path: Path):
    """A temporary file under locks/ may be a lock being written (no lock protects that write):
    gc(grace=0) leaves it, and removes it once it is older than the stale limit (3600 s)."""
    url = str(tmp_path / "store")
    treestore.save(url, {"x": np.zeros(3)}, "init")
    fresh = Path(url) / "locks" / f".tmp-{uuid.uuid4().hex}"
    old = Path(url) / "locks" / f".tmp-{uuid.uuid4().hex}"
    for p in (fresh, old):
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(msgpack.packb({"kind": "save"}))
    past = time.time() - 3601
    os.utime(old, (past, past))
    treestore.Store(url).gc(grace=0)
    assert fresh.exists(), "gc(grace=0) deleted the temporary file of a lock being written"
    assert not old.exists(), "gc keeps a killed writer's temporary file under locks/ forever"


# --- 12.7: a save whose lock cannot be removed after the commit has still succeeded ---------------
def test_a_committed_save_succeeds_when_its_lock_cannot_be_removed(faultmem: str, caplog):
    data = chunked_tree(21)
    root = fs_root(faultmem)[1]
    FaultyMemoryFileSystem.undeletable = (f"{root}/locks/",)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        result = outcome(lambda: treestore.save(faultmem, data, "a"))
    FaultyMemoryFileSystem.undeletable = ()
    assert_tree_equal(treestore.load(faultmem, "a"), data)  # it was committed
    assert result is None, f"save raised although checkpoint 'a' is committed: {result!r}"
    said = [r.getMessage() for r in caplog.records] + [str(w.message) for w in caught]
    assert any("locks/save-" in s for s in said), f"the lock left behind was not reported: {said}"


def test_a_lock_left_behind_does_not_hold_back_its_own_process(faultmem: str, caplog):
    """The save is over: its own process (a manager's retention gc) need not wait for its lock."""
    root = fs_root(faultmem)[1]
    FaultyMemoryFileSystem.undeletable = (f"{root}/locks/save-",)
    with caplog.at_level(logging.WARNING, logger="treestore"):
        treestore.save(faultmem, chunked_tree(22), "a")
    FaultyMemoryFileSystem.undeletable = ()
    failure = outcome(lambda: treestore.Store(faultmem).gc(grace=0))
    assert failure is None, f"gc waited for the lock this process left behind: {failure!r}"


# --- 12.8: a gc lock whose pid now belongs to another process ------------------------------------
@pytest.mark.timeout(60)
def test_a_gc_lock_whose_pid_was_reused_does_not_block_saves(tmp_path: Path):
    """A gc killed 10 s ago left ``locks/gc-<id>``; its pid now belongs to an unrelated live
    process (a ``sleep``) on this host. A save must not wait for it.

    Assumption: the lock is written as this version writes it, ``{kind, created, host, pid}``
    with no process-identity field. The fix is expected to tell that the pid was reused: the
    process now holding it started after the lock's ``created`` (it cannot have written it), or
    the record lacks the identity (e.g. the start time) a fixed version writes. Either way this
    lock counts as dead, and the save finishes within seconds instead of waiting 600 s.
    """
    url = str(tmp_path / "store")
    treestore.save(url, {"x": np.zeros(3)}, "init")
    sleeper = subprocess.Popen(["sleep", "60"])
    lock = Path(url) / "locks" / f"gc-{uuid.uuid4().hex}"
    try:
        record = {"kind": "gc", "created": time.time() - 10, "host": socket.gethostname(), "pid": sleeper.pid}
        lock.write_bytes(msgpack.packb(record))
        data = chunked_tree(31)
        done: list[BaseException | None] = []
        saver = threading.Thread(
            target=lambda: done.append(outcome(lambda: treestore.save(url, data, "after"))), daemon=True
        )
        started = time.monotonic()
        saver.start()
        saver.join(4)
        waited = time.monotonic() - started
        blocked = saver.is_alive()
    finally:
        lock.unlink(missing_ok=True)  # lets a blocked save go on
        sleeper.kill()
        sleeper.wait()
    saver.join(10)
    assert not blocked, f"the save was still waiting for the dead gc's lock after {waited:.1f} s"
    assert done == [None], done
    assert_tree_equal(treestore.load(url, "after"), data)


def _save_in_time(url: str, data: Any, name: str, seconds: float = 4.0) -> tuple[bool, list[Any]]:
    """Run a save in a thread; (whether it was still running after ``seconds``, its outcome)."""
    done: list[BaseException | None] = []
    saver = threading.Thread(target=lambda: done.append(outcome(lambda: treestore.save(url, data, name))))
    saver.daemon = True
    saver.start()
    saver.join(seconds)
    return saver.is_alive(), done


def _proc_identity(pid: int) -> str:
    """A process's identity as SPEC section 9 defines it: boot id, ':', start time in ticks."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return f"{boot}:{int(stat[stat.rindex(b')') + 2 :].split()[19])}"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.timeout(60)
def test_a_gc_lock_tells_a_reused_pid_by_the_process_identity(tmp_path: Path):
    """A lock record carries its process's identity (``start``): a lock naming a live pid with
    another identity is dead; one naming a live process by its true identity holds saves."""
    url = str(tmp_path / "store")
    treestore.save(url, {"x": np.zeros(3)}, "init")
    sleeper = subprocess.Popen(["sleep", "60"])
    lock = Path(url) / "locks" / f"gc-{uuid.uuid4().hex}"
    try:
        base = {"kind": "gc", "created": time.time(), "host": socket.gethostname(), "pid": sleeper.pid}
        lock.write_bytes(msgpack.packb({**base, "start": "another-boot:1"}))
        blocked, done = _save_in_time(url, chunked_tree(32), "reused")
        assert not blocked and done == [None], "a lock of another process under a reused pid held the save"
        lock.write_bytes(msgpack.packb({**base, "start": _proc_identity(sleeper.pid)}))
        live = threading.Thread(target=lambda: outcome(lambda: treestore.save(url, chunked_tree(33), "live")))
        live.daemon = True
        live.start()
        live.join(2)
        assert live.is_alive(), "a live gc's lock did not hold the save"
    finally:
        lock.unlink(missing_ok=True)
        sleeper.kill()
        sleeper.wait()
    live.join(10)
    assert_tree_equal(treestore.load(url, "live"), chunked_tree(33))


@pytest.mark.timeout(60)
def test_an_oversized_lock_ages_by_its_mtime(tmp_path: Path):
    """A lock object over 4096 bytes is not read: it ages by its mtime like a lock that does not
    decode, so an old one neither fails nor holds saves, and gc removes it."""
    url = str(tmp_path / "store")
    treestore.save(url, {"x": np.zeros(3)}, "init")
    lock = Path(url) / "locks" / f"gc-{uuid.uuid4().hex}"
    lock.write_bytes(b"\x00" * 5000)
    past = time.time() - 2 * 3600
    os.utime(lock, (past, past))
    blocked, done = _save_in_time(url, chunked_tree(34), "after")
    assert not blocked and done == [None], done
    assert treestore.Store(url).gc(grace=0).locks_removed == 1
    assert not lock.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["gc-README", f"sub/gc-{'0' * 32}", f"gc-{'0' * 32}.bak"])
def test_only_objects_named_like_locks_count_as_locks(tmp_path: Path, name: str):
    """Saves count as gc locks exactly the objects gc would delete as locks,
    ``locks/(save|gc)-<32 hex>``: a stray object merely starting with ``gc-`` holds nothing."""
    url = str(tmp_path / "store")
    treestore.save(url, {"x": np.zeros(3)}, "init")
    stray = Path(url) / "locks" / name
    stray.parent.mkdir(parents=True, exist_ok=True)
    record = {"kind": "gc", "created": time.time(), "host": "another-host.invalid", "pid": 1}
    stray.write_bytes(msgpack.packb(record))
    try:
        blocked, done = _save_in_time(url, chunked_tree(35), "after")
    finally:
        stray.unlink()  # lets a blocked save go on
    assert not blocked and done == [None], f"the stray object locks/{name} held the save"


def _between_announcing_and_looking(
    monkeypatch: pytest.MonkeyPatch, kind: str, other: Callable[[], Any]
) -> list[Any]:
    """Run ``other`` the first time a ``kind`` lock looks for the other kind's locks, at the
    moment a racing process could act: after its own lock is announced, if the order is kept."""
    seen: list[Any] = []
    looking_for = "gc" if kind == "save" else "save"
    real = _locks.live_locks

    def live_locks(storage, which, stale_after):  # type: ignore[no-untyped-def]
        found = real(storage, which, stale_after)
        if which == looking_for and not seen:
            try:
                seen.append(other())
            except treestore.errors.StoreBusyError as exc:
                seen.append(exc)
        return found

    monkeypatch.setattr(_locks, "live_locks", live_locks)
    return seen


def test_a_save_announces_itself_before_it_looks_for_a_gc(monkeypatch: pytest.MonkeyPatch):
    """The lock order, made deterministic: a gc that starts between a save's look for gc locks
    and the save's going on must see the save's lock (and defer), whatever the timing."""
    store = _store()
    seen = _between_announcing_and_looking(
        monkeypatch, "save", lambda: _locks.gc_lock(store._storage, stale_after=3600, wait=0)
    )
    with _locks.save_lock(store._storage):
        assert len(seen) == 1 and isinstance(seen[0], treestore.errors.StoreBusyError), seen


def test_a_gc_announces_itself_before_it_looks_for_saves(monkeypatch: pytest.MonkeyPatch):
    """The other side: a save that starts between a gc's look for save locks and the gc's going
    on must see the gc's lock (and wait for it, here: give up at once)."""
    store = _store()
    seen = _between_announcing_and_looking(
        monkeypatch, "gc", lambda: _locks.save_lock(store._storage, timeout=0)
    )
    with _locks.gc_lock(store._storage, stale_after=3600, wait=0):
        assert len(seen) == 1 and isinstance(seen[0], treestore.errors.StoreBusyError), seen
