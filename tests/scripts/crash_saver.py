"""Save checkpoints in a loop until killed: the worker of tests/system/test_crash.py (tests only).

usage: crash_saver.py zygote        read jobs (JSON lines) on stdin; fork one worker per job
       crash_saver.py run JOB_JSON  run one job in this process

Starting Python and importing jax costs over a second, and each crash trial needs a fresh process
to kill, so the test starts one *zygote* that imports treestore once and forks a worker per trial
(the zygote never starts a thread or touches a jax backend, so forking it is safe). A worker is a
real process: the test kills it with SIGKILL at a random moment. The zygote answers each job with
``pid N`` and, once the worker is dead, ``exit N STATUS``.

A job is ``{"mode", "url", "start", "out"}``. The worker appends one line per event to the file
``out`` (each line one ``write``, so a kill never leaves half a line):

- ``saving NAME`` just before a save starts, ``committed NAME`` once it returned;
- ``deleting NAME`` / ``deleted NAME`` around a delete, ``gc`` / ``gc-done`` around a gc;
- ``holding`` when a ``*-hold`` mode reached the point where it waits to be killed;
- ``error TRACEBACK`` when the worker failed (it then exits with status 1).

Modes: ``save`` (save only), ``delete`` (also deletes the checkpoint saved two iterations
before, every third iteration), ``gc`` (a gc with grace 0 after every save), ``manager`` (a
CheckpointManager with retention, whose gc runs after each save), and the deterministic
``gc-hold`` (hold a gc lock), ``save-hold`` (stop in the middle of a save, chunks written) and
``tmp-hold`` (stop after writing a temporary file, before moving it into place).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

BIG = 96 * 1024  # float32 elements: 384 KiB, six chunks of 64 KiB
CHUNK = 64 * 1024
PREFIX = "c-"


@functools.lru_cache(maxsize=1)
def _base() -> np.ndarray:
    return (np.random.default_rng(1234).standard_normal(BIG) * 0.02).astype(np.float32)


def make_tree(i: int) -> dict[str, Any]:
    """The tree of iteration ``i``: one big leaf (six chunks, one of which changes per iteration,
    so most chunks are shared with other checkpoints), small packed leaves and Python scalars."""
    big = _base().copy()
    j = i % 6
    big[j * 16384 : j * 16384 + 64] = float(i)
    return {
        "big": big,
        "ints": np.arange(20_000, dtype=np.int32) + i,  # 80 KiB: its own chunk, zstd
        "small": {"b": np.full(8, i, np.int32), "c": np.arange(i % 50, dtype=np.int64)},
        "step": i,
        "tag": f"t{i}",
    }


def name_of(i: int) -> str:
    return f"{PREFIX}{i:05d}"


def index_of(name: str) -> int:
    """The iteration a checkpoint name stands for (``c-00012`` and ``step-000000012`` alike)."""
    return int(name.rsplit("-", 1)[1])


def save_options() -> Any:
    import treestore

    return treestore.SaveOptions(chunk_size=CHUNK, threads=4)


class _Out:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, line: str) -> None:
        os.write(self.fd, (line.replace("\n", "\\n") + "\n").encode())


def _hold(out: _Out) -> None:
    out("holding")
    while True:
        time.sleep(60)


def run(job: dict[str, Any]) -> None:
    import treestore
    from treestore._engine import locks as _locks

    mode, url, start = job["mode"], job["url"], int(job["start"])
    out = _Out(job["out"])
    store = treestore.Store(url)
    opts = save_options()

    if mode == "gc-hold":
        _locks.gc_lock(store._storage, stale_after=_locks.STALE_AFTER, wait=0)
        _hold(out)
    if mode == "save-hold":
        real_sync = type(store._storage).sync

        def sync(self: Any) -> None:  # the first sync of a save: its chunks are written
            real_sync(self)
            _hold(out)

        type(store._storage).sync = sync  # type: ignore[method-assign]
        out(f"saving {name_of(start)}")
        store.save(make_tree(start), name_of(start), options=opts)
        return
    if mode == "tmp-hold":
        real_replace = os.replace

        def replace(src: Any, dst: Any, **kw: Any) -> None:
            if "/chunks/" in os.fspath(dst):
                _hold(out)
            real_replace(src, dst, **kw)

        os.replace = replace  # type: ignore[assignment]
        out(f"saving {name_of(start)}")
        store.save(make_tree(start), name_of(start), options=opts)
        return

    if mode == "manager":
        manager = treestore.CheckpointManager(
            url,
            retention=treestore.Retention(keep_last=3, keep_every=5),
            async_save=start % 2 == 0,
            options=opts,
        )
        for step in itertools.count(start):
            name = f"step-{step:09d}"
            out(f"saving {name}")
            manager.save(step, make_tree(step), metrics={"loss": 1.0 / (step + 1)})
            manager.wait()
            out(f"committed {name}")
        return

    for i in itertools.count(start):
        name = name_of(i)
        out(f"saving {name}")
        store.save(make_tree(i), name, metadata={"i": i}, options=opts)
        out(f"committed {name}")
        if mode == "delete" and i % 3 == 2 and i - 2 >= start:
            old = name_of(i - 2)
            out(f"deleting {old}")
            store.delete(old)
            out(f"deleted {old}")
        if mode == "gc":
            out("gc")
            store.gc(grace=0, wait=5.0)
            out("gc-done")


def _run_logged(job: dict[str, Any]) -> int:
    try:
        run(job)
    except BaseException:
        _Out(job["out"])("error " + traceback.format_exc())
        return 1
    return 0


def zygote() -> None:
    import threading

    import treestore  # noqa: F401  (imported once, before any fork)

    assert threading.active_count() == 1, "the zygote must not run threads before it forks"
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the worker
            status = 1
            try:
                status = _run_logged(job)
            finally:
                os._exit(status)
        print(f"pid {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"exit {pid} {status}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "zygote":
        zygote()
    else:
        sys.exit(_run_logged(json.loads(sys.argv[2])))
