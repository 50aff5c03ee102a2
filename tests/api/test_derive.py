"""Derived checkpoints (Store.derive, `treestore derive`): subtrees set, dropped and renamed
without rewriting the rest; the result is an ordinary checkpoint."""

from __future__ import annotations

import contextlib
import inspect
import shutil
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from click.testing import CliRunner

import treestore
from tests.support.counting import CountingFileSystem
from tests.support.helpers import assert_tree_equal
from treestore._engine import locks
from treestore.errors import CheckpointExistsError, CheckpointNotFoundError, InvalidInputError, NoMatchError
from treestore_cli.main import cli

RNG = np.random.default_rng(5)


def _w(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.02).astype(np.float32)


ENC = {"w": _w(256, 256), "b": _w(256)}  # w: 256 KiB, its own chunk; b: packed
HEAD = {"w": _w(256, 10), "b": _w(10)}
OPT = {"mu": {"enc": np.zeros((256, 256), np.float32)}, "count": 3}


def base_tree() -> dict:
    return {"enc": ENC, "head": HEAD, "opt": OPT, "step": 100}


def chunk_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in (root / "chunks").rglob("*") if p.is_file()}


def objects(root: Path, folder: str) -> set[str]:
    return {p.name for p in (root / folder).rglob("*") if p.is_file()}


@pytest.fixture
def local(tmp_path: Path) -> tuple[treestore.Store, Path]:
    root = tmp_path / "store"
    store = treestore.Store(str(root))
    store.save(base_tree(), "base", metadata={"step": 100})
    return store, root


def test_swap_head_writes_only_the_new_chunks(local):
    store, root = local
    new_head = {"w": _w(256, 10) + 1, "b": _w(10)}
    before = chunk_files(root)
    r = store.derive("base", "swapped", set={"head": new_head})
    added = chunk_files(root) - before
    # head/w (10 KiB) and head/b are small: one new pack holds both; nothing else is written.
    assert r.chunks_written == len(added) == 1 and r.leaves == 7
    assert_tree_equal(store.load("swapped"), {**base_tree(), "head": new_head})
    d = treestore.diff(f"{store.url}#base", f"{store.url}#swapped")
    assert d.changed == ("head/b", "head/w") and not d.added and not d.removed
    assert set(d.unchanged) == {"enc/b", "enc/w", "opt/count", "opt/mu/enc", "step"}
    assert treestore.verify(f"{store.url}#swapped").ok
    assert store.open("swapped").metadata == {"step": 100}  # the base's metadata, by default


def test_a_new_leaf_equal_to_a_base_chunk_costs_no_request(local):
    """The base's chunks are read under the derive's lock, so a new leaf whose chunk the base
    already holds is referenced without an existence check (and reported as known)."""
    store, _ = local
    r = store.derive("base", "copied", set={"extra": ENC["w"].copy()})
    assert (r.chunks_trusted, r.chunks_written, r.existence_checks, r.trusted_from) == (1, 0, 0, "base")
    assert_tree_equal(store.load("copied")["extra"], ENC["w"])


def test_drop_optimizer_state_writes_no_chunk(local):
    store, root = local
    before, manifests = chunk_files(root), objects(root, "manifests")
    r = store.derive("base", "weights", drop="opt/**", metadata={"for": "serving"})
    assert r.chunks_written == 0 and chunk_files(root) == before
    assert len(objects(root, "manifests") - manifests) == 1  # only a new manifest
    expected = base_tree()
    del expected["opt"]  # its emptied container goes too
    assert_tree_equal(store.load("weights"), expected)
    d = treestore.diff(f"{store.url}#base", f"{store.url}#weights")
    assert d.removed == ("opt/count", "opt/mu/enc") and not d.added and not d.changed
    assert store.open("weights").metadata == {"for": "serving"}
    # A pattern may name a subtree itself, and '*' a whole segment.
    store.derive("base", "no-mu", drop="opt/mu")
    assert set(store.open("no-mu").leaves) == {"enc/b", "enc/w", "head/b", "head/w", "opt/count", "step"}


