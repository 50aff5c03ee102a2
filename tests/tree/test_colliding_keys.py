"""Keys that are equal as Python values but stand for distinct addresses (``.a`` and ``a``;
``0``, ``{0}`` and ``#0``; ``1`` and ``True``) never make a load drop or alias a leaf (issue 12.3
of the attack report)."""

from __future__ import annotations

from typing import Any

import pytest
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

import treestore
from tests.support import hostile
from tests.support.nodes import Node
from tests.support.refusal import (
    INPUT_ERRORS,
    assert_base_intact,
    store_files,
    tree_leaf_values,
    with_base,
)

# --- 12.3: a load never drops or aliases a leaf -------------------------------------------------
COLLIDING_KEYS = {
    "attr-and-dict": [GetAttrKey("a"), DictKey("a")],
    "seq-dict-flat": [SequenceKey(0), DictKey(0), FlattenedIndexKey(0)],
    "seq-and-bool": [SequenceKey(1), DictKey(True)],
    "int-and-bool": [DictKey(1), DictKey(True)],
}


@pytest.mark.parametrize("keys", list(COLLIDING_KEYS.values()), ids=list(COLLIDING_KEYS))
def test_load_without_template_never_drops_custom_node_leaves(tmp_path, keys):
    """Key entries with distinct addresses but equal Python values (``.a`` and ``a``; ``0``,
    ``{0}`` and ``#0``) must not collapse into one dict key when loaded without ``like=``."""
    values = [11 * (i + 1) for i in range(len(keys))]
    tree = {"n": Node(keys, values)}
    url = with_base(tmp_path)
    before = store_files(url)
    try:
        treestore.save(url, tree, "c")
    except treestore.TreestoreError as exc:  # refusing the node up front also keeps every leaf
        assert isinstance(exc, INPUT_ERRORS), f"refused with {type(exc).__name__}: {exc}"
        assert store_files(url) == before, "the refused save wrote objects"
        assert_base_intact(url)
        return
    assert len(treestore.Store(url).manifest("c").leaves) == len(keys)
    for what, read in [
        ("load", lambda: treestore.load(url, "c")),
        ("open().tree", lambda: treestore.open(url, "c").tree),
    ]:
        try:
            out = read()
        except treestore.TreestoreError:
            continue  # refusing is fine; a silent drop is not
        got = sorted(int(v) for v in tree_leaf_values(out))
        assert got == values, f"{what} returned {out!r}: leaves {got}, saved {values}"


def _one_and_true(node_type: str) -> Any:
    """A manifest change: the two leaves of ``{"p": 11, "q": 22}`` become dict keys 1 and True of
    one node, each at its own canonical address (``{1}`` and ``{true}``)."""

    def change(m: dict[str, Any]) -> None:
        by_address = {leaf["address"]: i for i, leaf in enumerate(m["leaves"])}
        m["leaves"][by_address["p"]]["address"] = "{1}"
        m["leaves"][by_address["q"]]["address"] = "{true}"
        node: dict[str, Any] = {
            "type": node_type,
            "keys": [["dict", 1], ["dict", True]],
            "children": [
                {"type": "leaf", "leaf": by_address["p"]},
                {"type": "leaf", "leaf": by_address["q"]},
            ],
        }
        if node_type == "custom":
            node["name"] = "hostile.Node"
        m["tree"] = node

    return change


@pytest.mark.parametrize("node_type", ["dict", "ordereddict", "custom"])
def test_hostile_keys_one_and_true_are_not_aliased(tmp_path, node_type):
    url = str(tmp_path / "store")
    treestore.save(url, {"p": 11, "q": 22}, "c")
    hostile.mutate_manifest(url, "c", _one_and_true(node_type))
    try:
        out = treestore.load(url, "c")
    except treestore.errors.ManifestDamagedError:
        report = treestore.verify(url)
        assert not report.ok, "load refuses the checkpoint but verify passes it"
        return
    got = sorted(int(v) for v in tree_leaf_values(out))
    assert got == [11, 22], f"load returned {out!r}: one leaf aliased the other"
