"""The tree of a version-2 manifest as a node table: validated with numpy, addresses on demand.

Nodes are listed so that every node's parent comes before it; a node's children are in node
order (a save numbers them consecutively when it reaches their parent). Each node
records its kind, its parent and the index of its key in a table of distinct address segments;
a leaf node's leaf index is in ``leaves``. A leaf's address is the segments of the keys from the
root down to its node, so addresses are never stored twice and can never disagree with the tree.
Validation touches each distinct segment once in Python and every node only through numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._format.address import (
    DictKey,
    FlattenedIndexKey,
    GetAttrKey,
    Key,
    SequenceKey,
    canonical_segment,
    format_key,
    key_from_record,
    key_to_record,
    key_value,
)
from treestore._format.encoding import Bad
from treestore._format.limits import MAX_ADDRESS_CHARS, MAX_ADDRESSES_CHARS, MAX_DEPTH
from treestore._format.select import loose_segment
from treestore._kernels.room import ROOM_EVERY, check_room
from treestore.errors import TreestoreError, UnsupportedFormatError

# Node kinds, by code (SPEC.md, version-2 manifest).
NODE_KINDS = ("leaf", "none", "list", "tuple", "dict", "ordereddict", "namedtuple", "custom")
LEAF, NONE, LIST, TUPLE, DICT, ORDEREDDICT, NAMEDTUPLE, CUSTOM = range(len(NODE_KINDS))
_NODE_CODES = {name: code for code, name in enumerate(NODE_KINDS)}
# A node: its kind, its parent's index, the index of its key's segment (both 0 for the root).
NODE_DTYPE = np.dtype([("kind", "u1"), ("parent", "<u4"), ("key", "<u4")])
# Key kinds of segments (what a segment parses to).
_SEQ, _DICT, _ATTR, _FLAT = range(4)


def children_by_parent(parent: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The nodes of a forest grouped by parent (``parent`` is -1 at each root), each group in node
    order, with one stable sort: the children of node p < n are ``order[starts[p]:starts[p + 1]]``."""
    has = np.flatnonzero(parent >= 0)
    order = has[np.argsort(parent[has], kind="stable")]
    return order, np.searchsorted(parent[order], np.arange(n + 1))


