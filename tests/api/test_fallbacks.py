"""Paths taken when something is wrong but work can go on, and refusals of what cannot: a step
damaged locally restored from the remote tier, a remote tier that cannot be listed, and a remote
import source that is not what an import reads."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

import fsspec
import msgpack
import numpy as np
import pytest

import treestore
from tests.api.test_two_tier import tree
from tests.support import hostile
from tests.support.faults import FaultyMemoryFileSystem
from tests.support.helpers import assert_tree_equal
from treestore._api.interop import hf_shards
from treestore._format.paths import step_name


# --- two tiers -----------------------------------------------------------------------------------
def _damage_local(local: str, step: int) -> None:
    """Flip a byte of every chunk of ``step`` in the local tier (its manifest intact)."""
    for paths in hostile.chunk_paths(local, step_name(step)).values():
        for path in paths:
            hostile.flip_byte(local, path, 100)


def test_a_step_damaged_locally_is_restored_from_the_remote_tier(tmp_path, caplog):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    with treestore.CheckpointManager(local=local, remote=remote) as m:
        m.save(0, tree(0))
        m.wait()
    _damage_local(local, 0)
    with pytest.raises(treestore.DamagedError):
        treestore.Store(local).load(step_name(0))
    with (
        treestore.CheckpointManager(local=local, remote=remote) as m,
        caplog.at_level(logging.WARNING, "treestore"),
    ):
        assert_tree_equal(m.restore(step=0), tree(0))
    warned = [r.getMessage() for r in caplog.records if "damaged locally" in r.getMessage()]
    assert len(warned) == 1 and step_name(0) in warned[0] and remote in warned[0], warned


def test_a_step_damaged_locally_that_the_remote_lacks_is_an_error(tmp_path):
    """The remote tier has other steps but not this one: the local damage is the answer."""
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    with treestore.CheckpointManager(
        local=local, remote=treestore.RemoteTier(remote, replicate_every_steps=2)
    ) as m:
        m.save(0, tree(0))
        m.save(1, tree(1))  # not replicated
        m.wait()
    assert treestore.CheckpointManager(remote).steps() == [0]
    _damage_local(local, 1)
    with treestore.CheckpointManager(local=local, remote=remote) as m:
        with pytest.raises(treestore.DamagedError) as caught:
            m.restore(step=1)
        assert caught.value.checkpoint == step_name(1)
        assert_tree_equal(m.restore(step=0), tree(0))  # the local copy of step 0 is sound


def test_a_damaged_step_of_a_single_tier_is_an_error(tmp_path):
    local = str(tmp_path / "local")
    with treestore.CheckpointManager(local) as m:
        m.save(0, tree(0))
        m.wait()
    _damage_local(local, 0)
    with treestore.CheckpointManager(local) as m, pytest.raises(treestore.DamagedError):
        m.restore(step=0)


def test_a_remote_tier_that_cannot_be_listed_leaves_the_local_steps(tmp_path, faultmem, caplog):
    local = str(tmp_path / "local")
    with treestore.CheckpointManager(local=local, remote=faultmem) as m:
        m.save(3, tree(3))
        m.wait()
    assert treestore.CheckpointManager(faultmem).steps() == [3]
    FaultyMemoryFileSystem.unlistable = {FaultyMemoryFileSystem._strip_protocol(faultmem) + "/checkpoints"}
    treestore.Store(local).delete(step_name(3))
    with treestore.CheckpointManager(local) as alone:
        alone.save(5, tree(5))
    with (
        treestore.CheckpointManager(local=local, remote=faultmem) as m,
        caplog.at_level(logging.WARNING, "treestore"),
    ):
        assert m.steps() == [5]  # the remote's step 3 is out of sight
        assert_tree_equal(m.restore(), tree(5))
    warned = [r.getMessage() for r in caplog.records if "listing the remote tier failed" in r.getMessage()]
    assert warned and "using the local tier only" in warned[0], warned


# --- what a remote import refuses --------------------------------------------------------------
def _memory_folder(files: dict[str, bytes]) -> str:
    """A memory:// folder holding ``files`` (name -> bytes); its URL."""
    fs = fsspec.filesystem("memory")
    root = f"/remote-import-{uuid.uuid4().hex}"
    for name, data in files.items():
        fs.pipe_file(f"{root}/{name}", data)
    return f"memory://{root}"


