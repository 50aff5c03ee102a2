"""The worker threads saves and loads run in are kept between calls (treestore._engine.threads):
a second call starts no thread, callers in many threads share them, and a process forked from
one that used them saves and loads with threads of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import treestore
from tests.support.helpers import assert_tree_equal


def tree(v: int) -> dict[str, Any]:
    rng = np.random.default_rng(v)
    return {
        "w": rng.standard_normal((300, 1000)).astype(np.float32),  # chunked
        "e": rng.standard_normal((64, 3000)).astype(np.float32),
        "b": np.full(7, v, np.int64),  # packed
        "step": v,
    }


OPTIONS = treestore.SaveOptions(chunk_size=256 * 1024)


def _starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    started: list[str] = []
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        started.append(self.name)
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return started


def test_a_second_save_and_load_start_no_thread(tmp_path, monkeypatch):
    store = treestore.Store(str(tmp_path / "store"))
    store.save(tree(0), "a", options=OPTIONS)
    assert_tree_equal(store.load("a"), tree(0))
    np.asarray(store.open("a")["w"])
    started = _starts(monkeypatch)
    store.save(tree(1), "b", options=OPTIONS)
    assert_tree_equal(store.load("b"), tree(1))
    assert np.array_equal(np.asarray(store.open("b")["w"]), tree(1)["w"])
    assert started == []


def test_callers_in_many_threads_share_the_workers(tmp_path):
    store = treestore.Store(str(tmp_path / "store"))
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for round_ in range(3):
                name = f"c{i}-{round_}"
                store.save(tree(10 * i + round_), name, options=OPTIONS)
                assert_tree_equal(store.load(name), tree(10 * i + round_))
                assert np.array_equal(np.asarray(store.open(name)["e"]), tree(10 * i + round_)["e"])
        except BaseException as exc:
            errors.append(exc)

    callers = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in callers), "a caller never finished"
    assert errors == []
    assert treestore.verify(str(tmp_path / "store")).ok


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # jax warns of fork in a threaded process
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_forked_process_saves_and_loads_with_threads_of_its_own(tmp_path):
    """The child has copies of the parent's pools but none of their threads: with those pools it
    would wait forever for its first chunk. The parent has also stored a big chunk alone, on
    every core (threads of BLAKE3's and zstd's own): a compressor kept with its threads hung or
    crashed the child when it was freed there."""
    store = treestore.Store(str(tmp_path / "store"))
    big = np.random.default_rng(5).standard_normal(16 * 2**20).astype(np.float32)  # 64 MiB
    store.save({"big": big}, "big", options=treestore.SaveOptions(chunk_size=64 * 2**20))
    store.save(tree(0), "a", options=OPTIONS)
    assert_tree_equal(store.load("a"), tree(0))
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if it saved and loaded exactly
        code = 1
        try:
            child = treestore.Store(str(tmp_path / "store"))
            child.save(tree(1), "b", options=OPTIONS)
            got = child.load("b")
            code = (
                0 if np.array_equal(got["w"], tree(1)["w"]) and np.array_equal(got["e"], tree(1)["e"]) else 3
            )
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0
    assert_tree_equal(store.load("b"), tree(1))


def test_run_all_runs_each_job_once_on_the_pool_threads():
    """Jobs are spread over the role's threads, each taken once."""
    from treestore._engine.threads import run_all

    ran: list[tuple[int, str]] = []
    lock = threading.Lock()

    def job(i: int) -> None:
        time.sleep(0.002)  # long enough for every thread to take some
        with lock:
            ran.append((i, threading.current_thread().name))

    run_all([lambda i=i: job(i) for i in range(40)], 4, "read")
    assert sorted(i for i, _ in ran) == list(range(40))
    names = {name for _, name in ran}
    assert all(name.startswith("treestore-read") for name in names)
    assert len(names) > 1


def test_run_all_stops_taking_jobs_after_one_fails():
    """The first failure propagates once the jobs running end; the jobs not yet taken never run."""
    from treestore._engine.threads import run_all

    ran: list[int] = []
    lock = threading.Lock()

    def job(i: int) -> None:
        if i == 3:
            raise ValueError("job 3 failed")
        time.sleep(0.005)
        with lock:
            ran.append(i)

    with pytest.raises(ValueError, match="job 3 failed"):
        run_all([lambda i=i: job(i) for i in range(200)], 4, "read")
    assert 3 not in ran
    assert len(ran) < 20, ran  # four threads stop after the job each was running