@dataclass(frozen=True, eq=False)
class Nodes:
    """A validated node table (see the module docstring); build it with :func:`nodes_from_tree`
    or :func:`check_nodes`."""

    segments: tuple[str, ...]
    table: np.ndarray  # NODE_DTYPE, one per node
    names: tuple[str, ...]  # the type name of each namedtuple or custom node, in node order
    leaves: np.ndarray  # uint32: the leaf index of each leaf node, in node order
    leaf_node: np.ndarray  # int64: the node of each leaf (the inverse of ``leaves``)

    def address(self, node: int) -> str:
        """The address of one node: its ancestors' key segments, the root's first."""
        parent, key = self.table["parent"], self.table["key"]
        parts = []
        while node:
            parts.append(self.segments[key[node]])
            node = int(parent[node])
        return "/".join(reversed(parts))

    def addresses(self) -> list[str]:
        """The address of every leaf, by leaf index (one pass over the nodes)."""
        parents = self.table["parent"].tolist()
        segs = [""] + [self.segments[k] for k in self.table["key"][1:].tolist()]
        out = [""] * len(parents)
        for i in range(1, len(parents)):
            if i % ROOM_EVERY == 0:
                check_room()  # stop while running out can still be reported
            p = parents[i]
            out[i] = segs[i] if p == 0 else out[p] + "/" + segs[i]
        return [out[n] for n in self.leaf_node.tolist()]

    def leaf_addresses(self, leaves: np.ndarray) -> list[str]:
        """The addresses of the leaves ``leaves`` (leaf indices): each walked up the node table
        when they are few, else picked from one pass over every node."""
        if 16 * len(leaves) < len(self.table):
            return [self.address(n) for n in self.leaf_node[leaves].tolist()]
        every = self.addresses()
        return [every[i] for i in np.asarray(leaves).tolist()]

    def same_addresses(self, other: Nodes) -> bool:
        """Whether leaf i has the same address in both trees, for every i (and no other leaf)."""
        return (
            self.segments == other.segments
            and np.array_equal(self.table, other.table)
            and np.array_equal(self.leaves, other.leaves)
        )

    def _children(self) -> tuple[np.ndarray, np.ndarray]:
        """Every node but the root grouped by parent (one stable sort, made on first use): the
        children of node n are ``order[starts[n]:starts[n + 1]]``, in node order."""
        found = self.__dict__.get("_children_by_parent")
        if found is None:
            parent = self.table["parent"].astype(np.int64)
            parent[0] = -1  # the root is its own parent
            found = self.__dict__["_children_by_parent"] = children_by_parent(parent, len(parent))
        return found

    def _child(self, node: int, segment: str, loose: bool) -> list[int]:
        """The children of ``node`` whose key is spelled ``segment`` (read loosely: see
        :meth:`find_loose`). Each node's children are looked at once, when first walked through,
        and kept by spelling: a lookup walks only its own path, and later ones probe dicts."""
        cache = self.__dict__.setdefault("_loose_children" if loose else "_exact_children", {})
        kids = cache.get(node)
        if kids is None:
            order, starts = self._children()
            kids = {}
            children = order[starts[node] : starts[node + 1]]
            spell = loose_segment if loose else str
            for child, key in zip(children.tolist(), self.table["key"][children].tolist(), strict=True):
                kids.setdefault(spell(self.segments[key]), []).append(child)
            cache[node] = kids
        return kids.get(loose_segment(segment) if loose else segment, [])

    def _walk(self, address: str, loose: bool) -> int | None:
        node = 0
        for segment in address.split("/") if address else ():
            hits = self._child(node, segment, loose)
            if len(hits) != 1:
                return None
            node = hits[0]
        leaf_of = self.__dict__.get("_leaf_of_node")
        if leaf_of is None:  # each node's leaf index, -1 for a container
            leaf_of = np.full(len(self.table), -1, np.int64)
            leaf_of[self.leaf_node] = np.arange(len(self.leaf_node))
            self.__dict__["_leaf_of_node"] = leaf_of
        leaf = int(leaf_of[node])
        return leaf if leaf >= 0 else None

    def find(self, address: str) -> int | None:
        """The leaf index at ``address``, or None: a walk down from the root, no address built."""
        return self._walk(address, loose=False)

    def find_loose(self, address: str) -> int | None:
        """The leaf index at ``address`` with digit keys read loosely (``h/3/w`` for
        ``h/"3"/w``, see :func:`treestore._format.select.loose_segment`), or None when no leaf
        or more than one is there."""
        return self._walk(address, loose=True)

    def tree_record(self) -> dict[str, Any]:
        """The version-1 node record of this tree (SPEC.md, appendix A.3)."""
        kinds = self.table["kind"].tolist()
        parents = self.table["parent"].tolist()
        keys = self.table["key"].tolist()
        records = [key_to_record(canonical_segment(s)) for s in self.segments]
        names = iter(self.names)
        leaves = iter(self.leaves.tolist())
        made: list[dict[str, Any]] = []
        for i, code in enumerate(kinds):
            kind = NODE_KINDS[code]
            node: dict[str, Any]
            if code == LEAF:
                node = {"type": "leaf", "leaf": next(leaves)}
            elif code == NONE:
                node = {"type": "none"}
            elif code in (LIST, TUPLE):
                node = {"type": kind, "children": []}
            elif code in (DICT, ORDEREDDICT):
                node = {"type": kind, "keys": [], "children": []}
            else:
                node = {"type": kind, "name": next(names), "keys": [], "children": []}
            made.append(node)
            if i:
                up = made[parents[i]]
                up["children"].append(node)
                if "keys" in up:
                    up["keys"].append(records[keys[i]])
        return made[0]


