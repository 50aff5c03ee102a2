"""treestore.verify: every problem of a store is found and named, and a healthy store is clean."""

from __future__ import annotations

import json
import os
import uuid

import msgpack
import numpy as np
import pytest

import treestore
from tests.support import hostile
from treestore._format import paths as _paths

W = (np.random.default_rng(5).standard_normal((256, 1024)) * 0.02).astype(np.float32)  # 1 MiB


@pytest.fixture
def two(store_url):
    """Two checkpoints sharing the chunk of layer/w; step-2 changes layer/b."""
    tree = {"layer": {"w": W, "b": np.arange(8, dtype=np.float32)}, "step": 1}
    treestore.save(store_url, tree, "step-1")
    tree = {"layer": {"w": W, "b": np.arange(8, dtype=np.float32) + 1}, "step": 2}
    treestore.save(store_url, tree, "step-2")
    return store_url


def test_healthy_store(two):
    seen = []
    report = treestore.verify(two, progress=lambda done, total: seen.append((done, total)))
    assert report.ok and report.problems == ()
    assert report.checkpoints == ("step-1", "step-2")
    assert report.chunks_checked == 3  # layer/w once, and one pack per checkpoint
    assert report.bytes_checked == W.nbytes + 2 * 32
    assert seen[-1] == (report.bytes_checked, report.bytes_checked)
    assert json.loads(json.dumps(report.to_json()))["ok"] is True


def test_one_checkpoint(two):
    report = treestore.verify(f"{two}#step-1", storage_options={})
    assert report.checkpoints == ("step-1",) and report.chunks_checked == 2 and report.ok


def test_shared_damaged_chunk_is_reported_for_every_checkpoint(two):
    (path,) = hostile.chunk_paths(two, "step-1")["layer/w"]
    hostile.flip_byte(two, path, -1)
    report = treestore.verify(two)
    assert not report.ok
    assert [(p.checkpoint, p.address, p.kind) for p in report.problems] == [
        ("step-1", "layer/w", "chunk_damaged"),
        ("step-2", "layer/w", "chunk_damaged"),
    ]
    assert all("layer/w: chunk" in p.message and p.checkpoint in p.message for p in report.problems)


def test_missing_chunk_and_damaged_pack_are_all_collected(two):
    paths = hostile.chunk_paths(two, "step-2")
    hostile.storage(two).delete(paths["layer/w"][0])
    hostile.flip_byte(two, paths["<pack 0>"][0], 20)
    problems = {(p.checkpoint, p.address, p.kind) for p in treestore.verify(two).problems}
    assert problems == {
        ("step-1", "layer/w", "chunk_missing"),
        ("step-2", "layer/w", "chunk_missing"),
        ("step-2", "layer/b", "chunk_damaged"),  # "step", a Python int, lives in the manifest
    }


def test_pack_slice_that_does_not_match_its_leaf(two):
    def shift(rec):
        for leaf in rec["leaves"]:
            if leaf["address"] == "layer/b":
                leaf["chunks"][0][0] = bytes(32)  # a digest no slice of the pack has

    hostile.mutate_manifest(two, "step-1", shift)
    (problem,) = treestore.verify(f"{two}#step-1").problems
    assert (problem.address, problem.kind) == ("layer/b", "chunk_damaged")
    assert "do not match the leaf's digest" in problem.message


def test_unreadable_manifest_and_commit_record(two):
    ref = hostile.commit_record(two, "step-1")
    hostile.truncate(two, _paths.manifest_path(ref["manifest"]), 10)
    hostile.storage(two).write(_paths.record_path("step-2"), [b"\xc1garbage"])
    report = treestore.verify(two)
    kinds = {(p.checkpoint, p.address, p.kind) for p in report.problems}
    assert kinds == {("step-1", None, "manifest"), ("step-2", None, "commit_record")}
    assert report.chunks_checked == 0


def test_commit_record_that_disagrees_with_its_manifest(two):
    s = hostile.storage(two)
    ref = hostile.commit_record(two, "step-2")
    ref["leaves"] = 99
    s.write(_paths.record_path("step-2"), [msgpack.packb(ref, use_bin_type=True)])  # check digest stale
    (problem,) = treestore.verify(two).problems
    assert problem.kind == "commit_record" and "check digest" in problem.message
    hostile.write_commit_record(two, "step-2", ref)  # consistent record, but it disagrees with the manifest
    (problem,) = treestore.verify(two).problems
    assert problem.checkpoint == "step-2" and "does not match its manifest" in problem.message


def test_nothing_to_verify(tmp_path):
    with pytest.raises(treestore.errors.CheckpointNotFoundError, match="no treestore store at"):
        treestore.verify(tmp_path / "nothing")
    treestore.save(tmp_path / "empty", {"x": 1}, "a")
    treestore.Store(tmp_path / "empty").delete("a")
    with pytest.raises(treestore.errors.CheckpointNotFoundError, match="no checkpoints in store"):
        treestore.verify(tmp_path / "empty")
    treestore.save(tmp_path / "s", {"x": 1}, "a")
    with pytest.raises(treestore.errors.CheckpointNotFoundError, match="'b'"):
        treestore.verify(f"{tmp_path / 's'}#b")
    with pytest.raises(treestore.InvalidInputError):
        treestore.verify("nosuchproto://x")


