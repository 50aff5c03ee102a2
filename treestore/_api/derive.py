"""Derived checkpoints: a base checkpoint with subtrees replaced, added, dropped or renamed, written
as a new manifest that references the base's chunks; only the new leaves' chunks are written.

This half checks the arguments and prepares the new subtrees (:func:`treestore._tree.prepare.prepare`:
validated and copied to host before anything is written, as a save does); the engine's half
(:mod:`treestore._engine.derive`) edits the base's tree and writes the result through the one door
for writes, under a save lock taken before the base is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from treestore._engine import derive as _derive
from treestore._engine import write as _write
from treestore._engine.derive import KEEP, overlap
from treestore._format import select as _select
from treestore._format.address import format_address, parse_address
from treestore._format.manifest.rules import check_name
from treestore._format.manifest.tree import Nodes
from treestore._storage.base import Storage
from treestore._tree import prepare as _prepare
from treestore.errors import InvalidInputError, TreestoreError


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
    return _derive.derive(  # metadata checked there, before the new name is looked for
        storage, base, new, grafts, new_leaves, moves, drop, metadata, overwrite, options
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