def nodes_from_tree(tree: object, nleaves: int) -> Nodes:
    """The node table of a version-1 node record (as :func:`treestore._tree.structure.flatten`
    writes it), validated as a reader validates it; Bad (or UnsupportedFormatError) otherwise."""
    kinds: list[int] = []
    parents: list[int] = []
    keys: list[int] = []
    names: list[str] = []
    leaves: list[int] = []
    where: dict[str, int] = {}
    stack: list[tuple[object, int, str]] = [(tree, 0, "")]  # (node, parent, segment)
    while stack:
        node, parent, segment = stack.pop()
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            raise Bad("tree node is not a map with a str 'type'")
        code = _NODE_CODES.get(node["type"])
        if code is None:
            raise UnsupportedFormatError(f"unsupported node kind {node['type']!r}")
        here = len(kinds)
        if here % ROOM_EVERY == 0:
            check_room()  # stop while running out can still be reported
        kinds.append(code)
        parents.append(parent)
        keys.append(where.setdefault(segment, len(where)) if here else 0)
        if code == LEAF:
            leaf = node.get("leaf")
            if type(leaf) is not int or not 0 <= leaf < 2**32:
                raise Bad(f"leaf index should be an integer in [0, {nleaves - 1}], found {leaf!r:.40}")
            leaves.append(leaf)
            continue
        if code == NONE:
            continue
        children = node.get("children")
        if not isinstance(children, list):
            raise Bad(f"field 'children' of a {node['type']} node should be a list")
        if code in (LIST, TUPLE):
            segments = [str(j) for j in range(len(children))]
        else:
            records = node.get("keys")
            if not isinstance(records, list) or len(records) != len(children):
                raise Bad(f"{node['type']} node should have one key per child")
            try:
                segments = [format_key(key_from_record(k)) for k in records]
            except TreestoreError as exc:
                raise Bad(f"bad key in {node['type']} node: {exc}") from None
            if code >= NAMEDTUPLE:
                if not isinstance(node.get("name"), str):
                    raise Bad(f"field 'name' of a {node['type']} node should be str")
                names.append(node["name"])
        stack.extend((c, here, s) for s, c in zip(reversed(segments), reversed(children), strict=True))
    table = np.zeros(len(kinds), NODE_DTYPE)
    table["kind"], table["parent"], table["key"] = kinds, parents, keys
    return check_nodes(tuple(where), table, tuple(names), np.array(leaves, "<u4"), nleaves)


