"""One writer process of tests/system/test_concurrency.py (tests only).

usage: concurrent_writer.py JOB_JSON

A job is ``{"mode", "url", "index", "out", "go"}`` plus, per mode:

- ``plain``: ``saves`` saves named ``w<index>-<i>``; every fourth iteration also deletes the
  checkpoint it saved two iterations before;
- ``manager``: a CheckpointManager (keep_last=3, keep_every=5, async saves) saving ``steps``;
- ``race``: ``rounds`` rounds; in round r, once the file ``<go>.<r>`` exists, save checkpoint
  ``race-<r>`` (the other racer saves the same name with other data).

The process imports treestore, writes ``ready`` (``ready <r>`` per race round) to ``out`` and
waits for the file ``go``, so every writer starts at once. Events are lines in ``out``:
``committed NAME``, ``deleting NAME``, ``deleted NAME``, ``won NAME``, ``lost NAME ERROR``,
``error TRACEBACK``, and ``done`` at the end.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

KiB = 1024


@functools.lru_cache(maxsize=1)
def _base() -> np.ndarray:
    return (np.random.default_rng(7).standard_normal(64 * KiB) * 0.02).astype(np.float32)


def make_tree(writer: int, i: int) -> dict[str, Any]:
    """Writer ``writer``'s tree number ``i``: a 256 KiB leaf whose chunks every writer shares but
    one (so chunks are deduplicated across processes), and small leaves of its own."""
    big = _base().copy()
    big[(i % 4) * 16 * KiB] = writer * 1000 + i
    return {"big": big, "mine": np.full(16, writer * 1000 + i, np.int32), "i": i, "writer": writer}


def step_tree(step: int) -> dict[str, Any]:
    return make_tree(99, step)


def options() -> Any:
    import treestore

    return treestore.SaveOptions(chunk_size=64 * KiB, threads=2)


def _wait_for(path: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.002)


def run(job: dict[str, Any], emit: Any) -> None:
    import treestore

    url, p, mode = job["url"], int(job["index"]), job["mode"]
    store = treestore.Store(url)
    if mode == "race":
        for r in range(int(job["rounds"])):
            emit(f"ready {r}")
            _wait_for(f"{job['go']}.{r}")
            name = f"race-{r}"
            try:
                store.save(make_tree(p, r), name, options=options())
            except treestore.errors.CheckpointExistsError as exc:
                emit(f"lost {name} {type(exc).__name__}")
            else:
                emit(f"won {name}")
        return
    emit("ready")
    _wait_for(job["go"])
    if mode == "plain":
        for i in range(int(job["saves"])):
            name = f"w{p}-{i:03d}"
            store.save(make_tree(p, i), name, metadata={"writer": p, "i": i}, options=options())
            emit(f"committed {name}")
            if i % 4 == 3:
                old = f"w{p}-{i - 2:03d}"
                emit(f"deleting {old}")
                store.delete(old)
                emit(f"deleted {old}")
    elif mode == "manager":
        with treestore.CheckpointManager(
            url, retention=treestore.Retention(keep_last=3, keep_every=5), options=options()
        ) as m:
            for step in job["steps"]:
                m.save(step, step_tree(step), metrics={"loss": 1.0 / (step + 1)})
                m.wait()
                emit(f"committed step-{step:09d}")
    else:
        raise ValueError(mode)


def main() -> int:
    job = json.loads(sys.argv[1])
    fd = os.open(job["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(line: str) -> None:
        os.write(fd, (line.replace("\n", "\\n") + "\n").encode())

    try:
        run(job, emit)
    except BaseException:
        emit("error " + traceback.format_exc())
        return 1
    emit("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
