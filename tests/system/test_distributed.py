"""Two real jax.distributed processes save sharded arrays; other layouts restore them exactly."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treestore
from tests.engine.test_stats import check as check_stats
from tests.scripts.distributed_worker import expected
from tests.support import servers
from tests.support.process_jobs import run_processes
from treestore._engine.reading import committed as _committed
from treestore._format.manifest.codec import decode_any
from treestore._format.manifest.frame import Frame

WORKER = Path(__file__).parent.parent / "scripts" / "distributed_worker.py"


def run_job(store: str, mode: str, processes: int = 2) -> list[str]:
    """Run the worker's ``mode`` in a job of ``processes`` processes; each one's output."""
    port = servers.free_port()
    outputs = run_processes(
        lambda i: [str(WORKER), str(port), str(i), str(processes), store, mode], processes, timeout=180
    )
    for i, (code, out) in enumerate(outputs):
        assert code == 0 and f"OK {i}" in out, f"process {i} failed:\n{out[-3000:]}"
    return [out for _, out in outputs]


@pytest.mark.timeout(400)
def test_two_processes_save_then_restore_elsewhere(tmp_path):
    store = str(tmp_path / "store")
    run_job(store, "save")
    manifest = treestore.Store(store).manifest("dist")
    by = {e.address: e for e in manifest.leaves}
    assert len(by["w"].pieces) == 4 and len(by["v"].pieces) == 4 and not by["r"].pieces
    assert manifest.metadata == {"processes": 2}
    assert treestore.Store(store)._storage.list("staging") == []  # the outcome record cleaned up
    storage = treestore.Store(store)._storage
    frame = decode_any(
        _committed.read_manifest_bytes(storage, _committed.read_commit_record(storage, "dist")), "dist"
    )
    assert isinstance(frame, Frame) and len(frame.parts) == 2  # each process's pieces in its part
    # Each process measured its shards (replica 0 only); the primary combined them at commit,
    # into the frame: read without any part or chunk.
    stats = treestore.open(f"{store}#dist").stats()
    for k, v in expected().items():
        check_stats(stats[k], v)

    # One process, four devices, another layout.
    values = expected()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    specs = {"w": P("b", "a"), "v": P("a"), "r": P(None, "b")}
    like = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
        for k, v in values.items()
    }
    out = treestore.load(store, "dist", like=like)
    for k, v in values.items():
        assert np.asarray(out[k]).tobytes() == v.tobytes(), k
    # No template: host arrays.
    plain = treestore.load(store, "dist")
    assert all(np.asarray(plain[k]).tobytes() == v.tobytes() for k, v in values.items())

    # Two processes again, under another partition spec.
    run_job(store, "load")


@pytest.mark.timeout(400)
def test_a_failing_process_means_no_commit(tmp_path):
    store = str(tmp_path / "store")
    treestore.save(store, {"earlier": np.arange(10)}, "earlier")
    run_job(store, "fail")
    s = treestore.Store(store)
    assert [c.name for c in s.list()] == ["earlier"]
    assert np.array_equal(s.load("earlier")["earlier"], np.arange(10))


@pytest.mark.timeout(400)
def test_a_process_that_never_saves_is_named_when_the_barrier_times_out(tmp_path):
    store = str(tmp_path / "store")
    outputs = run_job(store, "absent")
    assert "raised BarrierTimeoutError: multi-process save of checkpoint 'absent'" in outputs[0]
    assert "barrier 'written': process 1 (of 2) did not arrive within 3 s" in outputs[0], outputs[0][-3000:]
    s = treestore.Store(store)
    assert s.list() == [] and s._storage.list("locks") == []
