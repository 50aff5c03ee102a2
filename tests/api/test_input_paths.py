"""Arguments the public API refuses, naming what it expected, and the edges of what it accepts: a
lazy leaf's indexing, watch's timeout, a manager's metrics and health settings, derive's
addresses, and the names and keys of imported files."""

from __future__ import annotations

import collections
import logging
import uuid
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

import treestore
from tests.support import hostile
from tests.support.faults import FaultyMemoryFileSystem
from treestore._format.paths import step_name

Pair = collections.namedtuple("Pair", "a b")


def memory() -> str:
    return f"memory://treestore-tests/{uuid.uuid4().hex}"


# --- a lazy leaf -----------------------------------------------------------------------------------
V, M = np.arange(5.0), np.arange(6.0).reshape(2, 3)


@pytest.fixture(scope="module")
def leaves() -> dict:
    url = memory()
    treestore.save(url, {"v": V, "m": M, "z": np.array(3.5)}, "c")
    return treestore.open(url, "c").leaves


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("v", ()),
        ("v", (Ellipsis,)),
        ("v", (Ellipsis, 0)),
        ("v", (Ellipsis, slice(1, 3))),
        ("v", (Ellipsis, -1)),
        ("m", (Ellipsis, 1)),
        ("m", (Ellipsis, 0, 2)),
        ("m", (Ellipsis, slice(None), slice(0, 2))),
        ("m", (1, Ellipsis)),
        ("z", ()),
        ("z", (Ellipsis,)),
    ],
    ids=repr,
)
def test_a_lazy_leaf_indexes_as_numpy_does(leaves, name, index):
    """Basic indexing of a lazy leaf gives what numpy gives for the array, a leading ``...``
    standing for no dimension included (it was an IndexError: ``leaf[..., 0]`` of a vector)."""
    whole = {"v": V, "m": M, "z": np.array(3.5)}[name]
    got = leaves[name][index]
    assert np.array_equal(got, whole[index]) and np.shape(got) == np.shape(whole[index]), (got, whole[index])


def test_a_lazy_leaf_refuses_too_many_indices(leaves):
    for index in ((Ellipsis, 0, 0), (0, 0)):
        with pytest.raises(
            treestore.errors.OutOfBoundsError, match=r"^v: too many indices for a leaf of shape \(5,\)"
        ):
            leaves["v"][index]


def test_a_lazy_leaf_s_region_takes_unit_step_slices(leaves):
    assert np.array_equal(leaves["m"].region((slice(1, 2), slice(0, 2))), M[1:2, 0:2])
    with pytest.raises(treestore.errors.OutOfBoundsError, match=r"^m: regions are unit-step slices, got "):
        leaves["m"].region((slice(0, 2, 2),))


def test_a_lazy_leaf_s_size_and_length(leaves):
    assert (leaves["v"].size, leaves["m"].size, leaves["z"].size) == (5, 6, 1)
    assert (len(leaves["v"]), len(leaves["m"])) == (5, 2)
    with pytest.raises(TypeError, match=r"^len\(\) of a 0-d leaf$"):
        len(leaves["z"])


# --- watch ---------------------------------------------------------------------------------------
def test_watch_refuses_a_negative_timeout():
    url = memory()
    treestore.save(url, {"x": 1}, "a")
    with pytest.raises(treestore.InvalidInputError, match=r"^timeout must be at least 0 seconds, got -1$"):
        next(iter(treestore.watch(url, timeout=-1)))


# --- a checkpoint manager's metrics and health ---------------------------------------------------
def test_a_manager_refuses_metrics_that_are_not_a_dict_of_names(tmp_path):
    url = str(tmp_path / "m")
    with treestore.CheckpointManager(url, async_save=False) as m:
        with pytest.raises(
            treestore.InvalidInputError, match=r"^metrics must be a dict of names to numbers, got list$"
        ):
            m.save(0, {"x": np.ones(2)}, metrics=[1.0])
        with pytest.raises(treestore.InvalidInputError, match=r"^metric names must be str, got 3$"):
            m.save(0, {"x": np.ones(2)}, metrics={3: 1.0})
        assert m.steps() == []
        m.save(0, {"x": np.ones(2)}, metrics={"loss": 1})
        assert m.info(0).metrics == {"loss": 1.0}


def test_a_manager_refuses_a_keep_healthy_that_is_not_a_bool(tmp_path):
    with pytest.raises(treestore.InvalidInputError, match=r"^keep_healthy must be True or False, got 'yes'$"):
        treestore.CheckpointManager(str(tmp_path / "m"), keep_healthy="yes")
    with pytest.raises(treestore.InvalidInputError, match=r"^healthy must be a function"):
        treestore.CheckpointManager(str(tmp_path / "m"), healthy=True)
    assert not (tmp_path / "m").exists() or treestore.Store(str(tmp_path / "m")).list() == []