@pytest.mark.parametrize("codec", [treestore.Codec("raw"), treestore.Codec(byte_planes=True)])
def test_damage_behind_a_sound_header_lives_on_until_a_repair_from_a_copy(store_url, codec):
    """A flipped bit in a chunk's body passes the reuse check (it reads the size and header
    only) and a save trusts the newest checkpoint's chunks anyway: the damage is referenced by
    every later checkpoint. verify finds it; verify with repair_from rewrites the chunk from an
    intact copy (a backup or the remote tier), after which every checkpoint loads exactly."""
    backup = f"memory://treestore-tests/backup-{uuid.uuid4().hex}"
    store = treestore.Store(store_url)
    store.save({"w": W}, "step-1", codec=codec)
    treestore.copy(f"{store_url}#step-1", backup)
    (path,) = hostile.chunk_paths(store_url, "step-1")["w"]
    hostile.flip_byte(store_url, path, -5)  # inside the body, whatever the codec
    for trust in (True, False):  # trusted as the newest's, or checked by the reuse check
        store.save({"w": W, "n": int(trust)}, f"step-{2 + trust}", trust_previous=trust)
    report = treestore.verify(store_url)
    assert {(p.checkpoint, p.address) for p in report.problems} == {
        ("step-1", "w"),
        ("step-2", "w"),
        ("step-3", "w"),
    }
    assert report.repaired == ()
    fixed = treestore.verify(store_url, repair_from=backup)
    assert fixed.ok and len(fixed.repaired) == 1, fixed.problems
    for name in ("step-1", "step-2", "step-3"):
        assert treestore.load(f"{store_url}#{name}")["w"].tobytes() == W.tobytes()


def test_a_repair_source_without_an_intact_copy_repairs_nothing(two):
    """A source that lacks the chunk, or holds it damaged too, repairs nothing: what it holds is
    checked against the chunk's digest before it is written."""
    lacking = f"memory://treestore-tests/other-{uuid.uuid4().hex}"
    treestore.save(lacking, {"x": np.ones(3)}, "unrelated")
    damaged = f"memory://treestore-tests/damaged-{uuid.uuid4().hex}"
    treestore.copy(f"{two}#step-1", damaged)
    (path,) = hostile.chunk_paths(two, "step-1")["layer/w"]
    hostile.flip_byte(two, path, -1)
    hostile.flip_byte(damaged, path, -2)
    for source in (lacking, damaged):
        report = treestore.verify(two, repair_from=source)
        assert report.repaired == () and len(report.problems) == 2


def test_cli_verify_repair_from(two, tmp_path):
    from click.testing import CliRunner

    from treestore_cli.main import cli

    backup = str(tmp_path / "backup")
    treestore.copy(f"{two}#step-2", backup)
    (path,) = hostile.chunk_paths(two, "step-1")["layer/w"]
    hostile.flip_byte(two, path, -1)
    broken = CliRunner().invoke(cli, ["verify", two])
    assert broken.exit_code == 1 and "chunk_damaged" in broken.output
    fixed = CliRunner().invoke(cli, ["verify", two, "--repair-from", backup])
    assert fixed.exit_code == 0, fixed.output
    assert "repaired 1 chunk(s)" in fixed.output and "ok: every digest matches" in fixed.output


@pytest.mark.parametrize("planted", ["link", "fifo"])
def test_a_link_or_fifo_in_the_repair_source_is_reported_and_the_rest_repaired(tmp_path, planted):
    """A link (to a file outside the store) or a FIFO under a chunk's name in the source: that
    chunk stays unrepaired and reported, and every other damaged chunk is still repaired."""
    url, backup = str(tmp_path / "store"), str(tmp_path / "backup")
    rng = np.random.default_rng(0)
    tree = {k: rng.standard_normal(40_000).astype(np.float32) for k in ("a", "b", "c")}
    treestore.save(url, tree, "s")
    treestore.copy(f"{url}#s", backup)
    paths = hostile.chunk_paths(url, "s")
    for k in ("a", "b", "c"):
        hostile.flip_byte(url, paths[k][0], -3)
    target = os.path.join(backup, paths["a"][0])
    os.remove(target)
    if planted == "link":
        outside = tmp_path / "outside"
        outside.write_bytes(b"x" * 100)
        os.symlink(outside, target)
    else:
        os.mkfifo(target)
    report = treestore.verify(url, repair_from=backup)
    assert len(report.repaired) == 2
    assert [p.address for p in report.problems] == ["a"]
    loaded = treestore.load(url, "s", select=["b", "c"])
    assert all(loaded[k].tobytes() == tree[k].tobytes() for k in ("b", "c"))
