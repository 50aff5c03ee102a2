"""Crash consistency: a process saving in a loop is killed with SIGKILL at random moments.

After every kill: every visible checkpoint loads (with exactly the data that was saved) and
verifies; nothing that was never committed is visible; the newest checkpoint is the last save that
completed, or the save in flight at the kill if its commit record made it; a new save succeeds; gc
(which must not wait for the dead process's locks) leaves exactly the objects the checkpoints
reference.

The worker is tests/scripts/crash_saver.py, forked from one zygote process per module so a trial
costs no Python start-up (see its docstring for the event lines it writes).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import pytest

import treestore
from tests.scripts import crash_saver as worker
from tests.support.helpers import assert_tree_equal, read_events
from treestore._engine import gc as _gc
from treestore._engine import locks as _locks
from treestore._engine.reading import committed as _committed
from treestore._format import paths as _paths

pytestmark = [pytest.mark.slow]

SCRIPT = Path(__file__).parent.parent / "scripts" / "crash_saver.py"
REPO = Path(__file__).parent.parent.parent
TRIALS = 52  # >= 50, spread over the modes below
MODES = ("save", "delete", "gc", "manager")
SEED = 20240817
SAVE_TIMEOUT = 1.0  # seconds a save after a crash may wait for locks before it counts as blocked


# --- the zygote ------------------------------------------------------------------------------------
class Zygote:
    """A crash_saver.py zygote: ``start(job)`` forks a worker and returns its pid."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
        )
        self._buf = b""

    def _line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"the zygote said nothing for {timeout} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the zygote exited with status {self.proc.wait()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def start(self, job: dict[str, Any]) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(job) + "\n").encode())
        self.proc.stdin.flush()
        word, pid = self._line(60).split()  # the first job waits for the zygote's imports
        assert word == "pid"
        return int(pid)

    def wait_exit(self, pid: int, timeout: float = 30) -> int:
        word, got, status = self._line(timeout).split()
        assert (word, int(got)) == ("exit", pid)
        return int(status)

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def wait_for(path: Path, word: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = read_events(path)
        errors = [rest for w, rest in evs if w == "error"]
        assert not errors, errors[0].replace("\\n", "\n")
        if any(w == word for w, _ in evs):
            return
        time.sleep(0.01)
    raise TimeoutError(f"the worker never reached {word!r}")


def kill(zygote: Zygote, pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it died by itself: its out file says why
        os.kill(pid, signal.SIGKILL)
    zygote.wait_exit(pid)


# --- checks shared by the trials -----------------------------------------------------------------
def expected_tree(name: str) -> Any:
    return worker.make_tree(worker.index_of(name))


def referenced(store: treestore.Store) -> tuple[set[str], set[str]]:
    """The chunk and manifest object paths the committed checkpoints reference."""
    chunks, manifests = set(), set()
    for info in store.list():
        ref = _committed.read_commit_record(store._storage, info.name)
        manifests.add(_paths.manifest_path(ref.manifest))
        chunks |= {_paths.chunk_path(d) for d in _committed.read_columns(store._storage, ref).chunk_digests()}
    return chunks, manifests


def stored_objects(root: Path, folder: str) -> set[str]:
    base = root / folder
    if not base.exists():
        return set()
    return {
        str(p.relative_to(root)) for p in base.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")
    }


def temp_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".tmp-*"))


def check_loads(store: treestore.Store, names: list[str]) -> list[str]:
    problems = []
    for name in names:
        try:
            assert_tree_equal(store.load(name), expected_tree(name))
        except (treestore.TreestoreError, AssertionError) as exc:
            problems.append(f"{name} does not load as saved: {type(exc).__name__}: {exc}")
    if names:
        report = treestore.verify(store.url)
        problems += [f"verify: {p.message}" for p in report.problems]
    return problems