def test_threads_that_cannot_start_are_out_of_memory_and_leave_no_pool(monkeypatch):
    """Under an address-space limit a new thread cannot be made (RuntimeError from the
    executor): the caller gets OutOfMemoryError, and no half-started pool is kept for later."""
    from treestore._engine import threads as threads_module
    from treestore.errors import OutOfMemoryError

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(OutOfMemoryError, match="cannot start 13 read thread"):
        threads_module.run_all([lambda: None] * 20, 13, "read")
    assert ("read", 13) not in threads_module._pools


NEAR_THE_LIMIT = """
import resource, sys, treestore
from treestore._kernels import digest as hashing
store = sys.argv[1]
treestore.verify(store)  # threads, imports and caches in place first
treestore.load(store + "#c")
hashing._next_look = -1.0  # look at the limit again at the next digest
def limit_to(extra):
    size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, hard))  # soft: raised again below
    return size

# With room to spare, each thread that hashed keeps room for BLAKE3: Python runs out first,
# and hashing still works after it did.
limit_to(4 * hashing.NATIVE_ROOM)
hashing.digest(b"x")
try:
    held = bytearray(3 * hashing.NATIVE_ROOM + hashing.NATIVE_ROOM // 2)
    print("python", "allocated")
except MemoryError:
    print("python", "MemoryError")
print("digest", hashing.digest(b"x").hex()[:8])
resource.setrlimit(resource.RLIMIT_AS, (resource.getrlimit(resource.RLIMIT_AS)[1],) * 2)
hashing._next_look = -1.0

# Less than that room left: reads refuse before BLAKE3 runs.
limit_to(hashing.NATIVE_ROOM // 2)
hashing._next_look = -1.0
calls = (("verify", lambda: treestore.verify(store)), ("load", lambda: treestore.load(store + "#c")))
for name, call in calls:
    try:
        call()
        print(name, "done")
    except treestore.errors.OutOfMemoryError as exc:
        print(name, "OutOfMemoryError", exc)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="address-space limits as Linux counts them")
def test_blake3_keeps_room_under_an_address_space_limit(tmp_path):
    """BLAKE3's native code aborts the process when an allocation of its own fails, which Python
    cannot catch. Under an address-space limit (RLIMIT_AS) each thread that hashes keeps room
    for it, so Python's allocations run out first; and a read with less than that room left
    is an OutOfMemoryError, not an abort."""
    store = str(tmp_path / "s")
    treestore.save(store, tree(1), "c", options=OPTIONS)
    root = Path(__file__).resolve().parent.parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.run(
        [sys.executable, "-c", NEAR_THE_LIMIT, store], capture_output=True, text=True, timeout=120, env=env
    )
    assert child.returncode == 0, child.stderr
    lines = [line.split()[:2] for line in child.stdout.splitlines()]
    assert lines == [
        ["python", "MemoryError"],
        ["digest", "3ae7d805"],  # BLAKE3 of b"x"
        ["verify", "OutOfMemoryError"],
        ["load", "OutOfMemoryError"],
    ], child.stdout


BIGGER_THAN_THE_LIMIT = """
import resource, sys, treestore
store = sys.argv[1]
treestore.load(store + "#small")  # threads, imports and caches in place first
size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + 256 * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    treestore.load(store + "#big")
    print("loaded")
except treestore.errors.OutOfMemoryError as exc:
    print("OutOfMemoryError", exc.address, exc.checkpoint, exc)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="address-space limits as Linux counts them")
def test_a_leaf_the_address_space_cannot_hold_is_out_of_memory_naming_it(tmp_path):
    """A leaf that fits the machine's memory but not what the process may still map (a real
    RLIMIT_AS in a child process, 256 MiB above what it holds; the leaf is 512 MiB) fails where
    its array is allocated: OutOfMemoryError naming the leaf and the checkpoint, not a bare
    MemoryError."""
    store = str(tmp_path / "s")
    treestore.save(store, {"w": np.ones(3)}, "small")
    treestore.save(store, {"layer": {"w": np.zeros(2**27, np.float32)}}, "big")  # 512 MiB of zeros
    root = Path(__file__).resolve().parent.parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-c", BIGGER_THAN_THE_LIMIT, store]
    child = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split()[:3] == ["OutOfMemoryError", "layer/w", "big"], child.stdout
    assert "cannot allocate (134217728,) of float32" in child.stdout, child.stdout
