"""The one pattern dialect: ``*`` within a segment, ``**`` across segments, digit keys loosely."""

from __future__ import annotations

import fnmatch
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treestore
from tests import strategies
from treestore._format import select

BERT = [
    'encoder/layer/"0"/attention/output/dense/bias',
    'encoder/layer/"0"/attention/output/dense/kernel',
    'encoder/layer/"0"/output/dense/bias',
    'encoder/layer/"1"/output/dense/bias',
    "pooler/dense/bias",
]


def test_star_stays_within_a_segment():
    assert select.matching("encoder/layer/*/output/dense/bias", BERT) == [
        'encoder/layer/"0"/output/dense/bias',
        'encoder/layer/"1"/output/dense/bias',
    ]
    assert select.matching("*", BERT) == []
    assert select.matching("*/dense/bias", BERT) == ["pooler/dense/bias"]


def test_double_star_crosses_segments_and_may_match_none():
    assert select.matching("**/bias", BERT) == [a for a in BERT if a.endswith("/bias")]
    assert select.matching("encoder/**/dense/kernel", BERT) == [BERT[1]]
    assert select.matching("pooler/dense/**", BERT) == ["pooler/dense/bias"]
    assert select.matching("**", BERT) == BERT


def test_bare_digits_match_digit_keys_only_when_nothing_is_spelled_exactly():
    assert select.matching("encoder/layer/1/output/dense/bias", BERT) == [BERT[3]]
    addresses = ["h/3/w", 'h/"3"/w']  # a list index and a digit string key, in different nodes
    assert select.matching("h/3/w", addresses) == ["h/3/w"]  # exact spelling wins
    assert select.matching("m/{2}/x", ["m/{2}/x"]) == ["m/{2}/x"]
    assert select.matching("m/2/x", ["m/{2}/x", "n/#2/x"]) == ["m/{2}/x"]
    assert select.matching("n/2/x", ["n/#2/x"]) == ["n/#2/x"]


def test_an_ambiguous_loose_reading_is_refused():
    with pytest.raises(treestore.InvalidInputError, match="ambiguous"):
        select.matching("d/3", ["d/{3}", 'd/"3"'])


def test_lookup_reads_digit_keys_loosely_and_wildcards_literally():
    addresses = ['h/"3"/w', "a*b"]
    assert select.lookup("h/3/w", addresses) == 'h/"3"/w'
    assert select.lookup("h/4/w", addresses) is None
    assert select.lookup("a*b", addresses) == "a*b"
    assert select.lookup("a?b", addresses) is None


_PATTERN = st.text("ab*?[]!-^&~|\\", max_size=6)
_TEXT = st.text("ab[]!-*?^&~|\\", max_size=6)


@settings(max_examples=400, deadline=None)
@given(_PATTERN, _TEXT)
def test_within_one_segment_the_dialect_is_fnmatch(pattern, text):
    assert select.matches(text, [pattern]) == fnmatch.fnmatchcase(text, pattern)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text("ab", min_size=1, max_size=3), min_size=1, max_size=5))
def test_star_never_crosses_and_double_star_always_does(segments):
    address = "/".join(segments)
    assert select.matches(address, ["*"]) == (len(segments) == 1)
    assert select.matches(address, ["**"])
    assert select.matches(address, [f"**/{segments[-1]}"])


def test_the_dialect_is_the_same_in_load_open_diff_and_the_cli(tmp_path):
    url = str(tmp_path / "s")
    tree = {"encoder": {"layer": {"0": {"w": np.ones(2), "b": np.zeros(2)}, "1": {"w": np.ones(3)}}}}
    treestore.save(url, tree, "a")
    tree["encoder"]["layer"]["1"]["w"] = np.full(3, 2.0)
    treestore.save(url, tree, "b")
    part = treestore.load(f"{url}#a", select="encoder/layer/*/w")
    assert sorted(part["encoder"]["layer"]) == ["0", "1"] and list(part["encoder"]["layer"]["0"]) == ["w"]
    assert treestore.open(f"{url}#a")["encoder/layer/1/w"].shape == (3,)
    d = treestore.diff(f"{url}#a", f"{url}#b", select="encoder/**/w")
    assert d.changed == ('encoder/layer/"1"/w',) and 'encoder/layer/"0"/b' not in d.unchanged
    assert treestore.open(f"{url}#b").select("**/1/*") == ['encoder/layer/"1"/w']
    from treestore_cli.main import main

    assert main(["show", f"{url}#a", "encoder/layer/0/*"]) == 0
    with pytest.raises(treestore.errors.NoMatchError, match="nearest addresses"):
        treestore.load(f"{url}#a", select="encoder/*/w")  # * no longer reaches two levels down


def _index_built_lookup(nodes, address: str):
    """The loose lookup as it was before lookups walked only their own path: an index of every
    node's children by loose spelling, built whole on first use (the reference)."""
    spelled = [select.loose_segment(s) for s in nodes.segments]
    children: dict = {}
    for node, (parent, key) in enumerate(
        zip(nodes.table["parent"].tolist(), nodes.table["key"].tolist(), strict=True)
    ):
        if node:
            children.setdefault((parent, spelled[key]), []).append(node)
    node = 0
    for segment in address.split("/") if address else ():
        hits = children.get((node, select.loose_segment(segment)), ())
        if len(hits) != 1:
            return None
        node = hits[0]
    hit = np.flatnonzero(nodes.leaf_node == node)
    return int(hit[0]) if len(hit) else None


@settings(max_examples=80, deadline=None)
@given(tree=strategies.trees(st.integers(0, 3), keys=st.sampled_from(["0", "1", "a", 0, 1, 2])))
def test_finding_a_leaf_walks_its_path_and_agrees_with_the_whole_index(tree):
    """Exact and loose lookups by address (``Checkpoint[...]``) walk down from the root, looking
    at the children of the nodes on the path only; they find what the index of every node did."""
    url = f"memory://find/{uuid.uuid4().hex}"
    treestore.save(url, tree, "c")
    nodes = treestore.open(url, "c")._columns.nodes
    addresses = nodes.addresses()
    bare = ["/".join(select.loose_segment(x) for x in a.split("/")) if a else a for a in addresses]
    for i, (a, loose) in enumerate(zip(addresses, bare, strict=True)):
        assert nodes.find(a) == i
        assert nodes.find_loose(loose) == _index_built_lookup(nodes, loose), (a, loose)
        assert nodes.find(a + "/x") is None and nodes.find_loose(loose + "/x") is None