def save_bounded(store: treestore.Store, make: Any, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Run ``make()`` (a save) with the save's wait for gc locks bounded; None or the problem."""
    real = _locks.save_lock
    with monkeypatch.context() as m:
        m.setattr(_locks, "save_lock", functools.partial(real, timeout=SAVE_TIMEOUT))
        try:
            make()
        except treestore.errors.StoreBusyError as exc:
            return f"a save after the crash is blocked by the dead process's lock: {exc}"
    return None


def collect_garbage(store: treestore.Store, root: Path) -> list[str]:
    """gc after the crash: the killed process's locks must not hold it back (a lock of a dead
    process on this host is stale at once); then exactly the referenced objects stay.

    A temporary file under locks/ may be a lock being written, which no lock protects, so gc
    keeps it until it is ``LOCK_TEMPORARY_AGE`` old (SPEC section 9): the killed writer's ones
    are aged past that first, as an hour would."""
    problems = []
    for p in temp_files(root):
        if p.startswith(f"{_paths.LOCKS}/"):
            past = time.time() - _gc.LOCK_TEMPORARY_AGE - 1
            os.utime(root / p, (past, past))
    try:
        store.gc(grace=0, wait=0)
    except treestore.errors.StoreBusyError as exc:
        problems.append(f"gc is blocked by the locks of the killed process: {exc}")
        store.gc(grace=0, stale_after=1e-6)
    chunks, manifests = referenced(store)
    if stored_objects(root, "locks"):
        problems.append(f"locks left after gc: {sorted(stored_objects(root, 'locks'))}")
    extra = (stored_objects(root, "chunks") - chunks) | (stored_objects(root, "manifests") - manifests)
    missing = (chunks - stored_objects(root, "chunks")) | (manifests - stored_objects(root, "manifests"))
    if extra:
        problems.append(f"gc(grace=0) left {len(extra)} unreferenced objects, e.g. {sorted(extra)[:3]}")
    if missing:
        problems.append(f"referenced objects are missing: {sorted(missing)[:3]}")
    tmp = temp_files(root)
    if tmp:
        problems.append(f"gc(grace=0) left {len(tmp)} temporary files of killed writers, e.g. {tmp[:2]}")
        for p in tmp:  # report each once
            (root / p).unlink()
    return problems


# --- the random trials ----------------------------------------------------------------------------
@dataclass
class History:
    """What the trials of one store know: what must exist, what may, and what is newest."""

    mode: str
    committed: dict[str, None] = field(default_factory=dict)  # in commit order
    uncertain: set[str] = field(default_factory=set)  # a save or delete cut short by a kill
    next_index: int = 0

    def protected(self) -> set[str]:
        """Names that must exist. The manager's retention (keep_last=3, keep_every=5) may delete
        any other step, but never a multiple of 5 and never the two newest committed steps."""
        names = list(self.committed)
        if self.mode != "manager":
            return set(names)
        return {n for n in names if worker.index_of(n) % 5 == 0} | set(names[-2:])


def name_for(mode: str, i: int) -> str:
    return f"step-{i:09d}" if mode == "manager" else worker.name_of(i)


def after_kill(
    store: treestore.Store, root: Path, hist: History, events: list[tuple[str, str]]
) -> tuple[list[str], str]:
    """Fold a trial's events into ``hist`` and check the store; returns (problems, what was cut)."""
    problems = [f"the worker failed: {rest}" for w, rest in events if w == "error"]
    in_flight = None
    cut = "idle"
    for word, rest in events:
        if word == "saving":
            in_flight, cut = rest, "save"
        elif word == "committed":
            hist.committed[rest] = None
            hist.uncertain.discard(rest)
            in_flight, cut = None, "idle"
        elif word == "deleting":
            cut = "delete"
            hist.committed.pop(rest, None)
            hist.uncertain.add(rest)
        elif word == "deleted":
            hist.uncertain.discard(rest)
            cut = "idle"
        elif word == "gc":
            cut = "gc"
        elif word == "gc-done":
            cut = "idle"
        if word in ("saving", "committed"):
            hist.next_index = max(hist.next_index, worker.index_of(rest) + 1)
    try:
        names = [c.name for c in store.list()]
    except treestore.TreestoreError as exc:
        return [*problems, f"list() fails: {exc}"], cut
    if in_flight is not None:
        hist.uncertain.add(in_flight)
    allowed = set(hist.committed) | hist.uncertain
    stray = [n for n in names if n not in allowed]
    if stray:
        problems.append(f"visible but never committed: {stray}")
    lost = sorted(hist.protected() - set(names))
    if lost:
        problems.append(f"committed checkpoints lost: {lost}")
    problems += check_loads(store, names)
    if names:
        newest = in_flight if in_flight in names else next(reversed(hist.committed), None)
        if store.latest() != newest:
            problems.append(f"newest is {store.latest()!r}, expected {newest!r} (in flight: {in_flight})")
    # Resolve what the kill left uncertain: a save committed if its record is there.
    for name in sorted(hist.uncertain):
        if name in names:
            hist.committed[name] = None
        else:
            hist.committed.pop(name, None)
    hist.uncertain.clear()
    order = sorted(hist.committed, key=worker.index_of)
    hist.committed = dict.fromkeys(n for n in order if n in names)
    return problems, cut


def save_next(store: treestore.Store, hist: History, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A new save after the crash, as the restarted training job would do it."""
    i = hist.next_index
    hist.next_index += 1
    name = name_for(hist.mode, i)

    def make() -> None:
        if hist.mode == "manager":
            with treestore.CheckpointManager(
                store.url,
                retention=treestore.Retention(keep_last=3, keep_every=5),
                async_save=False,
                options=worker.save_options(),
            ) as m:
                m.save(i, worker.make_tree(i), metrics={"loss": 1.0 / (i + 1)})
        else:
            store.save(worker.make_tree(i), name, metadata={"i": i}, options=worker.save_options())

    problem = save_bounded(store, make, monkeypatch)
    problems = [] if problem is None else [problem]
    if problem is not None:  # clear the dead process's locks and try again
        store.gc(grace=0, stale_after=1e-6)
        make()
    hist.committed[name] = None
    if store.latest() != name:
        problems.append(f"after a new save of {name!r} the newest is {store.latest()!r}")
    if hist.mode == "manager":  # retention may have removed older steps
        live = {c.name for c in store.list()}
        hist.committed = {n: None for n in hist.committed if n in live}
    return problems


def prune(store: treestore.Store, hist: History) -> None:
    """Keep the store small between trials: the three newest checkpoints stay."""
    if hist.mode == "manager":
        return
    for name in list(hist.committed)[:-3]:
        store.delete(name)
        del hist.committed[name]


@pytest.mark.timeout(300)
def test_sigkill_at_random_moments(zygote, tmp_path, monkeypatch):
    rng = random.Random(SEED)
    hists = {mode: History(mode) for mode in MODES}
    failures: list[str] = []
    cuts: dict[str, int] = {}
    for trial in range(TRIALS):
        mode = MODES[trial % len(MODES)]
        hist = hists[mode]
        root = tmp_path / mode
        store = treestore.Store(str(root))
        out = tmp_path / f"trial-{trial}.log"
        delay = rng.choice([rng.uniform(0.0, 0.08), rng.uniform(0.05, 1.0)])
        pid = zygote.start({"mode": mode, "url": str(root), "start": hist.next_index, "out": str(out)})
        time.sleep(delay)
        kill(zygote, pid)
        problems, cut = after_kill(store, root, hist, read_events(out))
        cuts[f"{mode}/{cut}"] = cuts.get(f"{mode}/{cut}", 0) + 1
        problems += save_next(store, hist, monkeypatch)
        problems += collect_garbage(store, root)
        problems += check_loads(store, [c.name for c in store.list()])
        prune(store, hist)
        failures += [f"trial {trial} ({mode}, killed during {cut}, {delay:.2f} s): {p}" for p in problems]
    print("kills by mode/activity:", dict(sorted(cuts.items())))
    assert not failures, f"{len(failures)} problems:\n" + "\n".join(failures)


# --- deterministic crashes at the interesting points ------------------------------------------------
def _held(zygote: Zygote, tmp_path: Path, mode: str, url: str, start: int = 0) -> list[tuple[str, str]]:
    out = tmp_path / f"{mode}.log"
    pid = zygote.start({"mode": mode, "url": url, "start": start, "out": str(out)})
    try:
        wait_for(out, "holding")
    finally:
        kill(zygote, pid)
    return read_events(out)


@pytest.mark.timeout(60)
def test_killed_gc_does_not_block_later_saves(zygote, tmp_path, monkeypatch):
    """A gc killed while it held its lock must not stop every save for the next hour."""
    url = str(tmp_path / "store")
    store = treestore.Store(url)
    store.save(worker.make_tree(0), "c-00000", options=worker.save_options())
    _held(zygote, tmp_path, "gc-hold", url)
    problem = save_bounded(
        store, lambda: store.save(worker.make_tree(1), "c-00001", options=worker.save_options()), monkeypatch
    )
    assert problem is None, problem


@pytest.mark.timeout(60)
def test_killed_save_leaves_nothing_visible_and_does_not_block_gc(zygote, tmp_path):
    url = str(tmp_path / "store")
    store = treestore.Store(url)
    store.save(worker.make_tree(0), "c-00000", options=worker.save_options())
    before = stored_objects(tmp_path / "store", "chunks")
    _held(zygote, tmp_path, "save-hold", url, start=1)  # killed after writing its chunks
    assert [c.name for c in store.list()] == ["c-00000"]
    assert stored_objects(tmp_path / "store", "chunks") > before  # the dead save's chunks
    assert len(stored_objects(tmp_path / "store", "locks")) == 1  # and its lock
    report = store.gc(grace=0, wait=0)  # the lock's process is dead: gc goes ahead
    assert report.locks_removed == 1 and report.chunks_removed >= 1
    assert stored_objects(tmp_path / "store", "chunks") == before
    assert not stored_objects(tmp_path / "store", "locks")
    assert_tree_equal(store.load("c-00000"), worker.make_tree(0))
    store.save(worker.make_tree(1), "c-00001", options=worker.save_options())
    assert_tree_equal(store.load(), worker.make_tree(1))


def _foreign_lock(store: treestore.Store, kind: str, age: float) -> str:
    """A lock as a process on another host writes it (its liveness cannot be checked here)."""
    path = _paths.lock_path(kind, uuid.uuid4().hex)
    record = {"kind": kind, "created": time.time() - age, "host": "another-host.invalid", "pid": 1}
    store._storage.write(path, [msgpack.packb(record)])
    return path


@pytest.mark.timeout(60)
def test_locks_of_other_hosts_count_until_stale(tmp_path, monkeypatch):
    """SPEC section 9 for processes this host cannot see: their locks hold until stale_after."""
    store = treestore.Store(str(tmp_path / "store"))
    store.save(worker.make_tree(0), "c-00000", options=worker.save_options())
    save_lock = _foreign_lock(store, "save", age=10)
    with pytest.raises(treestore.errors.StoreBusyError, match=save_lock.rsplit("/", 1)[1]):
        store.gc(grace=0, wait=0)
    store.save(worker.make_tree(1), "c-00001", options=worker.save_options())  # saves do not wait
    assert store.gc(grace=0, wait=0, stale_after=5).locks_removed == 1
    gc_lock = _foreign_lock(store, "gc", age=1)
    problem = save_bounded(
        store, lambda: store.save(worker.make_tree(2), "c-00002", options=worker.save_options()), monkeypatch
    )
    assert problem is not None and "gc" in problem  # a live gc elsewhere: the save waits
    store._storage.delete(gc_lock)
    _foreign_lock(store, "gc", age=2 * _locks.STALE_AFTER)  # a stale one does not hold saves
    store.save(worker.make_tree(2), "c-00002", options=worker.save_options())
    assert [c.name for c in store.list()] == ["c-00000", "c-00001", "c-00002"]
    assert not check_loads(store, ["c-00000", "c-00001", "c-00002"])


@pytest.mark.timeout(60)
def test_gc_reclaims_temporary_files_of_killed_writers(zygote, tmp_path):
    """SPEC section 5.2: a killed save leaves at most unreferenced objects, which gc removes; a
    write cut between its temporary file and the move into place leaves a ``.tmp-*`` file."""
    root = tmp_path / "store"
    store = treestore.Store(str(root))
    store.save(worker.make_tree(0), "c-00000", options=worker.save_options())
    _held(zygote, tmp_path, "tmp-hold", str(root), start=1)
    assert temp_files(root), "the worker was killed before its temporary file was written"
    assert [c.name for c in store.list()] == ["c-00000"]
    store.gc(grace=0, wait=0)
    assert temp_files(root) == [], "gc(grace=0) keeps the temporary files of killed writers forever"


@pytest.mark.timeout(60)
def test_sigkill_of_a_freshly_started_process(tmp_path):
    """One trial without the zygote: a process started from scratch, killed mid-loop."""
    root = tmp_path / "store"
    out = tmp_path / "fresh.log"
    job = {"mode": "delete", "url": str(root), "start": 0, "out": str(out)}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "run", json.dumps(job)], cwd=REPO)
    try:
        wait_for(out, "committed")
        time.sleep(random.Random(SEED).uniform(0.05, 0.5))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = treestore.Store(str(root))
    hist = History("delete")
    problems, _ = after_kill(store, root, hist, read_events(out))
    assert not problems, problems
    store.gc(grace=0, wait=0)
    store.save(worker.make_tree(hist.next_index), worker.name_of(hist.next_index))
    assert store.latest() == worker.name_of(hist.next_index)
    assert not check_loads(store, [c.name for c in store.list()])