def test_a_health_check_that_raises_leaves_the_step_unknown(tmp_path, caplog):
    """The caller's check fails: the step's health is unknown (never healthy, never deleted for
    it), and the failure is logged naming the step and the error."""

    def check(info, stats):
        raise ZeroDivisionError("bad check")

    url = str(tmp_path / "m")
    with treestore.CheckpointManager(url, async_save=False, healthy=check) as m:
        m.save(0, {"x": np.ones(2)})
        with caplog.at_level(logging.WARNING, "treestore"):
            assert m.latest_step(healthy=True) is None
        assert m.latest_step() == 0 and m.steps() == [0]
    said = [r.getMessage() for r in caplog.records]
    assert any(f"health check of {step_name(0)} raised ZeroDivisionError: bad check" in s for s in said), said


def test_a_step_whose_manifest_is_damaged_has_an_unknown_health(tmp_path, caplog):
    url = str(tmp_path / "m")
    with treestore.CheckpointManager(url, async_save=False) as m:
        m.save(0, {"x": np.ones(2)})
        m.save(1, {"x": np.zeros(2)})
    hostile.damage_manifest(url, step_name(1))
    with (
        treestore.CheckpointManager(url, async_save=False) as m,
        caplog.at_level(logging.WARNING, "treestore"),
    ):
        assert m.latest_step(healthy=True) == 0
    said = [r.getMessage() for r in caplog.records]
    assert any(f"the health of {step_name(1)} is unknown" in s for s in said), said


# --- derive's addresses --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"set": [("a", 1)]}, r"^set must be a dict of address -> \.\.\., got list$"),
        ({"set": {7: np.ones(2)}}, r"an address is a str, got int$"),
        ({"set": {"a/[": np.ones(2)}}, r"'a/\[' is not an address: "),
        ({"set": {'"a"b"': np.ones(2)}}, r"""'"a"b"' is not an address: unescaped '"' in address segment"""),
        ({"rename": {"": "x"}}, r"^rename moves subtrees: the root \(''\) can be neither source nor target$"),
        ({"rename": {"a": ""}}, r"^rename moves subtrees: the root \(''\) can be neither source nor target$"),
    ],
    ids=[
        "set-not-a-dict",
        "address-not-str",
        "not-an-address",
        "unescaped-quote",
        "rename-root",
        "rename-to-root",
    ],
)
def test_derive_refuses_bad_addresses(tmp_path, kwargs, message):
    store = treestore.Store(str(tmp_path / "s"))
    store.save({"a": np.arange(3.0), "b": 1}, "base")
    with pytest.raises(treestore.InvalidInputError, match=message):
        store.derive("base", "new", **kwargs)
    assert [c.name for c in store.list()] == ["base"]


# --- imported files' names and keys ------------------------------------------------------------
def test_a_key_that_names_a_tensor_and_a_prefix_of_others_is_not_nested(tmp_path):
    file = tmp_path / "w.npz"  # kept in this order (safetensors sorts its keys: "a" would come first)
    np.savez(file, **{"a.b": np.ones(2, np.float32), "a": np.zeros(2, np.float32)})
    url = memory()
    with pytest.raises(treestore.InvalidInputError) as caught:
        treestore.import_file(file, f"{url}#w")
    message = str(caught.value)
    assert "key 'a' names a tensor and a prefix of other keys" in message and "--flat" in message, message
    assert treestore.Store(url).list() == []
    treestore.import_file(file, f"{url}#w", nest_keys=False)
    assert sorted(treestore.load(url, "w")) == ["a", "a.b"]


def test_a_file_whose_name_makes_no_checkpoint_name_needs_one(tmp_path):
    file = tmp_path / "__.safetensors"
    safetensors.numpy.save_file({"x": np.ones(2, np.float32)}, str(file))
    url = memory()
    with pytest.raises(treestore.InvalidInputError, match=r"name the checkpoint to import .*: URL#NAME$"):
        treestore.import_file(file, url)
    assert treestore.Store(url).list() == []
    assert treestore.import_file(file, f"{url}#named").name == "named"


def test_metadata_that_is_not_a_dict_is_kept_as_the_user_s(tmp_path):
    file = Path(tmp_path / "w.safetensors")
    safetensors.numpy.save_file({"x": np.ones(2, np.float32)}, str(file))
    url = memory()
    treestore.import_file(file, f"{url}#w", metadata=["a", 1])
    meta = treestore.open(url, "w").metadata
    assert meta["user"] == ["a", 1] and meta["source"]["format"] == "safetensors", meta


def _tree_store() -> treestore.Store:
    store = treestore.Store(memory())
    store.save(
        {"l": [np.ones(1), np.ones(2)], "p": Pair(np.ones(1), np.zeros(1)), "d": {"x": np.ones(1)}}, "b"
    )
    return store


@pytest.mark.parametrize(
    ("address", "rule"),
    [
        ("l/5", "a list grows only at its end (index 2) (l is a list)"),
        ("p/7", "a namedtuple node takes no index keys (p is a namedtuple)"),
        ("d/.a", "a dict takes only dict keys (no '.attr', '#i' or index segments) (d is a dict)"),
    ],
)
def test_derive_adds_only_the_keys_a_node_can_take(address, rule):
    store = _tree_store()
    with pytest.raises(treestore.InvalidInputError) as caught:
        store.derive("b", "n", set={address: np.ones(3)})
    assert str(caught.value) == f"set {address!r}: cannot add {address!r} to checkpoint 'b': {rule}"
    assert caught.value.address == address
    assert [c.name for c in store.list()] == ["b"]


