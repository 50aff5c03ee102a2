"""A model-based test: hypothesis drives save / overwrite / delete / gc / load / open / diff /
verify against an in-memory model of what the store should hold.

Invariants after every step: ``list()`` names exactly the model's checkpoints, oldest first, with
their metadata; every checkpoint loads exactly as saved (checked after every gc, and for one name
per load step); ``diff`` reports exactly the addresses whose leaves differ in the model.
"""

from __future__ import annotations

import math
import shutil
import struct
import tempfile
import uuid
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from jax.tree_util import DictKey, SequenceKey

import treestore
from tests import strategies
from tests.support.helpers import assert_tree_equal

pytestmark = pytest.mark.timeout(180)

NAMES = st.sampled_from(["a", "b", "c", "step-000000001", "x.y=z+1"])
OPTIONS = treestore.SaveOptions(chunk_size=4096, small_leaf=512, pack_size=2048, threads=2)

chunked = st.builds(
    lambda n, v: np.full(n, v, np.float32),  # big enough to be cut into chunks (4 KiB)
    st.integers(1000, 5000),
    st.floats(-1, 1, width=32),
)
trees = strategies.trees(
    strategies.arrays((np.float32, np.int32, np.uint8, np.bool_, np.float64, ml_dtypes.bfloat16), max_side=6)
    | chunked
    | strategies.scalars()
)
metadata = st.none() | st.dictionaries(
    st.text(max_size=5), st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5), max_size=3
)


def flat(tree: Any, path: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The model's view of a tree: address -> leaf, as SPEC.md section 7 forms addresses."""
    if tree is None:
        return {}
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flat(v, (*path, DictKey(k))))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(flat(v, (*path, SequenceKey(i))))
        return out
    return {treestore.format_address(path): tree}


def same_leaf(a: Any, b: Any) -> bool:
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, complex):
        return struct.pack("<dd", a.real, a.imag) == struct.pack("<dd", b.real, b.imag)
    return a == b


