"""Reliability of the store under real faults: listings that fail, bad objects under a chunk's name,
one damaged checkpoint among healthy ones, gc racing saves, lock objects that cannot be removed or
that name a reused pid, and store folders removed under a live Store.

Each test reproduces one finding of an external attack report (issue 12.N) and is an expected
failure until its fix lands. Only the public API is used. Faults are injected by real means,
never by patching treestore: a folder replaced by a regular file (the tests run as root, so
permissions would not stop a listing), ``faultmem://`` (fsspec's memory filesystem with the
generic walk-based ``find`` most fsspec backends use, whose ``ls`` or ``rm_file`` fail for chosen
paths; treestore uses its generic Storage class for it), and an armed audit hook that holds the
saving thread at one point of a race so that the race shows every time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import msgpack
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import treestore

from .helpers import assert_tree_equal

MiB = 2**20


# --- fault injection ------------------------------------------------------------------------------
class FaultyMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem as ``faultmem://`` (sharing its objects with ``memory://``).

    ``find`` is fsspec's generic one (a walk of ``ls`` calls, as on most fsspec backends), so a
    folder whose listing fails is silently left out of the result, as it is on those backends.
    ``ls`` of a path in ``unlistable`` (or below it) and ``rm_file`` of a path starting with one
    of ``undeletable`` raise PermissionError.
    """

    protocol = ("faultmem",)
    unlistable: ClassVar[set[str]] = set()
    undeletable: ClassVar[tuple[str, ...]] = ()
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


fsspec.register_implementation("faultmem", FaultyMemoryFileSystem, clobber=True)


@pytest.fixture
def faultmem() -> Iterator[str]:
    """A fresh ``faultmem://`` store URL, with no fault armed before or after the test."""
    FaultyMemoryFileSystem.unlistable = set()
    FaultyMemoryFileSystem.undeletable = ()
    yield f"faultmem://treestore-tests/{uuid.uuid4().hex}"
    FaultyMemoryFileSystem.unlistable = set()
    FaultyMemoryFileSystem.undeletable = ()


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


def tree(seed: int, n: int = 50_000) -> dict[str, Any]:
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


# --- 12.1: a listing that fails must abort gc -----------------------------------------------------
def _save_and_orphan(url: str) -> dict[str, Any]:
    """Checkpoints a and b, plus c deleted again (its chunks and manifest unreferenced)."""
    trees = {"a": tree(1), "b": tree(2)}
    for name, t in trees.items():
        treestore.save(url, t, name)
    treestore.save(url, tree(3), "c")
    treestore.Store(url).delete("c")
    return trees


def _check_gc_aborted(url: str, failure: BaseException | None, before: set[str], trees: dict, what: str):
    """After the fault is removed: every checkpoint loads bit-exact, gc deleted nothing, and it
    raised a StorageError naming what it could not list."""
    for name, t in trees.items():
        assert_tree_equal(treestore.load(url, name), t)
    after = {p for p in objects(url) if not p.startswith("locks/")}
    assert before - after == set(), f"gc deleted {sorted(before - after)} although a listing failed"
    assert isinstance(failure, treestore.errors.StorageError), f"gc did not raise a StorageError: {failure!r}"
    assert what in str(failure), f"the error does not name {what!r}: {failure}"


def test_gc_aborts_when_local_checkpoints_cannot_be_listed(tmp_path: Path):
    """(A local manifests/ that cannot be listed cannot be read either, and gc already stops.)"""
    folder = "checkpoints"
    url = str(tmp_path / "store")
    trees = _save_and_orphan(url)
    before = {p for p in objects(url) if not p.startswith("locks/")}
    real = Path(url) / folder
    moved = tmp_path / f"moved-{folder}"
    os.rename(real, moved)
    real.write_bytes(b"not a folder")  # os.walk cannot list it
    try:
        failure = outcome(lambda: treestore.Store(url).gc(grace=0))
    finally:
        real.unlink()
        os.rename(moved, real)
    _check_gc_aborted(url, failure, before, trees, folder)


