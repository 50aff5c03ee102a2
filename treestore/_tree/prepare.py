"""A tree made ready to write: every key and leaf validated, leaves converted to what a save
stores (device arrays copied to host, or kept on their devices for the save to fetch), and the
node table built; raises before any write, naming every leaf that cannot be stored."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treestore._format.limits import MAX_MANIFEST_BYTES
from treestore._format.manifest.tree import Nodes
from treestore._tree.collector_pause import paused_collector
from treestore._tree.jax_import import imported as jax_imported
from treestore._tree.jax_import import jax
from treestore._tree.leaves import Keep, Leaf, ValueLeaf, off_cpu, prepare_leaf
from treestore._tree.structure import any_node, flatten
from treestore.errors import InvalidInputError, UnsupportedLeafError


@dataclass(frozen=True)
class Prepared:
    """A tree ready to write: its node table and its (address, leaf) pairs, on host."""

    nodes: Nodes
    leaves: tuple[tuple[str, Leaf], ...]

    @functools.cached_property
    def tree(self) -> dict[str, Any]:
        """The tree's version-1 node record (what multi-process saves share)."""
        return self.nodes.tree_record()


def prepare(
    tree: Any,
    *,
    copy: bool = False,
    leaf: Callable[[str, Any], Leaf] | None = None,
    before: Callable[[list[Any]], None] | None = None,
    keep: Keep | None = None,
) -> Prepared:
    """Validate every key and leaf and copy device arrays to host; raises before any write.

    With ``copy=True`` numpy leaves are copied too, so the caller may change them at once.
    ``leaf(address, value)`` replaces the default conversion of each leaf; ``before(values)``
    sees every leaf value once the structure is validated, before any is converted. The jax
    arrays that ``keep`` keeps stay on their devices, for :func:`write` to fetch (the caller must
    not delete or donate them before the write); the transfers of the others are all started
    before the first is waited for.
    """
    make = leaf or (lambda address, value: prepare_leaf(value, address, copy=copy, keep=keep))
    if before is None and keep is not None:
        before = functools.partial(start_transfers, keep=keep)
    found: list[tuple[str, Any]] = []
    with paused_collector():  # the per-leaf objects made here (see collector_pause)
        nodes = flatten(tree, found)  # distinct keys in each node: distinct addresses
        if before is not None:
            before([value for _, value in found])
        leaves = _converted(tree, found, make)
    # Python scalars live in the manifest: refuse here, before any chunk is written, a tree whose
    # addresses and values alone exceed what readers accept (the encoder checks the rest).
    floor = sum(len(a) + (x.size_floor if type(x) is ValueLeaf else 0) for a, x in leaves)
    if floor > MAX_MANIFEST_BYTES:
        values = [(a, x) for a, x in leaves if isinstance(x, ValueLeaf)]
        address, biggest = max(values, key=lambda p: p[1].size_floor, default=("", None))
        largest = f"; the largest, {address or '(root)'}, holds {biggest.size_floor}" if biggest else ""
        raise InvalidInputError(
            f"the tree's addresses and Python scalar leaves take at least {floor} bytes in the "
            f"manifest, over the {MAX_MANIFEST_BYTES // 2**20} MiB readers accept{largest}: store "
            "large bytes and str values as numpy arrays (np.frombuffer(b, np.uint8))",
            address=address if biggest else None,
        )
    return Prepared(nodes, tuple(leaves))


def start_transfers(values: list[Any], keep: Keep | None = None) -> None:
    """Start the device-to-host copy of every jax array of ``values`` that lives off the CPU
    (and that ``keep`` does not keep), so that their transfers overlap."""
    if not jax_imported():  # no jax array can be among them
        return
    array = jax.Array  # looked up once: each lookup through the stand-in costs a call
    for x in values:
        if isinstance(x, array) and off_cpu(x) and not (keep is not None and keep.kept(x)):
            with contextlib.suppress(Exception):  # np.asarray copies anyway
                x.copy_to_host_async()


def _converted(
    tree: Any, found: list[tuple[str, Any]], make: Callable[[str, Any], Leaf]
) -> list[tuple[str, Leaf]]:
    """Every leaf converted by ``make``; one UnsupportedLeafError names every leaf that cannot be
    stored (for an equinox module, with the filter that keeps its arrays)."""
    leaves: list[tuple[str, Leaf]] = []
    refused: list[UnsupportedLeafError] = []
    for address, value in found:
        try:
            leaves.append((address, make(address, value)))
        except UnsupportedLeafError as exc:
            refused.append(exc)
    if not refused:
        return leaves
    lines = [exc.message for exc in refused]
    text = (
        lines[0]
        if len(lines) == 1
        else f"{len(lines)} leaves cannot be stored:\n  "
        + "\n  ".join(lines[:20] + ([f"(and {len(lines) - 20} more)"] if len(lines) > 20 else []))
    )
    if any_node(tree, _is_equinox):
        text += (
            "\nthe tree holds equinox modules: save eqx.filter(model, eqx.is_array) (its arrays), "
            "and load with like=model (its functions are kept from like)"
        )
    raise UnsupportedLeafError(text, address=refused[0].address)


def _is_equinox(x: Any) -> bool:
    """Whether ``x`` is an equinox module (by its classes' modules: equinox is never imported)."""
    return any(c.__module__.partition(".")[0] == "equinox" for c in type(x).__mro__)


__all__ = ["Prepared", "prepare", "start_transfers"]
