"""Orders of a tree given as a parent array, found with numpy: each node's depth, subtree size,
position in depth-first order and rank among its siblings in jax's flattening order.

Each is a few numpy passes, one per level of the tree or one per doubling of its depth (pointer
jumping), never a Python recursion or a Python step per node: a tree as deep as MAX_DEPTH, or as
wide as a manifest holds, costs no deep stack. Trees here are numbered compactly with the root
0, its own parent; :func:`climb` takes a forest (parent -1 at each root).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from treestore._format.address import canonical_segment, key_value
from treestore._format.manifest.tree import DICT


def climb(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a forest (``parent`` -1 at its roots): each node's root and depth below it, by pointer
    jumping (about log2(depth) numpy passes)."""
    up = np.where(parent < 0, np.arange(len(parent)), parent)
    depth = (parent >= 0).astype(np.int64)
    while True:
        further = up[up]
        if np.array_equal(further, up):
            return up, depth
        depth = depth + depth[up]
        up = further


def levels(depth: np.ndarray) -> list[np.ndarray]:
    """The nodes at each depth, from the root's down."""
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(int(depth.max(initial=0)) + 2))
    return [order[bounds[d] : bounds[d + 1]] for d in range(len(bounds) - 1)]


def subtree_sizes(parent: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """The number of nodes in each node's subtree (root 0, its own parent), level by level."""
    sizes = np.ones(len(parent), np.int64)
    for level in reversed(levels(depth)[1:]):
        np.add.at(sizes, parent[level], sizes[level])
    return sizes


def heights(parent: np.ndarray, container: np.ndarray) -> np.ndarray:
    """For a forest (``parent`` -1 at its roots): how many container levels each node's subtree
    spans (0 for a leaf or none node), level by level from the deepest."""
    _, depth = climb(parent)
    out = container.astype(np.int64)
    for level in reversed(levels(depth)[1:]):
        np.maximum.at(out, parent[level], out[level] + 1)
    return out


def ancestor_sums(values: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """For each node, the sum of ``values`` over it and its ancestors but the root (root 0, its own
    parent, value 0 or not counted), by pointer jumping."""
    total, up = values.copy(), parent.copy()
    total[0] = 0
    while up.any():
        total, up = total + total[up], up[up]
    return total


def preorder(parent: np.ndarray, sizes: np.ndarray, rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each node's position in depth-first order, siblings by ``rank`` (root 0, its own parent),
    and its position among its siblings."""
    kids = np.lexsort((rank[1:], parent[1:])) + 1  # the nodes but the root, by parent then rank
    up = parent[kids]
    first = np.ones(len(kids), bool)
    first[1:] = up[1:] != up[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(len(kids)), 0))
    before = np.cumsum(sizes[kids]) - sizes[kids]  # the nodes of the siblings before, and more
    step = np.zeros(len(parent), np.int64)
    step[kids] = 1 + before - before[start]
    sibling = np.zeros(len(parent), np.int64)
    sibling[kids] = np.arange(len(kids)) - start
    return ancestor_sums(step, parent), sibling


def jax_rank(
    parent: np.ndarray, kinds: np.ndarray, seg: np.ndarray, segments: list[str], rank: np.ndarray
) -> np.ndarray:
    """Each node's rank among its siblings in jax's flattening order, given their ``rank`` in
    their own order and each node's key segment (``segments[seg[i]]``): a dict's children by
    sorted key when its keys sort (all str, or all int and bool), others in their order."""
    under = np.flatnonzero(kinds[parent] == DICT)
    under = under[under > 0]
    if not len(under):
        return rank
    used, at = np.unique(seg[under], return_inverse=True)
    values: list[Any] = [key_value(canonical_segment(segments[s])) for s in used.tolist()]
    text = [type(v) is str for v in values]  # str keys sort among themselves, ints and bools too
    value_rank = np.empty(len(values), np.int64)
    for kind in (False, True):
        members = sorted((i for i, t in enumerate(text) if t == kind), key=values.__getitem__)
        value_rank[members] = np.arange(len(members))
    parents, is_text = parent[under], np.array(text, np.int64)[at]
    lo = np.full(len(parent), 2, np.int64)
    hi = np.full(len(parent), -1, np.int64)
    np.minimum.at(lo, parents, is_text)
    np.maximum.at(hi, parents, is_text)
    sortable = (lo == hi)[parents]
    out = rank.copy()
    out[under[sortable]] = value_rank[at][sortable]
    return out


__all__ = ["ancestor_sums", "climb", "heights", "jax_rank", "levels", "preorder", "subtree_sizes"]
