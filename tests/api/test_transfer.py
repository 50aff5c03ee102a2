"""treestore.copy: checkpoints move between stores and backends, transferring only missing chunks."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

import treestore
from tests.support import hostile
from tests.support.helpers import assert_tree_equal
from treestore._format import paths as _paths

W = (np.random.default_rng(7).standard_normal((512, 512)) * 0.02).astype(np.float32)  # 1 MiB


def tree(step: int) -> dict:
    return {"w": W, "b": np.full(8, step, np.float32), "step": step, "name": "mlp"}


@pytest.fixture
def src(tmp_path):
    url = str(tmp_path / "src")
    treestore.save(url, tree(1), "step-1", metadata={"step": 1})
    treestore.save(url, tree(2), "step-2", metadata={"step": 2})
    return url


def memory() -> str:
    return f"memory://treestore-tests/{uuid.uuid4().hex}"


def test_copy_to_another_backend_and_back(src, tmp_path):
    mem = memory()
    done = []
    r = treestore.copy(f"{src}#step-1", mem, progress=lambda d, t: done.append((d, t)))
    assert r.copied == ("step-1",) and r.unchanged == ()
    assert r.chunks_copied == 2 and r.chunks_present == 0 and r.bytes_copied > 0
    assert done[-1][0] == done[-1][1] == W.nbytes + 8 * 4
    assert_tree_equal(treestore.load(mem, "step-1"), tree(1))
    info = {i.name: i for i in treestore.Store(src).list()}["step-1"]
    (copied,) = treestore.Store(mem).list()
    assert (copied.created, copied.metadata) == (info.created, info.metadata)
    # The second checkpoint shares layer w: only its pack travels.
    r = treestore.copy(src, mem)  # URL alone: the newest, step-2
    assert r.copied == ("step-2",) and (r.chunks_copied, r.chunks_present) == (1, 1)
    back = str(tmp_path / "back")
    treestore.copy(f"{mem}#step-2", back)
    assert_tree_equal(treestore.load(back), tree(2))
    assert treestore.verify(back).ok and treestore.verify(mem).ok
    assert hostile.storage(mem).list(_paths.LOCKS) == []


def test_same_manifest_bytes_when_the_name_is_kept(src):
    mem = memory()
    treestore.copy(f"{src}#step-1", mem)
    assert (
        hostile.commit_record(mem, "step-1")["manifest"] == hostile.commit_record(src, "step-1")["manifest"]
    )


def test_rename(src):
    mem = memory()
    r = treestore.copy(f"{src}#step-1", f"{mem}#first")
    assert r.copied == ("first",)
    assert treestore.Store(mem).manifest("first").name == "first"
    assert treestore.copy(f"{src}#step-1", mem, name="again").chunks_present == 2
    assert_tree_equal(treestore.load(mem, "again"), tree(1))
    with pytest.raises(treestore.InvalidInputError, match="given twice"):
        treestore.copy(f"{src}#step-1", f"{mem}#x", name="y")
    with pytest.raises(treestore.InvalidInputError):
        treestore.copy(f"{src}#step-1", f"{mem}#bad/name")


def test_existing_checkpoints(src):
    mem = memory()
    treestore.copy(f"{src}#step-1", mem)
    r = treestore.copy(f"{src}#step-1", mem)
    assert r.copied == () and r.unchanged == ("step-1",) and r.chunks_copied == 0
    with pytest.raises(treestore.errors.CheckpointExistsError, match="other contents"):
        treestore.copy(f"{src}#step-2", f"{mem}#step-1")
    r = treestore.copy(f"{src}#step-2", f"{mem}#step-1", overwrite=True)
    assert r.copied == ("step-1",)
    assert_tree_equal(treestore.load(mem, "step-1"), tree(2))


def test_copy_every_checkpoint(src):
    mem = memory()
    r = treestore.copy(src, mem, all_checkpoints=True)
    assert r.copied == ("step-1", "step-2") and r.chunks_copied == 3
    assert treestore.Store(mem).latest() == "step-2"
    with pytest.raises(treestore.InvalidInputError):
        treestore.copy(f"{src}#step-1", mem, all_checkpoints=True)
    with pytest.raises(treestore.InvalidInputError):
        treestore.copy(src, f"{mem}#x", all_checkpoints=True)


def test_damaged_source_chunk_is_not_propagated(src):
    (path,) = hostile.chunk_paths(src, "step-1")["w"]
    hostile.flip_byte(src, path, -1)
    mem = memory()
    with pytest.raises(treestore.errors.ChunkDamagedError) as info:
        treestore.copy(f"{src}#step-1", mem)
    assert info.value.address == "w" and info.value.checkpoint == "step-1"
    assert "nothing was committed" in str(info.value)
    assert not treestore.Store(mem).exists("step-1")
    assert not hostile.storage(mem).exists(path)
    assert hostile.storage(mem).list(_paths.LOCKS) == []


def test_missing_source(tmp_path):
    with pytest.raises(treestore.errors.CheckpointNotFoundError):
        treestore.copy(tmp_path / "nothing", memory())
    with pytest.raises(treestore.errors.CheckpointNotFoundError):
        treestore.copy(tmp_path / "nothing", memory(), all_checkpoints=True)


def test_a_packed_leaf_a_load_refuses_is_not_copied(src):
    """The pack object is sound, but leaf b's reference into it is damaged: load refuses it, so
    copy must too (naming the leaf), whether or not the destination already holds the pack."""

    def damage(m):
        (ref,) = next(leaf for leaf in m["leaves"] if leaf["address"] == "b")["chunks"]
        assert ref[3] == 0  # [digest, raw, stored, pack, offset]: a member of pack 0
        ref[0] = bytes([ref[0][0] ^ 1]) + ref[0][1:]

    mem = memory()
    treestore.copy(f"{src}#step-2", mem)  # the destination holds step-2's pack already
    hostile.mutate_manifest(src, "step-2", damage)
    with pytest.raises(treestore.errors.ChunkDamagedError):
        treestore.load(f"{src}#step-2")
    for dst in (memory(), f"{mem}#again"):
        with pytest.raises(treestore.errors.ChunkDamagedError) as info:
            treestore.copy(f"{src}#step-2", dst)
        assert info.value.address == "b" and info.value.checkpoint == "step-2"
        assert "nothing was committed" in str(info.value)
    assert [i.name for i in treestore.Store(mem).list()] == ["step-2"]


def test_a_copy_of_many_checkpoints_counts_each_chunk_once(tmp_path):
    """Five checkpoints sharing one big leaf: the report counts chunk objects, not references
    to them (a store of 55 chunks was reported as "251 already there")."""
    url = str(tmp_path / "five")
    for step in range(5):
        treestore.save(url, tree(step), f"step-{step}")
    stored = len(hostile.storage(url).list(_paths.CHUNKS))
    mem = memory()
    r = treestore.copy(url, mem, all_checkpoints=True)
    assert (r.chunks_copied, r.chunks_present) == (stored, 0)
    assert len(hostile.storage(mem).list(_paths.CHUNKS)) == stored
    again = memory()
    treestore.copy(f"{url}#step-0", again)
    held = len(hostile.storage(again).list(_paths.CHUNKS))
    r = treestore.copy(url, again, all_checkpoints=True)
    assert r.unchanged == ("step-0",) and r.chunks_copied == stored - held
    assert 1 <= r.chunks_present <= held  # the shared leaf's chunks at least, each once
    assert len(hostile.storage(again).list(_paths.CHUNKS)) == stored