@pytest.mark.parametrize("folder", ["checkpoints", "manifests", "chunks/<hh>"])
def test_gc_aborts_when_an_fsspec_folder_cannot_be_listed(faultmem: str, folder: str):
    trees = _save_and_orphan(faultmem)
    before = {p for p in objects(faultmem) if not p.startswith("locks/")}
    root = fs_root(faultmem)[1]
    if folder == "chunks/<hh>":  # the folder of a chunk only the deleted checkpoint used
        live = set(chunk_objects(faultmem))
        orphan = sorted(live - _chunks_of(faultmem, ["a", "b"]))[0]
        folder = os.path.dirname(orphan)
    FaultyMemoryFileSystem.unlistable = {f"{root}/{folder}"}
    try:
        failure = outcome(lambda: treestore.Store(faultmem).gc(grace=0))
    finally:
        FaultyMemoryFileSystem.unlistable = set()
    _check_gc_aborted(faultmem, failure, before, trees, folder.split("/")[0])


def _chunks_of(url: str, names: list[str]) -> set[str]:
    """The chunk objects the named checkpoints reference (read through the public manifest)."""
    out = set()
    store = treestore.Store(url)
    for name in names:
        m = store.manifest(name)
        refs = [*m.packs, *(c for e in m.leaves for c in e.chunks if c.pack is None)]
        for c in refs:
            h = c.digest.hex()
            out.add(f"chunks/{h[:2]}/{h}")
    return out


@pytest.mark.parametrize("backend", ["local", "fsspec"])
def test_list_raises_when_checkpoints_cannot_be_listed(tmp_path: Path, faultmem: str, backend: str):
    url = str(tmp_path / "store") if backend == "local" else faultmem
    treestore.save(url, tree(1), "a")
    if backend == "local":
        shutil.rmtree(Path(url) / "checkpoints")
        (Path(url) / "checkpoints").write_bytes(b"not a folder")
    else:
        FaultyMemoryFileSystem.unlistable = {f"{fs_root(url)[1]}/checkpoints"}
    with pytest.raises(treestore.errors.StorageError, match="checkpoints"):
        treestore.Store(url).list()


# --- 12.2: a bad object under a chunk's name ------------------------------------------------------
def _damage(url: str, path: str, how: str, size: int) -> None:
    """Put a bad object at ``path``: empty, or ``size`` bytes of garbage (the good one's size)."""
    bad = b"" if how == "empty" else np.random.default_rng(size).bytes(size)
    put_object(url, path, bad)


@pytest.mark.parametrize("how", ["empty", "garbage"])
def test_a_save_does_not_reuse_a_bad_chunk_object(store_url: str, how: str):
    data = tree(7, n=1_500_000)  # 6 MB: two chunks of the default 4 MiB, and a pack
    treestore.save(store_url, data, "first")
    chunks = chunk_objects(store_url)
    assert len(chunks) >= 3
    for path in chunks:
        _damage(store_url, path, how, len(get_object(store_url, path)))
    treestore.Store(store_url).delete("first")
    treestore.save(store_url, data, "again")
    assert_tree_equal(treestore.load(store_url, "again"), data)
    report = treestore.verify(store_url)
    assert report.ok, report.problems


@pytest.mark.parametrize("how", ["empty", "garbage"])
def test_copy_repairs_a_bad_chunk_object_at_the_destination(store_url: str, how: str):
    src = f"memory://treestore-tests/{uuid.uuid4().hex}"
    data = tree(8, n=1_500_000)
    treestore.save(src, data, "a")
    for path in chunk_objects(src):  # the destination holds bad objects under the same names
        _damage(store_url, path, how, len(get_object(src, path)))
    treestore.copy(f"{src}#a", store_url)
    assert_tree_equal(treestore.load(store_url, "a"), data)
    report = treestore.verify(store_url)
    assert report.ok, report.problems