def _no_store(url: str) -> None:
    assert treestore.Store(url).list() == []


def test_a_remote_folder_without_one_index_is_refused():
    dst = f"memory://treestore-tests/{uuid.uuid4().hex}"
    folder = _memory_folder({"a.safetensors": b"x", "notes.txt": b"y"})
    with pytest.raises(treestore.InvalidInputError) as caught:
        treestore.import_file(folder, dst)
    assert str(caught.value).startswith(f"{folder} holds 0 safetensors indexes; only a file or a folder")
    _no_store(dst)


def test_a_remote_index_over_its_cap_is_not_copied(monkeypatch):
    monkeypatch.setattr(hf_shards, "INDEX_BYTES", 100)
    index = json.dumps({"weight_map": {f"t{i}": "model-1.safetensors" for i in range(20)}}).encode()
    folder = _memory_folder({"model.safetensors.index.json": index})
    dst = f"memory://treestore-tests/{uuid.uuid4().hex}"
    with pytest.raises(treestore.InvalidInputError) as caught:
        treestore.import_file(f"{folder}/model.safetensors.index.json", dst)
    assert f"{len(index):,} bytes, more than the 100 read of such a file" in str(caught.value)
    _no_store(dst)


def test_a_remote_shard_that_is_a_folder_is_refused():
    index = json.dumps({"weight_map": {"w": "model-1.safetensors"}}).encode()
    folder = _memory_folder({"model.safetensors.index.json": index, "model-1.safetensors/inner": b"z"})
    dst = f"memory://treestore-tests/{uuid.uuid4().hex}"
    with pytest.raises(treestore.InvalidInputError) as caught:
        treestore.import_file(folder, dst)
    assert str(caught.value).endswith("model-1.safetensors: expected a file, found a directory")
    _no_store(dst)


def test_a_url_of_no_known_filesystem_is_refused():
    with pytest.raises(
        treestore.InvalidInputError, match=r"^no filesystem for 'nosuchfs://a/b.safetensors': "
    ):
        treestore.import_file("nosuchfs://a/b.safetensors", f"memory://treestore-tests/{uuid.uuid4().hex}")


# --- watch -----------------------------------------------------------------------------------------
def test_a_watch_whose_listing_fails_retries_at_the_next_poll(faultmem, caplog):
    """A listing that fails (a network blip) ends no watch: it is logged and retried; an object
    under checkpoints/ that is no commit record (a writer's temporary) is passed over."""
    treestore.save(faultmem, {"w": np.ones(2)}, "a")
    root = FaultyMemoryFileSystem._strip_protocol(faultmem)
    FaultyMemoryFileSystem().pipe_file(f"{root}/checkpoints/.tmp-{uuid.uuid4().hex}", b"half a record")
    FaultyMemoryFileSystem.unlistable = {f"{root}/checkpoints"}
    seen: list[str] = []

    def heal() -> None:
        while not any("listing failed, retrying" in r.getMessage() for r in caplog.records):
            time.sleep(0.01)
        FaultyMemoryFileSystem.unlistable = set()

    with caplog.at_level(logging.WARNING, "treestore"):
        healer = threading.Thread(target=heal, daemon=True)
        healer.start()
        for ckpt in treestore.watch(faultmem, timeout=10, min_poll=0.02, max_poll=0.05):
            seen.append(ckpt.name)
            break
        healer.join(10)
    assert seen == ["a"]
    warned = [r.getMessage() for r in caplog.records if "listing failed, retrying" in r.getMessage()]
    assert warned and "injected fault: cannot list" in warned[0], warned