class StoreMachine(RuleBasedStateMachine):
    backend = "memory"

    def __init__(self) -> None:
        super().__init__()
        if self.backend == "memory":
            self.tmp = None
            self.url = f"memory://stateful/{uuid.uuid4().hex}"
        else:
            self.tmp = tempfile.mkdtemp(prefix="treestore-stateful-")
            self.url = f"{self.tmp}/store"
        self.store = treestore.Store(self.url)
        self.model: dict[str, tuple[Any, Any]] = {}  # name -> (tree, metadata), oldest first

    def teardown(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- writers ----------------------------------------------------------------------------------
    @rule(name=NAMES, tree=trees, meta=metadata)
    def save(self, name: str, tree: Any, meta: Any) -> None:
        if name in self.model:
            with pytest.raises(treestore.errors.CheckpointExistsError, match=name.replace("+", r"\+")):
                self.store.save(tree, name, metadata=meta, options=OPTIONS)
            return
        self.store.save(tree, name, metadata=meta, options=OPTIONS)
        self.model[name] = (tree, meta)

    @rule(name=NAMES, tree=trees, meta=metadata)
    def overwrite(self, name: str, tree: Any, meta: Any) -> None:
        self.store.save(tree, name, metadata=meta, overwrite=True, options=OPTIONS)
        self.model.pop(name, None)
        self.model[name] = (tree, meta)

    @rule(name=NAMES)
    def delete(self, name: str) -> None:
        if name not in self.model:
            with pytest.raises(treestore.errors.CheckpointNotFoundError):
                self.store.delete(name)
            return
        self.store.delete(name)
        del self.model[name]

    @rule()
    def gc(self) -> None:
        self.store.gc(grace=0)
        for name, (tree, _) in self.model.items():
            assert_tree_equal(self.store.load(name), tree)

    # -- readers ----------------------------------------------------------------------------------
    @rule(name=NAMES)
    def load(self, name: str) -> None:
        if name not in self.model:
            with pytest.raises(treestore.errors.CheckpointNotFoundError):
                self.store.load(name)
            return
        assert_tree_equal(self.store.load(name), self.model[name][0])

    @precondition(lambda self: self.model)
    @rule()
    def load_newest(self) -> None:
        assert_tree_equal(self.store.load(), self.model[next(reversed(self.model))][0])

    @rule(name=NAMES)
    def open_lazily(self, name: str) -> None:
        if name not in self.model:
            with pytest.raises(treestore.errors.CheckpointNotFoundError):
                self.store.open(name)
            return
        expected = flat(self.model[name][0])
        leaves = self.store.open(name).leaves
        assert sorted(leaves) == sorted(expected)
        for address, leaf in leaves.items():
            want = expected[address]
            if isinstance(leaf, treestore.LazyLeaf):
                want = np.asarray(want)
                assert same_leaf(np.asarray(leaf), want), address
                if want.ndim and want.shape[0] > 1:
                    assert same_leaf(leaf[1:], want[1:]), address
            else:
                assert same_leaf(leaf, want), address

    @rule(a=NAMES, b=NAMES)
    def diff(self, a: str, b: str) -> None:
        if a not in self.model or b not in self.model:
            return
        d = treestore.diff(f"{self.url}#{a}", f"{self.url}#{b}")
        fa, fb = flat(self.model[a][0]), flat(self.model[b][0])
        assert set(d.added) == fb.keys() - fa.keys()
        assert set(d.removed) == fa.keys() - fb.keys()
        differ = {x for x in fa.keys() & fb.keys() if not same_leaf(fa[x], fb[x])}
        assert {x.address for x in d} - set(d.added) - set(d.removed) == differ
        if a == b:
            assert not d

    @precondition(lambda self: self.model)
    @rule()
    def verify(self) -> None:
        report = treestore.verify(self.url)
        assert report.ok, report.problems
        assert set(report.checkpoints) == set(self.model)

    @invariant()
    def listing_matches_the_model(self) -> None:
        infos = self.store.list()
        assert [c.name for c in infos] == list(self.model)
        for c in infos:
            assert c.metadata == self.model[c.name][1]
            assert self.store.exists(c.name)
        if self.model:
            assert self.store.latest() == next(reversed(self.model))


class LocalStoreMachine(StoreMachine):
    backend = "local"


TestMemoryStore = StoreMachine.TestCase
TestMemoryStore.settings = settings(
    max_examples=100, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)
TestLocalStore = LocalStoreMachine.TestCase
TestLocalStore.settings = settings(
    max_examples=25, stateful_step_count=20, deadline=None, suppress_health_check=list(HealthCheck)
)


plain = strategies.trees(
    strategies.scalars(ints=st.integers(-(2**63), 2**64 - 1), nan=False, complex_numbers=False, max_size=5),
    keys=strategies.KEYS | st.binary(max_size=3),
    containers=("list", "dict"),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None)
@given(meta=plain)
def test_metadata_is_refused_at_save_or_listed_and_loaded_as_given(meta):
    """Metadata that the save accepts must come back from list() and the manifest exactly; if
    the store cannot hold it, the save must refuse it (InvalidInputError) and write nothing."""
    url = f"memory://metadata/{uuid.uuid4().hex}"
    store = treestore.Store(url)
    store.save({"a": 1}, "ok")
    try:
        store.save({"a": np.arange(3)}, "m", metadata=meta)
    except treestore.InvalidInputError:
        assert [c.name for c in store.list()] == ["ok"]
        return
    expected = msgpack.unpackb(msgpack.packb(meta, use_bin_type=True), raw=False, strict_map_key=False)
    info = {c.name: c for c in store.list()}["m"]  # must not fail: the save succeeded
    assert info.metadata == expected or (isinstance(meta, float) and math.isnan(meta))
    assert store.manifest("m").metadata == info.metadata
    assert store.load("m")["a"].tolist() == [0, 1, 2]