@pytest.mark.timeout(60)
def test_an_array_written_to_during_a_save_never_makes_a_corrupt_chunk(tmp_path: Path):
    """The loaded values may be any mix of the states the array went through; every chunk
    object must still hold the bytes its name promises."""
    url = str(tmp_path / "store")
    arr = np.zeros(2 * MiB + 123, np.float32)  # 8 MiB: three chunks
    stop = threading.Event()

    def scribble() -> None:
        k = 0.0
        while not stop.is_set():
            arr[:] = k
            k += 1.0

    writer = threading.Thread(target=scribble, daemon=True)
    writer.start()
    try:
        names = [f"s{i}" for i in range(6)]
        for name in names:
            treestore.save(url, {"w": arr}, name)
    finally:
        stop.set()
        writer.join()
    report = treestore.verify(url)
    corrupt = [p for p in report.problems if p.kind == "chunk_corrupt"]
    assert corrupt == [], "\n".join(p.message for p in corrupt)
    for name in names:
        loaded = treestore.load(url, name)["w"]
        assert loaded.dtype == arr.dtype and loaded.shape == arr.shape


# --- 12.5: one bad checkpoint must not take the store down --------------------------------------
def _healthy_and_damaged(url: str, damage: str) -> dict[str, Any]:
    """Checkpoints keep-1 and keep-2 (returned) around 'other', whose commit record or manifest
    is then truncated to half its length."""
    trees = {"keep-1": tree(11)}
    treestore.save(url, trees["keep-1"], "keep-1")
    treestore.save(url, tree(12), "other")
    trees["keep-2"] = tree(13)
    treestore.save(url, trees["keep-2"], "keep-2")
    if damage == "record":
        path = "checkpoints/other"
    else:
        (path,) = objects(url, "manifests") - _manifests_of(url, ["keep-1", "keep-2"])
    put_object(url, path, get_object(url, path)[: len(get_object(url, path)) // 2])
    return trees


def _manifests_of(url: str, names: list[str]) -> set[str]:
    """The manifest objects of the named checkpoints (read from their commit records)."""
    out = set()
    for name in names:
        rec = msgpack.unpackb(get_object(url, f"checkpoints/{name}"), raw=False)
        out.add(f"manifests/{rec['manifest'].hex()}")
    return out


def test_list_survives_a_damaged_commit_record(store_url: str):
    _healthy_and_damaged(store_url, "record")
    names = [c.name for c in treestore.Store(store_url).list()]
    assert {"keep-1", "keep-2"} <= set(names), names


@pytest.mark.parametrize("damage", ["record", "manifest"])
def test_gc_survives_a_damaged_checkpoint(store_url: str, damage: str):
    trees = _healthy_and_damaged(store_url, damage)
    treestore.Store(store_url).gc(grace=0)
    for name, t in trees.items():
        assert_tree_equal(treestore.load(store_url, name), t)
    assert treestore.verify(f"{store_url}#keep-1").ok and treestore.verify(f"{store_url}#keep-2").ok


@pytest.mark.parametrize("damage", ["record", "manifest"])
def test_manager_retention_survives_a_damaged_checkpoint(store_url: str, damage: str):
    trees = _healthy_and_damaged(store_url, damage)
    steps = {s: tree(100 + s) for s in (1, 2, 3)}
    with treestore.CheckpointManager(store_url, keep_last=1, async_save=False) as m:
        for s, t in steps.items():
            assert m.save(s, t) is True
        assert m.steps() == [3]
        assert_tree_equal(m.restore(), steps[3])
    for name, t in trees.items():  # not steps: the manager never deletes them
        assert_tree_equal(treestore.load(store_url, name), t)


def test_list_names_the_damaged_checkpoint_it_leaves_out(store_url: str, caplog):
    _healthy_and_damaged(store_url, "record")
    with caplog.at_level(logging.WARNING, logger="treestore"):
        names = [c.name for c in treestore.Store(store_url).list()]
    assert names == ["keep-1", "keep-2"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "'other'" in said, f"the damaged checkpoint was not named: {said!r}"


@pytest.mark.parametrize("damage", ["record", "manifest"])
def test_gc_with_a_damaged_checkpoint_deletes_no_chunk_and_names_it(store_url: str, damage: str):
    """What the damaged checkpoint references is unknown, so no chunk or manifest goes, not even
    one that only a deleted checkpoint used; the report names the damaged checkpoint."""
    trees = _healthy_and_damaged(store_url, damage)
    treestore.save(store_url, tree(14), "gone")
    treestore.Store(store_url).delete("gone")  # its chunks are unreferenced now
    before = objects(store_url, "chunks") | objects(store_url, "manifests")
    report = treestore.Store(store_url).gc(grace=0)
    assert report.damaged == ("other",)
    assert (report.chunks_removed, report.manifests_removed) == (0, 0)
    assert objects(store_url, "chunks") | objects(store_url, "manifests") == before
    treestore.Store(store_url).delete("other")  # once it is gone, gc frees space again
    report = treestore.Store(store_url).gc(grace=0)
    assert report.damaged == () and report.chunks_removed > 0
    for name, t in trees.items():
        assert_tree_equal(treestore.load(store_url, name), t)


def test_manager_save_succeeds_when_retention_fails_after_the_commit(faultmem: str, caplog):
    """Retention runs after the commit: a checkpoint it cannot delete is logged, and the step
    still counts as saved (a retry would otherwise find it committed)."""
    root = fs_root(faultmem)[1]
    with treestore.CheckpointManager(faultmem, keep_last=1, async_save=False) as m:
        assert m.save(1, tree(61)) is True
        FaultyMemoryFileSystem.undeletable = (f"{root}/checkpoints/",)
        with caplog.at_level(logging.WARNING, logger="treestore"):
            result = outcome(lambda: m.save(2, tree(62)))
        FaultyMemoryFileSystem.undeletable = ()
        assert result is None, f"save raised although step 2 is committed: {result!r}"
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "step-000000001" in said, said
        assert m.save(3, tree(63)) is True  # retention runs again, and now succeeds
        assert m.steps() == [3]


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
    data = tree(21)
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
        treestore.save(faultmem, tree(22), "a")
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
        data = tree(31)
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
        blocked, done = _save_in_time(url, tree(32), "reused")
        assert not blocked and done == [None], "a lock of another process under a reused pid held the save"
        lock.write_bytes(msgpack.packb({**base, "start": _proc_identity(sleeper.pid)}))
        live = threading.Thread(target=lambda: outcome(lambda: treestore.save(url, tree(33), "live")))
        live.daemon = True
        live.start()
        live.join(2)
        assert live.is_alive(), "a live gc's lock did not hold the save"
    finally:
        lock.unlink(missing_ok=True)
        sleeper.kill()
        sleeper.wait()
    live.join(10)
    assert_tree_equal(treestore.load(url, "live"), tree(33))


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
    blocked, done = _save_in_time(url, tree(34), "after")
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
        blocked, done = _save_in_time(url, tree(35), "after")
    finally:
        stray.unlink()  # lets a blocked save go on
    assert not blocked and done == [None], f"the stray object locks/{name} held the save"


# --- 12.9: a store folder removed under a live Store or CheckpointManager --------------------------
@pytest.mark.parametrize("folder", ["locks", "checkpoints", "manifests", "the whole store"])
def test_a_store_recreates_a_removed_folder(tmp_path: Path, folder: str):
    url = str(tmp_path / "store")
    store = treestore.Store(url)
    store.save(tree(41), "a")
    shutil.rmtree(url if folder == "the whole store" else os.path.join(url, folder))
    data = tree(42)
    failure = outcome(lambda: store.save(data, "b"))
    assert failure is None, f"save after removing {folder} raised {failure!r}"
    assert_tree_equal(store.load("b"), data)
    assert_tree_equal(treestore.Store(url).load("b"), data)


def test_a_manager_recreates_a_removed_store(tmp_path: Path):
    url = str(tmp_path / "store")
    with treestore.CheckpointManager(url, async_save=False) as m:
        m.save(1, tree(51))
        shutil.rmtree(url)
        data = tree(52)
        failure = outcome(lambda: m.save(2, data))
        assert failure is None, f"save after removing the store raised {failure!r}"
        assert m.latest_step() == 2
        assert_tree_equal(m.restore(), data)