# --- locks of processes that cannot be asked about -----------------------------------------------
def test_a_save_lock_of_a_pid_no_system_call_takes_counts_as_live(tmp_path):
    """A lock of this host whose pid no signal can be sent to (beyond the system's range) may be
    a live writer's: gc defers to it, naming it, until it is older than the stale limit."""
    import socket

    url = str(tmp_path / "store")
    treestore.save(url, {"x": np.zeros(3)}, "init")
    lock = tmp_path / "store" / "locks" / f"save-{uuid.uuid4().hex}"
    record = {"kind": "save", "created": time.time(), "host": socket.gethostname(), "pid": 2**63 - 1}
    lock.write_bytes(msgpack.packb(record))
    with pytest.raises(treestore.errors.StoreBusyError) as caught:
        treestore.Store(url).gc(grace=0, wait=0)
    assert f"1 save(s) in flight; gc deferred (locks: locks/{lock.name};" in str(caught.value)
    assert lock.exists()
    time.sleep(0.6)
    report = treestore.Store(url).gc(grace=0, wait=0, stale_after=0.5)
    assert report.locks_removed == 1 and not lock.exists()
    assert np.array_equal(treestore.load(url, "init")["x"], np.zeros(3))


@pytest.mark.parametrize("what", ["checkpoints", "manifests"])
def test_a_watch_whose_reads_fail_retries_at_the_next_poll(faultmem, caplog, what):
    """A commit record, or the manifest it names, that cannot be read for a while (a network
    blip) is logged and read again at the next poll; the checkpoint comes once it reads."""
    treestore.save(faultmem, {"w": np.ones(2)}, "a")
    root = FaultyMemoryFileSystem._strip_protocol(faultmem)
    FaultyMemoryFileSystem.unreadable = (f"{root}/{what}/",)

    def heal() -> None:
        while not any("reading 'a' failed, retrying" in r.getMessage() for r in caplog.records):
            time.sleep(0.01)
        FaultyMemoryFileSystem.unreadable = ()

    seen = []
    with caplog.at_level(logging.WARNING, "treestore"):
        healer = threading.Thread(target=heal, daemon=True)
        healer.start()
        for ckpt in treestore.watch(faultmem, timeout=10, min_poll=0.02, max_poll=0.05):
            seen.append((ckpt.name, np.asarray(ckpt["w"]).tolist()))
            break
        healer.join(10)
    assert seen == [("a", [1.0, 1.0])]
    warned = [r.getMessage() for r in caplog.records if "reading 'a' failed, retrying" in r.getMessage()]
    assert warned and f"injected fault: cannot read {root}/{what}/" in warned[0], warned


def test_retention_on_the_remote_tier_that_fails_is_logged_and_runs_again(tmp_path, faultmem, caplog):
    """The copy of a step is committed; the remote's retention cannot delete an old step (a
    delete refused): it is logged, the step stays, and the next replication's retention runs."""
    root = FaultyMemoryFileSystem._strip_protocol(faultmem)
    local = str(tmp_path / "local")
    manager = treestore.CheckpointManager(local=local, remote=treestore.RemoteTier(faultmem, keep_last=1))
    with caplog.at_level(logging.WARNING, "treestore"), manager as m:
        m.save(0, tree(0))
        m.wait()
        FaultyMemoryFileSystem.undeletable = (f"{root}/checkpoints/",)
        m.save(1, tree(1))
        m.wait()
        assert treestore.CheckpointManager(faultmem).steps() == [0, 1]  # step 0 could not go
        FaultyMemoryFileSystem.undeletable = ()
        m.save(2, tree(2))
        m.wait()
    assert treestore.CheckpointManager(faultmem).steps() == [2]
    assert_tree_equal(treestore.Store(faultmem).load(step_name(2)), tree(2))  # gc kept what it uses
    warned = [r.getMessage() for r in caplog.records if "retention after replicating" in r.getMessage()]
    assert len(warned) == 1 and step_name(1) in warned[0] and "injected fault" in warned[0], warned