def _segment_keys(segments: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each segment: its key kind, its sequence index (else -1) and an id of its key's value
    (equal ids for keys that would be one dict key without a template)."""
    kind = np.empty(len(segments), np.int8)
    index = np.full(len(segments), -1, np.int64)
    value = np.empty(len(segments), np.int64)
    values: dict[object, int] = {}
    for i, segment in enumerate(segments):
        if i % ROOM_EVERY == 0:
            check_room()  # stop while running out can still be reported
        if type(segment) is not str:
            raise Bad(f"segment {i} should be str, found {type(segment).__name__}")
        try:
            key: Key = canonical_segment(segment)
        except TreestoreError as exc:
            raise Bad(f"bad address segment: {exc}") from None
        if isinstance(key, SequenceKey):
            kind[i], index[i] = _SEQ, key.idx
        elif isinstance(key, DictKey):
            kind[i] = _DICT
        elif isinstance(key, GetAttrKey):
            kind[i] = _ATTR
        else:
            assert isinstance(key, FlattenedIndexKey)
            kind[i] = _FLAT
        value[i] = values.setdefault(key_value(key), len(values))
    return kind, index, value


def check_nodes(
    segments: tuple[str, ...], table: np.ndarray, names: tuple[str, ...], leaves: np.ndarray, nleaves: int
) -> Nodes:
    """Validate a node table for ``nleaves`` leaves; Bad or UnsupportedFormatError otherwise."""
    m = len(table)
    if m < 1:
        raise Bad("the tree has no root node")
    kind, parent, key = (table[f].astype(np.int64) for f in ("kind", "parent", "key"))
    if kind.max() >= len(NODE_KINDS):
        raise UnsupportedFormatError(f"unsupported node kind code {int(kind.max())}")
    if parent[0] or key[0]:
        raise Bad("the root node should have parent 0 and key 0")
    if len(set(segments)) != len(segments):
        raise Bad("the segment table repeats a segment")
    seg_kind, seg_index, seg_value = _segment_keys(segments)
    child = np.arange(1, m)
    up, k = parent[1:], key[1:]
    if (up >= child).any():
        i = int(child[np.argmax(up >= child)])
        raise Bad(f"node {i} has parent {int(parent[i])}, not an earlier node")
    if (kind[up] < LIST).any():
        raise Bad("a leaf or none node has children")
    if (k >= len(segments)).any():
        raise Bad(f"a node's key is outside the {len(segments)} segments")
    if len(segments) and np.bincount(k, minlength=len(segments)).min() == 0:
        raise Bad("a segment is used by no node")
    parent_kind = kind[up]
    sequence = (parent_kind == LIST) | (parent_kind == TUPLE)
    # A child's position among its parent's children (children follow in node order).
    order = np.argsort(up, kind="stable")
    sorted_up = up[order]
    first = np.r_[True, sorted_up[1:] != sorted_up[:-1]][: m - 1]
    start = np.maximum.accumulate(np.where(first, np.arange(m - 1), 0))
    rank = np.empty(m - 1, np.int64)
    rank[order] = np.arange(m - 1) - start
    if (sequence & ((seg_kind[k] != _SEQ) | (seg_index[k] != rank))).any():
        raise Bad("a list or tuple child's key is not its position")
    if (((parent_kind == DICT) | (parent_kind == ORDEREDDICT)) & (seg_kind[k] != _DICT)).any():
        raise Bad("a dict node has a key that is not a dict key")
    pairs = np.sort(up * max(len(segments), 1) + seg_value[k])
    if (pairs[1:] == pairs[:-1]).any():
        raise Bad("two children of one node have the same key (as segments or as dict keys)")
    _check_depth(parent, m)
    _check_address_lengths(segments, parent, key)
    if len(names) != int(np.count_nonzero(kind >= NAMEDTUPLE)) or any(type(n) is not str for n in names):
        raise Bad("there should be one str name per namedtuple or custom node")
    is_leaf = kind == LEAF
    if int(np.count_nonzero(is_leaf)) != nleaves or len(leaves) != nleaves:
        raise Bad(f"the tree has {int(np.count_nonzero(is_leaf))} leaf nodes for {nleaves} leaves")
    leaves = leaves.astype(np.int64)
    if nleaves and (leaves.max() >= nleaves or np.bincount(leaves, minlength=nleaves).max() != 1):
        raise Bad("the leaf nodes do not name every leaf exactly once")
    leaf_node = np.empty(nleaves, np.int64)
    leaf_node[leaves] = np.flatnonzero(is_leaf)
    out = Nodes(segments, table, names, leaves.astype("<u4"), leaf_node)
    for array in (out.table, out.leaves, out.leaf_node):
        array.flags.writeable = False
    return out


def _check_address_lengths(segments: tuple[str, ...], parent: np.ndarray, key: np.ndarray) -> None:
    """Every node's address within MAX_ADDRESS_CHARS and all of them together within
    MAX_ADDRESSES_CHARS, found from the segments' lengths without building an address: a node's
    length is the sum over its ancestors, summed by pointer jumping (depth is bounded already,
    so about log2(MAX_DEPTH) numpy passes). Segments are shared, so a small manifest could
    otherwise name addresses of gigabytes."""
    width = np.zeros(len(parent), np.int64)  # each node's segment and the "/" before it
    if len(segments):
        chars = np.fromiter((len(s) for s in segments), np.int64, len(segments))
        width[1:] = chars[key[1:]] + 1
    length, up = width, parent
    while up.any():
        length, up = length + length[up], up[up]
    length = np.maximum(length - 1, 0)  # no "/" before the first segment
    if len(length) and int(length.max()) > MAX_ADDRESS_CHARS:
        node = int(np.argmax(length))
        raise Bad(
            f"the address of node {node} is {int(length[node])} characters long, over the limit "
            f"of {MAX_ADDRESS_CHARS}"
        )
    if int(length.sum()) > MAX_ADDRESSES_CHARS:
        raise Bad(
            f"the tree's addresses add up to {int(length.sum())} characters, over the limit of "
            f"{MAX_ADDRESSES_CHARS}"
        )


def _check_depth(parent: np.ndarray, m: int) -> None:
    """No node deeper than MAX_DEPTH: the MAX_DEPTH-th ancestor of every node is the root (the
    root being its own parent), found by composing the parent map with itself."""
    result = np.arange(m)
    power = parent.copy()
    steps = MAX_DEPTH
    while steps:
        if steps & 1:
            result = power[result]
        steps >>= 1
        if steps:
            power = power[power]
    if (result != 0).any():
        raise Bad(f"tree is nested deeper than {MAX_DEPTH}")
