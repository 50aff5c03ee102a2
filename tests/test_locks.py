"""Lock records and how gc keeps its own lock (SPEC.md section 9), at the engine's level."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

import treestore
from treestore._engine import gc as _gc
from treestore._engine import locks as _locks
from treestore._format import layout as _layout


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
    real = store.storage.write

    def write(path: str, buffers: Any) -> None:
        writes.append(path)
        real(path, buffers)

    monkeypatch.setattr(store.storage, "write", write)
    monkeypatch.setattr(_gc, "STALE_AFTER", 0.0, raising=False)
    store.gc(grace=0)
    gc_writes = [p for p in writes if p.startswith(f"{_layout.LOCKS}/gc-")]
    assert len(set(gc_writes)) == 1 and len(gc_writes) > 1, f"gc never rewrote its lock: {gc_writes}"


def test_a_lock_record_names_its_process_identity():
    store = _store()
    with _locks.Lock(store.storage, "save") as lock:
        record = msgpack.unpackb(store.storage.read(lock.path), raw=False)
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    if os.path.exists("/proc/self/stat"):
        boot, _, ticks = record["start"].partition(":")
        assert boot == Path("/proc/sys/kernel/random/boot_id").read_text().strip() and ticks.isdigit()


def _lock(store: treestore.Store, record: Any, raw: bytes | None = None) -> str:
    path = f"{_layout.LOCKS}/gc-{uuid.uuid4().hex}"
    store.storage.write(path, [raw if raw is not None else msgpack.packb(record)])
    return path


def test_lock_ages():
    store = _store()
    s = store.storage
    now = time.time()
    mine = {"kind": "gc", "created": now, "host": socket.gethostname(), "pid": os.getpid()}
    assert _locks.lock_time(s, _lock(store, mine), None) == now  # a live process of this host
    other = {**mine, "start": "another-boot:1"}
    assert _locks.lock_time(s, _lock(store, other), None) == 0.0  # this pid, another process
    for bad in ({**mine, "created": float("inf")}, {**mine, "created": float("nan")}):
        assert _locks.lock_time(s, _lock(store, bad), 123.0) == 123.0  # ages by its mtime
    assert _locks.lock_time(s, _lock(store, None, raw=b"\x00" * 5000), 456.0) == 456.0
    assert _locks.lock_time(s, f"{_layout.LOCKS}/gc-{'0' * 32}", 789.0) == 0.0  # removed since listed
