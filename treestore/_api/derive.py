"""Derived checkpoints: a base checkpoint with subtrees replaced, added, dropped or renamed, written
as a new manifest that references the base's chunks; only the new leaves' chunks are written.

The base's tree is edited as its node table (:mod:`treestore._format.nodes_edit`: numpy arrays,
no object per node), so nodes that are not touched keep their type, keys and type name and load
with the same template as before; the edited table is the derived manifest's. Leaves that are
kept keep their chunk refs (with their pack indices renumbered, keeping only the packs still
referenced) under their new addresses; new subtrees go through the one write path
(:func:`treestore._tree.prepare.prepare`, the chunk writer) and the result through the one
commit, under a save lock taken before the base is read, so no gc can remove the base's chunks
before the derived checkpoint references them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from treestore._engine import committed as _committed
from treestore._engine import locks as _locks
from treestore._engine import trusted as _trusted
from treestore._engine import write as _write
from treestore._engine.chunk_writer import ChunkWriter
from treestore._engine.commit import commit
from treestore._format import paths as _paths
from treestore._format import select as _select
from treestore._format.address import format_address, parse_address
from treestore._format.columns import Columns
from treestore._format.columns_codec import columns_from_fields, encode
from treestore._format.columns_take import take_leaves
from treestore._format.columns_tree import Nodes, nodes_from_tree
from treestore._format.encoding import Bad
from treestore._format.leaf_table import LeafTable
from treestore._format.manifest import check_metadata, check_name
from treestore._format.nodes_edit import Derived, NodesEdit
from treestore._storage.base import Storage
from treestore._tree import prepare as _prepare
from treestore.errors import CheckpointExistsError, InvalidInputError, TreestoreError, UnsupportedFormatError

KEEP: Any = ...  # metadata=KEEP (the default) keeps the base's metadata


def _pairs(value: Mapping[str, Any] | None, what: str) -> list[tuple[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise InvalidInputError(f"{what} must be a dict of address -> ..., got {type(value).__name__}")
    return list(value.items())


def canonical(address: object, what: str) -> str:
    """``address`` as its canonical spelling (InvalidInputError naming ``what`` otherwise)."""
    if not isinstance(address, str):
        raise InvalidInputError(f"{what}: an address is a str, got {type(address).__name__}")
    try:
        return format_address(parse_address(address))
    except TreestoreError as exc:
        raise InvalidInputError(f"{what}: {address!r} is not an address: {exc}") from None


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
    *,
    set: Mapping[str, Any] | None = None,
    drop: _select.Patterns = None,
    rename: Mapping[str, str] | None = None,
    metadata: Any = KEEP,
    overwrite: bool = False,
    options: _write.SaveOptions | None = None,
) -> _write.SaveResult:
    """Commit checkpoint ``new``: checkpoint ``base`` with the subtrees matching ``drop`` removed,
    then those under each ``rename`` key moved to its value, then each ``set`` address holding
    its tree (see :meth:`treestore.Store.derive`)."""
    check_name(base)
    check_name(new)
    options = options or _write.SaveOptions()
    sets = [(canonical(a, "set"), tree) for a, tree in _pairs(set, "set")]
    moves = [(canonical(a, "rename"), canonical(b, f"rename {a!r}")) for a, b in _pairs(rename, "rename")]
    if drop is not None:
        _select.patterns(drop)  # a bad argument fails before anything is read
    _check_conflicts(sets, moves)
    # Validate the new subtrees and copy them to host before any write (as a save does).
    new_leaves: list[Any] = []
    grafts: list[tuple[str, Nodes]] = []
    for address, tree in sets:
        try:
            prepared = _prepare.prepare(tree)
        except TreestoreError as exc:
            where = f"{address}/{exc.address}" if address and exc.address else address or exc.address
            exc.message = f"set {address!r}: {exc.message}"
            exc.args = (exc.message,)
            exc.address = where
            raise
        grafts.append((address, prepared.nodes))
        new_leaves.extend(leaf for _, leaf in prepared.leaves)
    if metadata is not KEEP:
        check_metadata(metadata)
    if not overwrite and storage.exists(_paths.record_path(new)):
        raise CheckpointExistsError(
            f"checkpoint {new!r} already exists in {storage.url}; pass overwrite=True to replace it",
            checkpoint=new,
        )
    with _locks.save_lock(storage) as lock:
        # Read under the lock: from now until the commit no gc runs, so every chunk the base
        # references (it is committed) stays in the store.
        record = _committed.read_commit_record(storage, base)
        columns = _committed.read_columns(storage, record)
        trusted = _trusted.TrustedChunks(record.name, columns.chunk_objects())  # no request for them
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
        meta = columns.metadata if metadata is KEEP else metadata
        return _write_derived(
            storage, columns, new, derived, new_leaves, meta, options, lock, overwrite, trusted
        )


def _check_conflicts(sets: list[tuple[str, Any]], moves: list[tuple[str, str]]) -> None:
    """Sets and renames must touch disjoint parts of the tree (InvalidInputError otherwise)."""

    def disjoint(items: list[str], what: str) -> None:
        for i, a in enumerate(items):
            for b in items[i + 1 :]:
                if overlap(a, b):
                    raise InvalidInputError(f"{what} {a!r} and {b!r} overlap: one is, or lies in, the other")

    for src, dst in moves:
        if not src or not dst:
            raise InvalidInputError("rename moves subtrees: the root ('') can be neither source nor target")
    disjoint([a for a, _ in sets], "set addresses")
    disjoint([a for a, _ in moves], "rename sources")
    disjoint([b for _, b in moves], "rename targets")
    for src, dst in moves:
        for address, _ in sets:
            if overlap(address, src) or overlap(address, dst):
                raise InvalidInputError(
                    f"set {address!r} conflicts with rename {src!r} -> {dst!r}: set the subtree at "
                    "its new address in a second derive, or rename it in a second derive",
                    address=address,
                )


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


def _write_derived(
    storage: Storage,
    base: Columns,
    name: str,
    tree: Derived,
    new_leaves: list[Any],
    metadata: Any,
    options: _write.SaveOptions,
    lock: _locks.Lock,
    overwrite: bool,
    trusted: _trusted.TrustedChunks,
) -> _write.SaveResult:
    """Write the new leaves' chunks with the save path's chunk writer (taking the base's chunks,
    read under ``lock``, as trusted), then commit. The derived manifest's columns are the kept
    leaves' rows of the base (statistics included) and the new leaves' as a save records them,
    in the order of the new tree."""
    placed = np.flatnonzero(tree.source == 1)
    addresses = dict(zip(tree.leaf[placed].tolist(), tree.nodes.leaf_addresses(placed), strict=True))
    prepared = _prepare.Prepared(  # only its leaves are written: the tree is the one built here
        nodes_from_tree({"type": "none"}, 0),
        tuple((addresses.get(i, ""), leaf) for i, leaf in enumerate(new_leaves)),
    )
    writer = ChunkWriter(storage, options.codec, None, trusted)
    table = LeafTable()
    new_packs = _write._write_leaves(prepared, options, writer, lock, table)
    header = {
        "name": name,
        "created": time.time(),
        "metadata": metadata,
        "codec": options.codec.to_record(),
        "chunk_size": options.chunk_size,
    }
    flat = {"type": "list", "children": [{"type": "leaf", "leaf": k} for k in range(len(table))]}
    fresh = columns_from_fields({**table.fields(new_packs), **header}, flat)
    fields = {**take_leaves((base, fresh), tree.source, tree.leaf), **header}
    columns = columns_from_fields(fields, tree.nodes)  # the reader's checks, before anything refers to it
    commit(storage, encode(columns), columns, overwrite=overwrite)
    return writer.result(name, len(columns), columns.nbytes)
