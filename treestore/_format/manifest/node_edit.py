"""Edits of node tables by address: a base checkpoint's tree with subtrees dropped, moved and
attached, the work of :func:`treestore._api.derive.derive`.

:class:`NodesEdit` lays the base's node table (:class:`~treestore._format.manifest.tree.Nodes`)
and the tables of the new subtrees (as :func:`treestore._tree.prepare.prepare` makes them) end to
end in one pool of numpy arrays: each node's kind, parent, key segment, type name and leaf. An
edit changes a few entries (a dropped or moved node's parent, a moved node's key), so nodes not
touched keep their kind, key and type name (a flax module stays a ``custom`` node with
``.attr`` keys). A node's children are found from an index of the pool's first parents, or, for
a node that was given a child, from its own list of children.

:meth:`NodesEdit.result` prunes the containers the edits emptied and numbers the nodes as a
writer does (depth first, each node's children in order), the leaves in jax's flattening order.
Walks over the whole tree are numpy passes, one per level or per doubling of depth, never a
Python recursion: a tree as deep as MAX_DEPTH needs no deep stack.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from treestore._format import select as _select
from treestore._format.address import (
    DictKey,
    Key,
    SequenceKey,
    canonical_segment,
    check_node_keys,
    format_key,
    join_address,
    parse_address,
)
from treestore._format.limits import MAX_DEPTH
from treestore._format.manifest import node_order as _order
from treestore._format.manifest.tree import (
    DICT,
    LEAF,
    LIST,
    NAMEDTUPLE,
    NODE_DTYPE,
    NODE_KINDS,
    ORDEREDDICT,
    TUPLE,
    Nodes,
    check_nodes,
    children_by_parent,
)
from treestore.errors import InvalidInputError, NoMatchError, TreestoreError

# The pool's arrays, and what a node made later starts with.
_FILL = {"kind": 0, "parent": -1, "seg": -1, "name": -1, "source": -1, "leaf": -1, "emptied": False}


@dataclass(frozen=True)
class Derived:
    """An edited tree: its checked node table, and where each of its leaves (in leaf order, jax's
    flattening order) comes from: ``source`` 0 for a base leaf, 1 for a new one, ``leaf`` its
    index there."""

    nodes: Nodes
    source: np.ndarray
    leaf: np.ndarray


@dataclass(frozen=True)
class _Tree:
    """The nodes reachable from the root, numbered compactly (the root 0): their pool ids, their
    parents (the root its own) and depths."""

    ids: np.ndarray
    parent: np.ndarray
    depth: np.ndarray


class NodesEdit:
    """The tree being derived from checkpoint ``checkpoint``'s nodes ``base``; ``grafts`` are the
    trees that may be attached (their roots are :attr:`grafts`, their leaves are new leaves,
    numbered from the first graft's on)."""

    def __init__(self, base: Nodes, checkpoint: str, grafts: Sequence[Nodes] = ()) -> None:
        self.checkpoint = checkpoint
        self.segments: list[str] = []
        self._segment_ids: dict[str, int] = {}
        self.names: list[str] = []
        tables = [base, *grafts]
        starts = np.cumsum([0] + [len(t.table) for t in tables]).tolist()
        n = starts[-1]
        self.kind = np.concatenate([t.table["kind"] for t in tables])
        self.parent = np.empty(n, np.int64)
        self.seg = np.full(n, -1, np.int64)  # index in ``segments`` (-1: a root)
        self.name = np.full(n, -1, np.int64)  # index in ``names`` (-1: none)
        self.source = np.full(n, -1, np.int8)  # leaves: 0 a base leaf, 1 a new leaf
        self.leaf = np.full(n, -1, np.int64)  # leaves: the leaf's index in its source
        self.emptied = np.zeros(n, bool)  # a child was removed here: pruned if it ends up empty
        new = 0
        for k, (t, start) in enumerate(zip(tables, starts[:-1], strict=True)):
            m, table = len(t.table), t.table
            self.parent[start : start + m] = table["parent"].astype(np.int64) + start
            self.parent[start] = -1
            ids = np.array([self._segment(s) for s in t.segments], np.int64)
            self.seg[start + 1 : start + m] = ids[table["key"][1:].astype(np.int64)]
            named = np.flatnonzero(table["kind"] >= NAMEDTUPLE) + start
            self.name[named] = np.arange(len(t.names)) + len(self.names)
            self.names.extend(t.names)
            leaves = np.flatnonzero(table["kind"] == LEAF) + start
            self.source[leaves] = min(k, 1)
            self.leaf[leaves] = t.leaves.astype(np.int64) + (new if k else 0)
            new += len(t.leaves) if k else 0
        self.root = 0
        self.grafts = starts[1:-1]  # the root of each graft
        self.count = n  # nodes in the pool (its arrays may be longer)
        # Each node's children as the pool was made, in node order: those with parent p are
        # _first_kids[_kid_start[p]:_kid_start[p + 1]] while it still is their parent.
        self._first_kids, self._kid_start = children_by_parent(self.parent, n)
        self._kids: dict[int, np.ndarray] = {}  # the children of a node given a child since
        self._heights: np.ndarray | None = None

    def _segment(self, segment: str) -> int:
        found = self._segment_ids.setdefault(segment, len(self.segments))
        if found == len(self.segments):
            self.segments.append(segment)
        return found

    def children(self, node: int) -> np.ndarray:
        """The children of ``node``, in order."""
        kids = self._kids.get(node)
        if kids is not None:
            return kids
        if node >= len(self._kid_start) - 1:
            return np.zeros(0, np.int64)
        first = self._first_kids[self._kid_start[node] : self._kid_start[node + 1]]
        return first[self.parent[first] == node]

    def _container(self, node: int) -> bool:
        return int(self.kind[node]) >= LIST

    def _child(self, node: int, segment: str) -> int | None:
        """The child of ``node`` at ``segment``; as in patterns, the quotes around a digit-only
        dict key may be left out (``h/11`` finds the child ``h/"11"`` of a dict)."""
        if not self._container(node):
            return None
        kids = self.children(node)
        for s in (segment, f'"{segment}"' if segment.isdigit() and segment.isascii() else None):
            k = self._segment_ids.get(s) if s is not None else None
            if k is not None:
                hit = kids[self.seg[kids] == k]
                if len(hit):
                    return int(hit[0])
        return None

    def find(self, address: str) -> int | None:
        """The node at ``address``, or None when there is none."""
        node = self.root
        for segment in address.split("/") if address else []:
            child = self._child(node, segment)
            if child is None:
                return None
            node = child
        return node

    def _listing(self) -> tuple[_Tree, np.ndarray, list[str]]:
        """The tree, its nodes but the root in depth-first order (children in order), and their
        addresses."""
        tree = self._tree()
        pos, _ = _order.preorder(tree.parent, _order.subtree_sizes(tree.parent, tree.depth), self._rank(tree))
        order = np.empty(len(pos), np.int64)
        order[pos] = np.arange(len(pos))
        order = order[1:]
        segments, seg = self.segments, self.seg[tree.ids].tolist()
        parents = tree.parent.tolist()
        at = [""] * len(parents)
        for c in order.tolist():
            p = parents[c]
            at[c] = segments[seg[c]] if p == 0 else f"{at[p]}/{segments[seg[c]]}"
        return tree, order, [at[c] for c in order.tolist()]

    def missing(self, address: str, what: str) -> NoMatchError:
        known = self._listing()[2]
        near = difflib.get_close_matches(address, known, n=5, cutoff=0.3) or known[:5]
        hint = f"; nearest addresses: {', '.join(repr(a) for a in near)}" if near else ""
        return NoMatchError(
            f"{what}: no leaf or subtree {address!r} in checkpoint {self.checkpoint!r}{hint}",
            checkpoint=self.checkpoint,
            address=address,
        )

    def drop(self, patterns: _select.Patterns) -> list[str]:
        """Remove every node whose address matches a pattern; NoMatchError for a pattern that
        matches no address of a leaf or subtree. Returns the addresses removed (not those under
        another one removed), in depth-first order."""
        tree, order, addresses = self._listing()
        where = f"checkpoint {self.checkpoint!r}"
        chosen = set(_select.select(addresses, patterns, where=where, checkpoint=self.checkpoint))
        hit = np.fromiter((a in chosen for a in addresses), bool, len(addresses))
        mask = np.zeros(len(tree.ids), np.int64)
        mask[order[hit]] = 1
        above = _order.ancestor_sums(mask, tree.parent) - mask  # chosen strict ancestors
        top = hit & (above[order] == 0)
        gone = tree.ids[order[top]]
        self._cut(gone)
        return [a for a, t in zip(addresses, top.tolist(), strict=True) if t]

    def _cut(self, nodes: np.ndarray) -> None:
        """Detach ``nodes`` from their parents, which count as emptied."""
        parents = self.parent[nodes]
        self.parent[nodes] = -1
        self.emptied[parents] = True
        for p in set(parents.tolist()) & self._kids.keys():
            kids = self._kids[p]
            self._kids[p] = kids[self.parent[kids] == p]

    def detach(self, node: int) -> tuple[int, int]:
        """Remove ``node`` from its parent; returns the parent and the position it had there."""
        parent = int(self.parent[node])
        j = int(np.flatnonzero(self.children(parent) == node)[0])
        self._cut(np.array([node]))
        return parent, j

    def attach(self, address: str, node: int, what: str, place: tuple[int, int] | None = None) -> None:
        """Put ``node`` at ``address``: in place of what is there, or under a new key of a dict
        (custom) node, creating missing dicts on the way (at ``place[1]`` among the children of
        ``place[0]``, if it is met); the result must stay within the depth readers accept."""
        keys = parse_address(address)
        if not keys:
            self.root = node
            return
        parent, at = self.root, ""
        for depth, key in enumerate(keys):
            segment = format_key(key)
            last = depth == len(keys) - 1
            if not self._container(parent):
                raise InvalidInputError(
                    f"{what}: {at or '(root)'!r} is a leaf in checkpoint {self.checkpoint!r}, not a "
                    f"subtree that {address!r} could lie in",
                    checkpoint=self.checkpoint,
                    address=address,
                )
            j = self._child(parent, segment)
            if j is not None:
                at = join_address(at, self.segments[self.seg[j]])
                if last:
                    self._replace(parent, j, node)
                else:
                    parent = j
                continue
            if isinstance(key, SequenceKey) and int(self.kind[parent]) in (DICT, ORDEREDDICT):
                key = DictKey(segment)  # a bare index under a dict names a digit-only str key
                segment = format_key(key)
            child = node if last else self._new_dict()
            kids = self.children(parent)
            index = place[1] if place is not None and place[0] == parent else len(kids)
            self._add_key(parent, at, key, segment, child, what, address, min(index, len(kids)))
            parent = child
            at = join_address(at, segment)
        if len(keys) + self._height(node) > MAX_DEPTH:
            raise InvalidInputError(
                f"{what}: {address!r} would put the tree's deepest node below depth {MAX_DEPTH}, "
                "the most readers accept",
                checkpoint=self.checkpoint,
                address=address,
            )

    def _replace(self, parent: int, old: int, node: int) -> None:
        kids = self.children(parent).copy()
        kids[kids == old] = node
        self._kids[parent] = kids
        self.parent[old], self.parent[node], self.seg[node] = -1, parent, self.seg[old]

    def _new_dict(self) -> int:
        if self.count == len(self.kind):  # room for more, amortised
            grow = max(64, len(self.kind) // 2)
            for name, fill in _FILL.items():
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.full(grow, fill, old.dtype)]))
        node = self.count
        self.count += 1
        self.kind[node], self.parent[node], self.emptied[node] = DICT, -1, False
        self._kids[node] = np.zeros(0, np.int64)
        return node

    def _add_key(
        self, parent: int, at: str, key: Key, segment: str, child: int, what: str, address: str, index: int
    ) -> None:
        kind = NODE_KINDS[self.kind[parent]]
        kids = self.children(parent)
        if kind in ("list", "tuple"):
            ok = isinstance(key, SequenceKey) and key.idx == len(kids)
            rule = f"a {kind} grows only at its end (index {len(kids)})"
        elif kind in ("dict", "ordereddict"):
            ok = isinstance(key, DictKey)
            rule = "a dict takes only dict keys (no '.attr', '#i' or index segments)"
        else:
            ok = not isinstance(key, SequenceKey)
            rule = f"a {kind} node takes no index keys"
        if not ok:
            raise InvalidInputError(
                f"{what}: cannot add {address!r} to checkpoint {self.checkpoint!r}: {rule} "
                f"({at or '(root)'} is a {kind})",
                checkpoint=self.checkpoint,
                address=address,
            )
        segments = [self.segments[s] for s in self.seg[kids].tolist()] + [segment]
        try:
            check_node_keys([*map(canonical_segment, segments[:-1]), key], segments, at)
        except TreestoreError as exc:
            raise InvalidInputError(f"{what}: {exc}", checkpoint=self.checkpoint, address=address) from None
        self._kids[parent] = np.insert(kids, index, child)
        self.parent[child], self.seg[child] = parent, self._segment(segment)

    def _height(self, node: int) -> int:
        """How many container levels ``node`` spans (0 for a leaf). The subtrees attached (new
        ones, and moved ones once every drop and move has detached what it detaches) never change
        while attaching, so the heights of every pool node are found once, level by level."""
        if self._heights is None:
            self._heights = _order.heights(self.parent[: self.count], self.kind[: self.count] >= LIST)
        return int(self._heights[node])

    def _tree(self) -> _Tree:
        """The nodes reachable from the root."""
        n = self.count
        top, depth = _order.climb(self.parent[:n])
        live = np.flatnonzero(top == self.root)
        ids = np.r_[self.root, live[live != self.root]]
        compact = np.full(n, -1, np.int64)
        compact[ids] = np.arange(len(ids))
        parent = compact[self.parent[ids]]
        parent[0] = 0
        return _Tree(ids, parent, depth[ids])

    def _rank(self, tree: _Tree) -> np.ndarray:
        """Each node's rank among its siblings, in their order."""
        rank = np.arange(self.count)
        for kids in self._kids.values():
            rank[kids] = np.arange(len(kids))
        return rank[tree.ids]

    def _pruned(self, tree: _Tree) -> _Tree:
        """``tree`` without the containers the edits emptied (as a partial load leaves them out);
        a container left empty by that is removed in turn."""
        emptied = self.emptied[tree.ids]
        if not emptied[1:].any():
            return tree
        container = self.kind[tree.ids] >= LIST
        count = np.bincount(tree.parent[1:], minlength=len(tree.ids))
        kept = np.ones(len(tree.ids), bool)
        for level in reversed(_order.levels(tree.depth)[1 : int(tree.depth[emptied].max()) + 1]):
            gone = level[container[level] & emptied[level] & (count[level] == 0)]
            kept[gone] = False
            np.subtract.at(count, tree.parent[gone], 1)
            emptied[tree.parent[gone]] = True
        ids = np.flatnonzero(kept)
        compact = np.cumsum(kept) - 1
        return _Tree(tree.ids[ids], compact[tree.parent[ids]], tree.depth[ids])

    def result(self) -> Derived:
        """The edited tree, pruned, as a checked node table (Bad or UnsupportedFormatError when
        readers would refuse it): nodes numbered depth first with each node's children in order,
        segments and type names in the order of their first node, leaves in jax's order."""
        tree = self._pruned(self._tree())
        sizes = _order.subtree_sizes(tree.parent, tree.depth)
        rank = self._rank(tree)
        pos, sibling = _order.preorder(tree.parent, sizes, rank)
        jax_pos, _ = _order.preorder(
            tree.parent,
            sizes,
            _order.jax_rank(tree.parent, self.kind[tree.ids], self.seg[tree.ids], self.segments, rank),
        )
        order = np.empty(len(pos), np.int64)
        order[pos] = np.arange(len(pos))
        ids = tree.ids[order]
        kinds = self.kind[ids]
        up = tree.parent[order]
        seg = self.seg[ids]
        # A list's or tuple's children are keyed by their positions, renumbered after removals.
        seq = np.flatnonzero(np.isin(self.kind[tree.ids[up]], (LIST, TUPLE)))
        seq = seq[seq > 0]
        index, at = np.unique(sibling[order][seq], return_inverse=True)
        seg[seq] = np.array([self._segment(str(i)) for i in index.tolist()], np.int64)[at]
        used, first = np.unique(seg[1:], return_index=True)
        by_first = np.argsort(first, kind="stable")
        number = np.empty(len(used), np.int64)
        number[by_first] = np.arange(len(used))
        table = np.zeros(len(ids), NODE_DTYPE)
        table["kind"], table["parent"] = kinds, pos[up]
        table["key"][1:] = number[np.searchsorted(used, seg[1:])]
        leaf_nodes = np.flatnonzero(kinds == LEAF)
        flat = leaf_nodes[np.argsort(jax_pos[order][leaf_nodes], kind="stable")]  # in jax's order
        leaves = np.empty(len(ids), np.int64)
        leaves[flat] = np.arange(len(flat))
        nodes = check_nodes(
            tuple(self.segments[s] for s in used[by_first].tolist()),
            table,
            tuple(self.names[i] for i in self.name[ids[kinds >= NAMEDTUPLE]].tolist()),
            leaves[leaf_nodes].astype("<u4"),
            len(flat),
        )
        return Derived(nodes, self.source[ids[flat]].astype(np.int64), self.leaf[ids[flat]])


__all__ = ["Derived", "NodesEdit"]
