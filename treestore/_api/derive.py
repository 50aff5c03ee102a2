"""Derived checkpoints: a base checkpoint with subtrees replaced, added, dropped or renamed, written
as a new manifest that references the base's chunks; only the new leaves' chunks are written.

The base's tree record is edited as node records, so nodes that are not touched keep their type,
their keys and their type name (a flax module stays a ``custom`` node with ``.attr`` keys, and
loads with the same template as before). Leaf entries that are kept keep their chunk refs (with
their pack indices renumbered, keeping only the packs still referenced) under their new addresses;
new subtrees go through the one write path (:func:`treestore._engine.write.prepare`, the chunk
writer) and the result through the one commit, under a save lock taken before the base is read,
so no gc can remove the base's chunks before the derived checkpoint references them.
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treestore._engine import known as _known
from treestore._engine import locks as _locks
from treestore._engine import read as _read
from treestore._engine import write as _write
from treestore._engine.chunk_writer import ChunkWriter
from treestore._engine.commit import commit
from treestore._format import paths as _paths
from treestore._format import select as _select
from treestore._format.address import (
    DictKey,
    Key,
    SequenceKey,
    check_node_keys,
    format_address,
    format_key,
    join_address,
    key_from_record,
    key_to_record,
    key_value,
    parse_address,
)
from treestore._format.columns import Columns
from treestore._format.columns_codec import columns_from_fields, encode
from treestore._format.columns_take import take_leaves
from treestore._format.columns_tree import nodes_from_tree
from treestore._format.leaf_table import LeafTable
from treestore._format.limits import MAX_DEPTH
from treestore._format.manifest import check_metadata, check_name
from treestore._storage.base import Storage
from treestore.errors import CheckpointExistsError, InvalidInputError, NoMatchError, TreestoreError

KEEP: Any = ...  # metadata=KEEP (the default) keeps the base's metadata


@dataclass(eq=False)
class _Node:
    """A tree node being edited: a node record's fields, mutable. Leaves point at a base leaf
    entry (``leaf``) or at a new leaf (``new``)."""

    kind: str
    keys: list[Key] = field(default_factory=list)
    children: list[_Node] = field(default_factory=list)
    name: str | None = None
    leaf: int | None = None
    new: int | None = None
    emptied: bool = False  # a child was removed here: pruned if it ends up empty

    @property
    def container(self) -> bool:
        return self.kind not in ("leaf", "none")

    def segments(self) -> list[str]:
        return [format_key(k) for k in self.keys]


def _node(record: dict[str, Any], *, new_offset: int | None = None) -> _Node:
    """A validated node record (a manifest's, or one :func:`prepare` made) as a :class:`_Node`;
    leaf indices are base leaves, or new leaves numbered from ``new_offset``. Iterative, as are
    the other walks here: a tree as deep as readers accept (MAX_DEPTH) needs no deep stack."""
    root = _shell(record, new_offset)
    todo = [(root, record)]
    while todo:
        node, rec = todo.pop()
        if node.container:
            node.children = [_shell(c, new_offset) for c in rec["children"]]
            todo.extend(zip(node.children, rec["children"], strict=True))
    return root


def _shell(record: dict[str, Any], new_offset: int | None) -> _Node:
    """The node of ``record`` without its children (see :func:`_node`)."""
    kind = record["type"]
    if kind == "leaf":
        i = record["leaf"]
        return _Node(kind, leaf=i) if new_offset is None else _Node(kind, new=new_offset + i)
    if kind == "none":
        return _Node(kind)
    if kind in ("list", "tuple"):
        keys: list[Key] = [SequenceKey(i) for i in range(len(record["children"]))]
    else:
        keys = [key_from_record(k) for k in record["keys"]]
    return _Node(kind, keys, [], record.get("name"))


def _height(node: _Node) -> int:
    """How many container levels ``node`` spans (0 for a leaf)."""
    height = 0
    todo = [(node, 1)]
    while todo:
        n, depth = todo.pop()
        if n.container:
            height = max(height, depth)
            todo.extend((c, depth + 1) for c in n.children)
    return height


def _jax_order(node: _Node) -> Sequence[int]:
    """The order jax flattens the children in: a dict's by sorted key when its keys sort."""
    if node.kind != "dict":
        return range(len(node.children))
    values: list[Any] = [key_value(k) for k in node.keys]
    try:
        return sorted(range(len(values)), key=values.__getitem__)
    except TypeError:
        return range(len(values))


def _emit(root: _Node, address: str, leaves: list[tuple[str, _Node]]) -> dict[str, Any]:
    """The node record of ``root``; its leaves are appended to ``leaves`` in jax's order (depth
    first, each node's children in :func:`_jax_order`)."""
    top: list[Any] = [None]
    todo = [(root, address, top, 0)]  # a node, its address, and the slot its record goes in
    while todo:
        node, at, slots, j = todo.pop()
        if node.kind == "leaf":
            leaves.append((at, node))
            slots[j] = {"type": "leaf", "leaf": len(leaves) - 1}
            continue
        if node.kind == "none":
            slots[j] = {"type": "none"}
            continue
        if node.kind in ("list", "tuple"):
            node.keys = [SequenceKey(i) for i in range(len(node.children))]  # renumbered after removals
        record: dict[str, Any] = {"type": node.kind}
        if node.name is not None:
            record["name"] = node.name
        if node.kind not in ("list", "tuple"):
            record["keys"] = [key_to_record(k) for k in node.keys]
        record["children"] = children = [None] * len(node.children)
        slots[j] = record
        segments = node.segments()
        todo.extend(
            (node.children[i], join_address(at, segments[i]), children, i) for i in reversed(_jax_order(node))
        )
    result: dict[str, Any] = top[0]
    return result


def _addresses(node: _Node, address: str = "") -> list[tuple[str, _Node, _Node]]:
    """Every node below ``node`` with its address and its parent, parents first (depth first, in
    key order)."""
    out = []
    todo = _below(node, address)
    while todo:
        at, child, parent = todo.pop()
        out.append((at, child, parent))
        todo.extend(_below(child, at))
    return out


def _below(node: _Node, address: str) -> list[tuple[str, _Node, _Node]]:
    """The children of ``node`` with their addresses and ``node``, last first (a stack's order)."""
    found = zip(node.segments(), node.children, strict=True)
    return [(join_address(address, s), c, node) for s, c in found][::-1]


def _canonical(address: object, what: str) -> str:
    if not isinstance(address, str):
        raise InvalidInputError(f"{what}: an address is a str, got {type(address).__name__}")
    try:
        return format_address(parse_address(address))
    except TreestoreError as exc:
        raise InvalidInputError(f"{what}: {address!r} is not an address: {exc}") from None


def _index(node: _Node, segment: str) -> int | None:
    """The position of the child at ``segment``; as in patterns, the quotes around a digit-only
    dict key may be left out (``h/11`` finds the child ``h/"11"`` of a dict)."""
    segments = node.segments() if node.container else []
    for s in (segment, f'"{segment}"' if segment.isdigit() and segment.isascii() else None):
        if s in segments:
            return segments.index(s)
    return None


def _loose(address: str) -> str:
    return "/".join(
        s[1:-1] if len(s) > 2 and s[0] == s[-1] == '"' and s[1:-1].isdigit() else s
        for s in address.split("/")
    )


def _under(a: str, b: str) -> bool:
    """Whether address ``a`` lies strictly under address ``b``."""
    return _loose(a).startswith(_loose(b) + "/")


def _overlap(a: str, b: str) -> bool:
    """Whether one of two addresses is the other or lies under it."""
    a, b = _loose(a), _loose(b)
    return a == b or not a or not b or b.startswith(a + "/") or a.startswith(b + "/")


class _Tree:
    """The tree being derived, with the operations :func:`derive` applies to it."""

    def __init__(self, root: _Node, base: str) -> None:
        self.root = root
        self.base = base

    def find(self, address: str) -> tuple[_Node, ...] | None:
        """The nodes from the root to the node at ``address``, or None when there is none."""
        path = [self.root]
        for segment in address.split("/") if address else []:
            j = _index(path[-1], segment)
            if j is None:
                return None
            path.append(path[-1].children[j])
        return tuple(path)

    def missing(self, address: str, what: str) -> NoMatchError:
        known = [a for a, _, _ in _addresses(self.root)]
        near = difflib.get_close_matches(address, known, n=5, cutoff=0.3) or known[:5]
        hint = f"; nearest addresses: {', '.join(repr(a) for a in near)}" if near else ""
        return NoMatchError(
            f"{what}: no leaf or subtree {address!r} in checkpoint {self.base!r}{hint}",
            checkpoint=self.base,
            address=address,
        )

    def drop(self, patterns: _select.Patterns) -> list[str]:
        """Remove every node whose address matches a pattern; NoMatchError for a pattern that
        matches no address of a leaf or subtree. Returns the addresses removed."""
        nodes = _addresses(self.root)
        chosen = set(
            _select.select(
                [a for a, _, _ in nodes], patterns, where=f"checkpoint {self.base!r}", checkpoint=self.base
            )
        )
        removed: list[str] = []
        gone: set[int] = set()  # ids of the nodes removed, with everything under them
        for address, node, parent in nodes:
            if id(parent) in gone:
                gone.add(id(node))
            elif address in chosen:
                removed.append(address)
                gone.add(id(node))
                self.detach(node, parent)
        return removed

    @staticmethod
    def detach(target: _Node, parent: _Node) -> int:
        """Remove ``target`` from ``parent``; returns the position it had there."""
        j = next(j for j, child in enumerate(parent.children) if child is target)
        del parent.children[j], parent.keys[j]
        parent.emptied = True
        return j

    def attach(self, address: str, node: _Node, what: str, place: tuple[_Node, int] | None = None) -> None:
        """Put ``node`` at ``address``: in place of what is there, or under a new key of a dict
        (custom) node, creating missing dicts on the way; the result must stay within the depth
        readers accept."""
        keys = parse_address(address)
        if not keys:
            self.root = node
            return
        parent = self.root
        at = ""
        for depth, key in enumerate(keys):
            segment = format_key(key)
            last = depth == len(keys) - 1
            if not parent.container:
                raise InvalidInputError(
                    f"{what}: {at or '(root)'!r} is a leaf in checkpoint {self.base!r}, not a subtree "
                    f"that {address!r} could lie in",
                    checkpoint=self.base,
                    address=address,
                )
            j = _index(parent, segment)
            if j is not None:
                at = join_address(at, parent.segments()[j])
                if last:
                    parent.children[j] = node
                else:
                    parent = parent.children[j]
                continue
            if isinstance(key, SequenceKey) and parent.kind in ("dict", "ordereddict"):
                key = DictKey(segment)  # a bare index under a dict names a digit-only str key
                segment = format_key(key)
            child = node if last else _Node("dict")
            index = place[1] if place is not None and place[0] is parent else len(parent.children)
            self._add_key(parent, at, key, child, what, address, index)
            parent = child
            at = join_address(at, segment)
        if len(keys) + _height(node) > MAX_DEPTH:
            raise InvalidInputError(
                f"{what}: {address!r} would put the tree's deepest node below depth {MAX_DEPTH}, "
                "the most readers accept",
                checkpoint=self.base,
                address=address,
            )

    def _add_key(
        self, parent: _Node, at: str, key: Key, child: _Node, what: str, address: str, index: int
    ) -> None:
        if parent.kind in ("list", "tuple"):
            ok = isinstance(key, SequenceKey) and key.idx == len(parent.children)
            rule = f"a {parent.kind} grows only at its end (index {len(parent.children)})"
        elif parent.kind in ("dict", "ordereddict"):
            ok = isinstance(key, DictKey)
            rule = "a dict takes only dict keys (no '.attr', '#i' or index segments)"
        else:
            ok = not isinstance(key, SequenceKey)
            rule = f"a {parent.kind} node takes no index keys"
        if not ok:
            raise InvalidInputError(
                f"{what}: cannot add {address!r} to checkpoint {self.base!r}: {rule} "
                f"({at or '(root)'} is a {parent.kind})",
                checkpoint=self.base,
                address=address,
            )
        keys = [*parent.keys, key]
        try:
            check_node_keys(keys, [format_key(k) for k in keys], at)
        except TreestoreError as exc:
            raise InvalidInputError(f"{what}: {exc}", checkpoint=self.base, address=address) from None
        parent.keys.insert(index, key)
        parent.children.insert(index, child)

    def prune(self) -> None:
        """Remove the containers this derive emptied (as a partial load leaves them out); a
        container left empty by that is removed in turn."""
        order = [self.root]
        for node in order:  # breadth first: every node after its parent
            order.extend(node.children)
        for node in reversed(order):  # children before their parents
            kept = [
                (key, child)
                for key, child in zip(node.keys, node.children, strict=True)
                if not (child.container and child.emptied and not child.children)
            ]
            if len(kept) < len(node.children):
                node.emptied = True
            node.keys = [k for k, _ in kept]
            node.children = [c for _, c in kept]


def _pairs(value: Mapping[str, Any] | None, what: str) -> list[tuple[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise InvalidInputError(f"{what} must be a dict of address -> ..., got {type(value).__name__}")
    return list(value.items())


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
    sets = [(_canonical(a, "set"), tree) for a, tree in _pairs(set, "set")]
    moves = [(_canonical(a, "rename"), _canonical(b, f"rename {a!r}")) for a, b in _pairs(rename, "rename")]
    if drop is not None:
        _select.patterns(drop)  # a bad argument fails before anything is read
    _check_conflicts(sets, moves)
    # Validate the new subtrees and copy them to host before any write (as a save does).
    new_leaves: list[Any] = []
    grafts: list[tuple[str, _Node]] = []
    for address, tree in sets:
        try:
            prepared = _write.prepare(tree)
        except TreestoreError as exc:
            where = f"{address}/{exc.address}" if address and exc.address else address or exc.address
            exc.message = f"set {address!r}: {exc.message}"
            exc.args = (exc.message,)
            exc.address = where
            raise
        grafts.append((address, _node(prepared.tree, new_offset=len(new_leaves))))
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
        record = _read.read_commit_record(storage, base)
        columns = _read.read_columns(storage, record)
        known = _known.KnownChunks(record.name, columns.chunk_objects())  # no request for them
        tree = _Tree(_node(columns.tree_record()), base)
        moving = _resolve_moves(tree, moves)
        if drop is not None:
            removed = tree.drop(drop)
            for src, _, _, _ in moving:
                gone = [r for r in removed if _loose(src) == _loose(r) or _under(src, r)]
                if gone:
                    raise InvalidInputError(
                        f"rename {src!r} conflicts with drop: {gone[0]!r} is dropped", address=src
                    )
        _apply_moves(tree, moving)
        for address, node in grafts:
            tree.attach(address, node, f"set {address!r}")
        tree.prune()
        placed: list[tuple[str, _Node]] = []
        node_record = _emit(tree.root, "", placed)
        meta = columns.metadata if metadata is KEEP else metadata
        return _write_derived(
            storage,
            columns,
            new,
            node_record,
            placed,
            new_leaves,
            meta,
            options,
            lock,
            overwrite,
            known,
        )


def _check_conflicts(sets: list[tuple[str, Any]], moves: list[tuple[str, str]]) -> None:
    """Sets and renames must touch disjoint parts of the tree (InvalidInputError otherwise)."""

    def disjoint(items: list[str], what: str) -> None:
        for i, a in enumerate(items):
            for b in items[i + 1 :]:
                if _overlap(a, b):
                    raise InvalidInputError(f"{what} {a!r} and {b!r} overlap: one is, or lies in, the other")

    for src, dst in moves:
        if not src or not dst:
            raise InvalidInputError("rename moves subtrees: the root ('') can be neither source nor target")
    disjoint([a for a, _ in sets], "set addresses")
    disjoint([a for a, _ in moves], "rename sources")
    disjoint([b for _, b in moves], "rename targets")
    for src, dst in moves:
        for address, _ in sets:
            if _overlap(address, src) or _overlap(address, dst):
                raise InvalidInputError(
                    f"set {address!r} conflicts with rename {src!r} -> {dst!r}: set the subtree at "
                    "its new address in a second derive, or rename it in a second derive",
                    address=address,
                )


Move = tuple[str, str, _Node, _Node]  # source, target, the subtree, its parent in the base


def _resolve_moves(tree: _Tree, moves: list[tuple[str, str]]) -> list[Move]:
    """The subtree each rename moves, found at its address in the base."""
    moving = []
    for src, dst in moves:
        path = tree.find(src)
        if path is None:
            raise tree.missing(src, f"rename {src!r}")
        moving.append((src, dst, path[-1], path[-2]))
    return moving


def _apply_moves(tree: _Tree, moving: list[Move]) -> None:
    """Detach every source, then attach each at its target: a subtree renamed within its
    parent keeps its position there (its dict key order)."""
    places = [(parent, tree.detach(node, parent)) for _, _, node, parent in moving]
    for (src, dst, node, _), place in reversed(list(zip(moving, places, strict=True))):
        if tree.find(dst) is not None:
            raise InvalidInputError(
                f"rename {src!r} -> {dst!r}: checkpoint {tree.base!r} already has {dst!r} "
                "(drop it, or rename it too)",
                checkpoint=tree.base,
                address=dst,
            )
        tree.attach(dst, node, f"rename {src!r} -> {dst!r}", place)


def _write_derived(
    storage: Storage,
    base: Columns,
    name: str,
    node_record: dict[str, Any],
    placed: list[tuple[str, _Node]],
    new_leaves: list[Any],
    metadata: Any,
    options: _write.SaveOptions,
    lock: _locks.Lock,
    overwrite: bool,
    known: _known.KnownChunks,
) -> _write.SaveResult:
    """Write the new leaves' chunks with the save path's chunk writer (taking the base's chunks,
    read under ``lock``, as known), then commit. The derived manifest's columns are the kept
    leaves' rows of the base (statistics included) and the new leaves' as a save records them,
    in the order of the new tree."""
    addresses = {n.new: a for a, n in placed if n.new is not None}
    prepared = _write.Prepared(  # only its leaves are written: the tree is the one built here
        nodes_from_tree({"type": "none"}, 0),
        tuple((addresses.get(i, ""), leaf) for i, leaf in enumerate(new_leaves)),
    )
    writer = ChunkWriter(storage, options.codec, None, known)
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
    source = np.array([0 if n.leaf is not None else 1 for _, n in placed], np.int64)
    leaf = np.array([n.leaf if n.leaf is not None else n.new for _, n in placed], np.int64)
    fields = {**take_leaves((base, fresh), source, leaf), **header}
    columns = columns_from_fields(fields, node_record)  # the reader's checks, before anything refers to it
    commit(storage, encode(columns), columns, overwrite=overwrite)
    return writer.result(name, len(columns), columns.nbytes)