def test_rename_keeps_chunks_and_key_order(local):
    store, root = local
    before = chunk_files(root)
    store.derive("base", "renamed", rename={"enc": "encoder", "head": "model/head"})
    assert chunk_files(root) == before
    loaded = store.load("renamed")
    assert list(loaded) == ["encoder", "model", "opt", "step"]  # each in the place of its source
    assert_tree_equal(loaded["encoder"], ENC)
    assert_tree_equal(loaded["model"], {"head": HEAD})
    d = treestore.diff(f"{store.url}#base", f"{store.url}#renamed")
    assert set(d.removed) == {"enc/b", "enc/w", "head/b", "head/w"}
    assert set(d.added) == {"encoder/b", "encoder/w", "model/head/b", "model/head/w"}
    a, b = store.manifest("base"), store.manifest("renamed")
    old = {e.address: e.digest for e in a.leaves}
    new = {e.address: e.digest for e in b.leaves}
    assert new["encoder/w"] == old["enc/w"] and new["model/head/b"] == old["head/b"]
    assert treestore.verify(f"{store.url}#renamed").ok


def test_all_three_at_once_and_gc_after_deleting_the_base(local):
    store, root = local
    head = {"w": np.ones((256, 10), np.float32)}
    store.derive("base", "d", set={"head": head}, drop=["opt/**"], rename={"enc": "encoder"})
    expected = {"encoder": ENC, "head": head, "step": 100}
    opt_chunk = store.open("base")["opt/mu/enc"].entry.chunks[0].digest.hex()
    store.delete("base")
    report = store.gc(grace=0)
    # opt/mu/enc's chunk goes; the base's pack stays, as enc/b (kept) lies in it.
    assert report.chunks_removed == 1 and not (root / "chunks" / opt_chunk[:2] / opt_chunk).exists()
    assert_tree_equal(store.load("d"), expected)
    assert treestore.verify(str(root)).ok


def test_derive_reads_no_chunk():
    CountingFileSystem.reset()
    url = "counting://derive/store"
    store = treestore.Store(url)
    store.save(base_tree(), "base")
    CountingFileSystem.reset()
    store.derive("base", "d", drop="opt/**", rename={"enc": "e"}, set={"extra": np.arange(3)})
    assert not [p for p in CountingFileSystem.paths_read() if "/chunks/" in p]
    assert_tree_equal(store.load("d")["e"], ENC)


def test_packs_still_needed_are_kept_and_renumbered(tmp_path):
    # 1000-byte leaves, four to a 4 KiB pack: the derived checkpoint keeps only packs it uses.
    options = treestore.SaveOptions(chunk_size=4096, small_leaf=4096, pack_size=4096)
    small = {f"l{i:02d}": np.full(250, i, np.float32) for i in range(12)}
    store = treestore.Store(str(tmp_path / "s"))
    store.save({"a": small, "n": 1}, "base", options=options)
    base = store.manifest("base")
    assert len(base.packs) == 3
    keep = {k: v for k, v in small.items() if k >= "l04"}
    new_leaf = np.full(250, 99.0, np.float32)
    store.derive("base", "d", drop=[f"a/l{i:02d}" for i in range(4)], set={"b": new_leaf}, options=options)
    m = store.manifest("d")
    assert {p.digest for p in m.packs[:2]} == {p.digest for p in base.packs[1:]} and len(m.packs) == 3
    assert_tree_equal(store.load("d"), {"a": keep, "n": 1, "b": new_leaf})
    assert treestore.verify(f"{store.url}#d").ok


class Adam(NamedTuple):
    mu: dict
    nu: dict


