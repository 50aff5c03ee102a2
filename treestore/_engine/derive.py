"""Derived checkpoints, the engine's half: a base checkpoint's tree edited as its node table
(:mod:`treestore._format.manifest.node_edit`: numpy arrays, no object per node) and written through the
one door (:mod:`treestore._engine.saving.writing`), under a save lock taken before the base is read, so
that no gc can remove the base's chunks before the derived checkpoint references them.

Nodes that are not touched keep their type, keys and type name and load with the same template
as before; the edited table is the derived manifest's. Leaves that are kept keep their chunk refs
(with their pack indices renumbered, keeping only the packs still referenced) under their new
addresses; new subtrees' leaves go through the one chunk writer. The arguments are checked by
:mod:`treestore._api.derive` first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from treestore._engine.reading import committed as _committed
from treestore._engine.saving.chunk_writer import SaveResult
from treestore._engine.saving.save_options import SaveOptions
from treestore._engine.saving.writing import Writing, writing
from treestore._format import select as _select
from treestore._format.encoding import Bad
from treestore._format.manifest.columns import Columns
from treestore._format.manifest.node_edit import Derived, NodesEdit
from treestore._format.manifest.take import take_leaves
from treestore._format.manifest.tree import Nodes, nodes_from_tree
from treestore._storage.base import Storage
from treestore._tree import prepare as _prepare
from treestore.errors import InvalidInputError, UnsupportedFormatError

KEEP: Any = ...  # metadata=KEEP (the default) keeps the base's metadata


def loose(address: str) -> str:
    """``address`` with its quoted digit-only dict keys unquoted (``h/"3"`` -> ``h/3``)."""
    return "/".join(
        s[1:-1] if len(s) > 2 and s[0] == s[-1] == '"' and s[1:-1].isdigit() else s
        for s in address.split("/")
    )


def under(a: str, b: str) -> bool:
    """Whether address ``a`` lies strictly under address ``b``."""
    return loose(a).startswith(loose(b) + "/")


def overlap(a: str, b: str) -> bool:
    """Whether one of two addresses is the other or lies under it."""
    a, b = loose(a), loose(b)
    return a == b or not a or not b or b.startswith(a + "/") or a.startswith(b + "/")


def derive(
    storage: Storage,
    base: str,
    new: str,
    grafts: list[tuple[str, Nodes]],
    new_leaves: list[Any],
    moves: list[tuple[str, str]],
    drop: _select.Patterns,
    metadata: Any,
    overwrite: bool,
    options: SaveOptions,
) -> SaveResult:
    """Commit checkpoint ``new``: checkpoint ``base`` with the subtrees matching ``drop``
    removed, then those under each ``moves`` source moved to its target, then each of ``grafts``
    (an address and the nodes of a prepared tree, whose leaves are ``new_leaves`` in order)
    attached at its address; ``metadata``: the new checkpoint's, or KEEP."""
    keep = metadata is KEEP
    checked = None if keep else metadata
    with writing(storage, new, options=options, overwrite=overwrite, metadata=checked, previous=False) as w:
        # Read under the lock: from now until the commit no gc runs, so every chunk the base
        # references (it is committed) stays in the store.
        record = _committed.read_commit_record(storage, base)
        columns = _committed.read_columns(storage, record)
        w.trust(record.name, columns)  # no request for them
        tree = NodesEdit(columns.nodes, base, [nodes for _, nodes in grafts])
        moving = _resolve_moves(tree, moves)
        if drop is not None:
            removed = tree.drop(drop)
            for src, _, _ in moving:
                gone = [r for r in removed if loose(src) == loose(r) or under(src, r)]
                if gone:
                    raise InvalidInputError(
                        f"rename {src!r} conflicts with drop: {gone[0]!r} is dropped", address=src
                    )
        _apply_moves(tree, moving)
        for (address, _), root in zip(grafts, tree.grafts, strict=True):
            tree.attach(address, root, f"set {address!r}")
        try:
            derived = tree.result()
        except (Bad, UnsupportedFormatError) as exc:  # as columns_from_fields says it
            raise InvalidInputError(
                f"checkpoint {new!r}: its manifest would not be readable: {exc}", checkpoint=new
            ) from None
        if keep:
            w.metadata = columns.metadata
        return _write_derived(w, columns, derived, new_leaves)


Move = tuple[str, str, int]  # source, target, the node of the subtree


def _resolve_moves(tree: NodesEdit, moves: list[tuple[str, str]]) -> list[Move]:
    """The subtree each rename moves, found at its address in the base."""
    moving = []
    for src, dst in moves:
        node = tree.find(src)
        if node is None:
            raise tree.missing(src, f"rename {src!r}")
        moving.append((src, dst, node))
    return moving


def _apply_moves(tree: NodesEdit, moving: list[Move]) -> None:
    """Detach every source, then attach each at its target: a subtree renamed within its
    parent keeps its position there (its dict key order)."""
    places = [tree.detach(node) for _, _, node in moving]
    for (src, dst, node), place in reversed(list(zip(moving, places, strict=True))):
        if tree.find(dst) is not None:
            raise InvalidInputError(
                f"rename {src!r} -> {dst!r}: checkpoint {tree.checkpoint!r} already has {dst!r} "
                "(drop it, or rename it too)",
                checkpoint=tree.checkpoint,
                address=dst,
            )
        tree.attach(dst, node, f"rename {src!r} -> {dst!r}", place)


def _write_derived(w: Writing, base: Columns, tree: Derived, new_leaves: list[Any]) -> SaveResult:
    """Write the new leaves' chunks through ``w`` (which takes the base's chunks as trusted),
    then commit. The derived manifest's columns are the kept leaves' rows of the base
    (statistics included) and the new leaves' as a save records them, in the order of the new
    tree."""
    placed = np.flatnonzero(tree.source == 1)
    addresses = dict(zip(tree.leaf[placed].tolist(), tree.nodes.leaf_addresses(placed), strict=True))
    prepared = _prepare.Prepared(  # only its leaves are written: the tree is the one built here
        nodes_from_tree({"type": "none"}, 0),
        tuple((addresses.get(i, ""), leaf) for i, leaf in enumerate(new_leaves)),
    )
    table, new_packs = w.write_leaves(prepared)
    flat = {"type": "list", "children": [{"type": "leaf", "leaf": k} for k in range(len(table))]}
    fresh = w.columns(table.fields(new_packs), flat)
    # the reader's checks, before anything refers to it
    return w.commit(w.columns(take_leaves((base, fresh), tree.source, tree.leaf), tree.nodes))