def test_derive_grows_a_list_at_its_end_and_replaces_the_root():
    store = _tree_store()
    store.derive("b", "longer", set={"l/2": np.full(3, 7.0)})
    assert [np.asarray(x).tolist() for x in store.load("longer")["l"]] == [[1.0], [1.0, 1.0], [7.0, 7.0, 7.0]]
    store.derive("b", "other", set={"": {"z": np.arange(2)}})
    assert list(store.load("other")) == ["z"] and np.array_equal(store.load("other")["z"], np.arange(2))
    store.derive("b", "moved", rename={"d/x": "q/r/s"})
    back = store.load("moved")
    assert "d" not in back and np.array_equal(back["q"]["r"]["s"], np.ones(1))


# --- views: a checkpoint's repr, statistics of extreme scalars, a diff's rows ---------------------
def test_views_of_a_checkpoint_and_a_diff():
    url = memory()
    treestore.save(url, {"big": 10**400, "w": np.array([3.0, 4.0, np.nan]), "e": np.array([np.inf])}, "c")
    treestore.save(url, {"big": 10**400, "w": np.array([3.0, 5.0, np.nan]), "e": np.array([np.inf])}, "d")
    ckpt = treestore.open(url, "c")
    assert repr(ckpt) == f"Checkpoint({ckpt.url!r}, 'c', leaves=3)"
    stats = ckpt.stats()
    assert stats["big"].l2 == float("inf") and stats["big"].max == 10**400  # beyond a float: inf
    assert stats["w"].rms == pytest.approx(5 / 2**0.5) and stats["e"].rms is None  # no finite element
    d = treestore.diff(f"{url}#c", f"{url}#d")
    rows = d.leaves
    assert [r.address for r in rows[0:2]] == ["big", "e"] and [r.address for r in rows[::2]] == ["big", "w"]
    assert [(r.address, r.status) for r in rows[-1:]] == [("w", "changed")]


# --- save options ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"chunk_size": 1000}, r"^chunk_size must be between 4 KiB and 256 MiB, got 1000$"),
        ({"chunk_size": 8192, "small_leaf": 10_000}, r"^small_leaf must be between 0 and chunk_size$"),
        ({"small_leaf": 4096, "pack_size": 100}, r"^pack_size must be between small_leaf and 256 MiB$"),
        ({"threads": 0}, r"^threads must be between 1 and 256, got 0$"),
        ({"stats": 1}, r"^stats must be True or False, got 1$"),
    ],
    ids=["chunk_size", "small_leaf", "pack_size", "threads", "stats"],
)
def test_save_options_out_of_range_are_refused(options, message):
    with pytest.raises(treestore.InvalidInputError, match=message):
        treestore.SaveOptions(**options)


def test_a_missing_checkpoint_of_a_store_that_cannot_be_listed_is_named_without_suggestions(faultmem):
    treestore.save(faultmem, {"w": np.ones(2)}, "step-1")
    with pytest.raises(treestore.errors.CheckpointNotFoundError, match=r"\(did you mean 'step-1'\?\)$"):
        treestore.load(faultmem, "step-2")
    root = FaultyMemoryFileSystem._strip_protocol(faultmem)
    FaultyMemoryFileSystem.unlistable = {f"{root}/checkpoints"}
    with pytest.raises(treestore.errors.CheckpointNotFoundError) as caught:
        treestore.load(faultmem, "step-2")
    assert str(caught.value).endswith("no checkpoint 'step-2' in store " + treestore.Store(faultmem).url), (
        str(caught.value)
    )


def test_a_store_is_its_url_without_a_checkpoint_name():
    url = memory()
    with pytest.raises(treestore.InvalidInputError) as caught:
        treestore.Store(f"{url}#step-1")
    assert str(caught.value) == (
        f"'{url}#step-1' names a checkpoint; a store is its URL without #NAME "
        f"(Store('{url}').load('step-1'), or treestore.load('{url}#step-1'))"
    )
    assert repr(treestore.Store(url)) == f"Store('{url}')"


def test_a_copy_onto_a_damaged_commit_record_replaces_it_only_when_asked(tmp_path):
    src, dst = memory(), str(tmp_path / "dst")
    treestore.save(src, {"w": np.arange(3.0)}, "c")
    treestore.save(dst, {"other": np.ones(1)}, "c")
    (tmp_path / "dst" / "checkpoints" / "c").write_bytes(b"\x93 not a record")
    with pytest.raises(
        treestore.errors.CheckpointExistsError, match=r"with other contents; pass overwrite=True"
    ):
        treestore.copy(f"{src}#c", dst)
    assert (tmp_path / "dst" / "checkpoints" / "c").read_bytes() == b"\x93 not a record"
    assert treestore.copy(f"{src}#c", dst, overwrite=True).copied == ("c",)
    assert np.array_equal(treestore.load(dst, "c")["w"], np.arange(3.0))