def test_untouched_custom_nodes_keep_their_type(tmp_path):
    tree = {"params": {"w": _w(4, 4)}, "opt": Adam({"w": np.zeros((4, 4))}, {"w": np.ones((4, 4))})}
    store = treestore.Store(str(tmp_path / "s"))
    store.save(tree, "base")
    new_w = _w(4, 4)
    store.derive("base", "d", set={"params/w": new_w})
    like = {"opt": tree["opt"], "params": {"w": new_w}}  # in jax's order, as load(like=) returns it
    loaded = store.load("d", like=like)
    assert type(loaded["opt"]) is Adam
    assert_tree_equal(loaded, like)
    # An attribute of a custom node can be set in place and renamed within its node.
    store.derive("base", "d2", set={"opt/.nu/w": np.full((4, 4), 2.0)}, rename={"params": "p"})
    assert np.array_equal(store.load("d2")["opt"]["nu"]["w"], np.full((4, 4), 2.0))
    assert store.manifest("d2").tree["children"][1]["type"] == "namedtuple"


def test_errors_commit_nothing(local):
    store, _ = local
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint 'missing'"):
        store.derive("missing", "d", drop="opt/**")
    with pytest.raises(NoMatchError, match=r"pattern 'optimizer/\*\*' matches no leaf"):
        store.derive("base", "d", drop="optimizer/**")
    with pytest.raises(NoMatchError, match=r"no leaf or subtree 'encoder'.*nearest"):
        store.derive("base", "d", rename={"encoder": "x"})
    with pytest.raises(InvalidInputError, match="conflicts with rename 'enc' -> 'encoder'"):
        store.derive("base", "d", rename={"enc": "encoder"}, set={"encoder/w": np.ones(2)})
    with pytest.raises(InvalidInputError, match="conflicts with drop"):
        store.derive("base", "d", rename={"opt/mu": "mu"}, drop="opt/**")
    with pytest.raises(InvalidInputError, match="already has 'head'"):
        store.derive("base", "d", rename={"enc": "head"})
    with pytest.raises(InvalidInputError, match="'step' is a leaf"):
        store.derive("base", "d", set={"step/x": np.ones(2)})
    with pytest.raises(InvalidInputError, match="overlap"):
        store.derive("base", "d", set={"head": 1, "head/w": 2})
    with pytest.raises(treestore.errors.UnsupportedLeafError, match="set 'head'"):
        store.derive("base", "d", set={"head": {"w": object()}})
    with pytest.raises(CheckpointExistsError, match="'base' already exists"):
        store.derive("base", "base", drop="opt/**")
    assert [c.name for c in store.list()] == ["base"]
    store.derive("base", "base", drop="opt/**", overwrite=True)
    assert "opt/count" not in store.open("base").leaves


def test_adds_new_subtrees_creating_dicts(local):
    store, _ = local
    store.derive("base", "d", set={"extra/lora/a": np.ones(3), "head/w": np.zeros(2)})
    loaded = store.load("d")
    assert np.array_equal(loaded["extra"]["lora"]["a"], np.ones(3))
    assert np.array_equal(loaded["head"]["w"], np.zeros(2)) and "b" in loaded["head"]


def test_derive_on_s3(s3_backend):
    url = s3_backend.url("derive")
    store = treestore.Store(url, storage_options=s3_backend.storage_options)
    store.save(base_tree(), "base")
    head = {"w": np.ones((256, 10), np.float32), "b": np.zeros(10, np.float32)}
    r = store.derive("base", "d", set={"head": head}, drop="opt/**", rename={"enc": "encoder"})
    assert r.chunks_written == 1
    assert_tree_equal(store.load("d"), {"encoder": ENC, "head": head, "step": 100})
    assert treestore.verify(f"{url}#d", storage_options=s3_backend.storage_options).ok


def test_cli_derive(local, tmp_path):
    store, root = local
    npz = tmp_path / "head.npz"
    np.savez(npz, **{"w": np.ones((256, 10), np.float32), "b": np.zeros(10, np.float32)})
    args = ["derive", f"{root}#base", "d", "--drop", "opt/**", "--rename", "enc=encoder"]
    result = CliRunner().invoke(cli, [*args, "--set", f"head={npz}"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"derived {store.url}#d from base: 5 leaves")
    loaded = store.load("d")
    assert sorted(loaded) == ["encoder", "head", "step"]
    assert np.array_equal(loaded["head"]["w"], np.ones((256, 10), np.float32))
    again = CliRunner().invoke(cli, [*args])
    assert again.exit_code == 2 and "already exists" in again.stderr
    bad = CliRunner().invoke(cli, ["derive", f"{root}#base", "e", "--rename", "enc"])
    assert bad.exit_code == 2 and "expected OLD=NEW" in bad.stderr


def test_the_save_lock_is_released(local):
    store, root = local
    store.derive("base", "d", set={"head": np.ones(3)})
    assert not list((root / "locks").glob("*")) and not list(root.glob("staging/*"))


def test_digit_keys_may_be_written_without_quotes(tmp_path):
    # Imported models are full of digit-only dict keys: h/11 means h/"11", as in patterns.
    store = treestore.Store(str(tmp_path / "s"))
    store.save({"h": {"0": {"w": np.zeros(2)}, "1": {"w": np.ones(2)}}}, "base")
    store.derive(
        "base", "d", set={"h/1/w": np.full(2, 5.0), "h/2": {"w": np.full(2, 7.0)}}, rename={"h/0": "h/9"}
    )
    assert set(store.open("d").leaves) == {'h/"1"/w', 'h/"2"/w', 'h/"9"/w'}
    assert np.array_equal(store.load("d")["h"]["1"]["w"], np.full(2, 5.0))
    with pytest.raises(InvalidInputError, match="overlap"):
        store.derive("base", "e", set={"h/1": 1, 'h/"1"/w': 2})


def test_derive_waits_for_a_running_gc(local):
    # derive takes the save lock before it reads the base: a gc in flight is waited for, and no
    # gc can start until the derived checkpoint is committed.
    store, _ = local
    gc_lock = locks.Lock(store._storage, "gc")
    done = threading.Event()
    worker = threading.Thread(target=lambda: (store.derive("base", "d", drop="opt/**"), done.set()))
    worker.start()
    assert not done.wait(0.5) and not store.exists("d")
    gc_lock.release()
    worker.join(timeout=30)
    assert done.is_set() and store.exists("d")


def _nested(depth: int, leaf: object) -> object:
    for _ in range(depth):
        leaf = {"k": leaf}
    return leaf


@contextlib.contextmanager
def _shallow_stack(frames: int = 300):
    """Python's recursion limit set ``frames`` above the current depth: code run in it must not
    recurse once per tree level."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def test_a_base_as_deep_as_save_allows(tmp_path):
    """derive handles every tree save and load handle: 495 levels (MAX_DEPTH is 500) are walked
    without a deep Python stack."""
    store = treestore.Store(str(tmp_path / "store"))
    depth = 495
    store.save(_nested(depth, np.arange(4.0)), "base")
    leaf = "/".join(["k"] * depth)
    with _shallow_stack():
        store.derive("base", "moved", rename={"k": "j"}, set={"x": np.zeros(2, np.int32)})
        store.derive("base", "grown", set={f"{leaf[:-2]}/y": np.ones(1)})
        store.derive("base", "emptied", drop=[leaf])
    assert_tree_equal(
        store.load("moved"), {"j": _nested(depth - 1, np.arange(4.0)), "x": np.zeros(2, np.int32)}
    )
    assert_tree_equal(store.load("grown"), _nested(depth - 1, {"k": np.arange(4.0), "y": np.ones(1)}))
    assert_tree_equal(store.load("emptied"), {})


DATA = Path(__file__).parent.parent / "data"


def _cut(e) -> list:
    """A leaf's chunks and pieces, as the objects they name (pack numbers aside)."""
    return [(p.start, p.shape, [(c.digest, c.raw_size, c.offset) for c in p.chunks]) for p in e.all_pieces]


@pytest.mark.parametrize(
    ("store", "base"), [("store-v1", "first"), ("store-v2", "first"), ("store-v2-parts", "sharded")]
)
def test_derives_from_every_format_and_from_leaves_in_pieces(tmp_path, store, base):
    """A base in format 1, in format 2, and one stored in parts by four processes (its leaves in
    pieces): the derived checkpoint keeps each kept leaf's chunks and pieces exactly, among new
    leaves, and loads as the base edited."""
    shutil.copytree(DATA / store, tmp_path / "s")
    s = treestore.Store(str(tmp_path / "s"))
    old = {e.address: e for e in s.manifest(base).leaves}
    movable = [a for a in old if not a.rsplit("/", 1)[-1].isdigit()]  # not a list's element
    first, last = movable[0], movable[-1]
    middle = [a for a in old if a not in (first, last)]
    new = {"inserted": np.arange(5, dtype=np.int64), "tiny": np.float32(2.5)}
    s.derive(base, "d", set={"zz_new": new}, rename={first: "renamed"}, drop=[last])
    derived = {e.address: e for e in s.manifest("d").leaves}
    assert set(derived) == {*middle, "renamed", "zz_new/inserted", "zz_new/tiny"}
    for address, source in [("renamed", first), *((a, a) for a in middle)]:
        assert _cut(derived[address]) == _cut(old[source]), address
        assert derived[address].digest == old[source].digest
        np.testing.assert_array_equal(
            np.asarray(s.open("d")[address]), np.asarray(s.open(base)[source]), err_msg=address
        )
    assert any(e.pieces for e in derived.values()) == any(e.pieces for e in old.values())
    got = s.load("d", select="zz_new/**")
    assert_tree_equal(got["zz_new"], new)
    assert treestore.verify(f"{s.url}#d").ok


def test_leaves_follow_jax_order_after_edits(tmp_path):
    """The derived tree is numbered as a save numbers it: leaves in jax's flattening order (a
    dict's keys sorted when they sort, insertion order otherwise), list items renumbered."""
    import jax

    store = treestore.Store(str(tmp_path / "s"))
    base = {
        "zeta": {"b": np.ones(1), "a": np.zeros(1)},
        "mixed": {3: np.full(1, 3.0), "x": np.full(1, 4.0), 1: np.full(1, 5.0)},
        "items": [np.full(1, 0.0), np.full(1, 1.0), {"k": np.full(1, 2.0)}],
        "alpha": 7,
    }
    store.save(base, "base")
    store.derive(
        "base",
        "d",
        drop="items/0",
        rename={"zeta/b": "zeta/B", "alpha": "beta"},
        set={"mixed/y": np.ones(2), "aa": {"q": 1, "p": 2}},
    )
    expected = {
        "zeta": {"B": np.ones(1), "a": np.zeros(1)},
        "mixed": {3: np.full(1, 3.0), "x": np.full(1, 4.0), 1: np.full(1, 5.0), "y": np.ones(2)},
        "items": [np.full(1, 1.0), {"k": np.full(1, 2.0)}],
        "beta": 7,
        "aa": {"q": 1, "p": 2},
    }
    assert_tree_equal(store.load("d"), expected)
    store.save(expected, "saved")  # the order a save gives the same tree
    assert list(store.open("d").leaves) == list(store.open("saved").leaves)
    del expected["mixed"]  # jax sorts no dict of int and str keys (it keeps their order)
    flat = jax.tree_util.tree_flatten_with_path(expected)[0]
    assert [a for a in store.open("d").leaves if not a.startswith("mixed/")] == [
        treestore.format_address(p) for p, _ in flat
    ]


def test_a_moved_subtree_keeps_what_drop_left_and_emptied_containers_go(local):
    store, _ = local
    store.derive("base", "d", rename={"opt": "o"}, drop="opt/mu/enc")
    assert_tree_equal(store.load("d"), {"enc": ENC, "head": HEAD, "o": {"count": 3}, "step": 100})
    store.derive("base", "e", drop=["opt/count", "opt/mu/enc"], set={"head/w": np.ones(2)})
    assert set(store.open("e").leaves) == {"enc/b", "enc/w", "head/b", "head/w", "step"}


def test_an_unreadable_result_is_refused_before_any_chunk_is_written(local):
    store, root = local
    before = chunk_files(root)
    with pytest.raises(InvalidInputError, match="its manifest would not be readable: the address of node"):
        store.derive("base", "d", rename={"enc": "x" * 17_000}, set={"extra": np.arange(7.0)})
    assert chunk_files(root) == before and [c.name for c in store.list()] == ["base"]
