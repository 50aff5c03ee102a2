"""The statistics of a multi-process save's sharded leaves, gathered up a tree of processes
(SPEC.md, sections 6.8 and 8.2).

Each process measures the pieces it owns: one record per sharded leaf of the tree
(:mod:`treestore._format.stats`). Records are not sent to the primary one process at a time —
its work would grow with processes × leaves (256 processes of a 1,000-leaf tree: 12.5 MB to
decode and combine). The processes form a tree of fan-in ``FAN_IN`` in heap order (the children
of process i are ``FAN_IN·i + 1`` … ``FAN_IN·i + FAN_IN``): before barrier ``written`` each
process combines its own records with its children's and sets the result under its parent's
folder; after the barrier the primary reads its children's with one request. Every process
combines at most ``FAN_IN + 1`` columns, and the depth grows as log(processes).

A process that measured nothing, failed, or whose child's records are missing or malformed sends
none: the sharded leaves are then unknown in the manifest (statistics are advisory; the save
itself is decided by the summaries). A process waits for its children until ``deadline`` (half
the barrier timeout), so it still reaches the barrier in time to let the others name a process
that died.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Sequence

import numpy as np

from treestore._engine.group.group_runtime import Runtime
from treestore._format import stats as _stats
from treestore._format.dtypes import PRNG_KEY
from treestore._format.manifest.leaf_table import LeafTable
from treestore._tree.leaves import ArrayLeaf, Leaf

FAN_IN = 16  # children per process: 256 processes gather in two steps, 4096 in three
NONE = ""  # what a process sets when it has no records to send


def children(index: int, count: int, fan_in: int = FAN_IN) -> range:
    """The processes whose records process ``index`` of ``count`` combines with its own."""
    first = fan_in * index + 1
    return range(min(first, count), min(first + fan_in, count))


def parent(index: int, fan_in: int = FAN_IN) -> int:
    """The process that combines the records of process ``index`` (> 0)."""
    return (index - 1) // fan_in


def kinds(leaves: Sequence[tuple[str, Leaf]], sharded: Sequence[bool]) -> np.ndarray:
    """The statistics kind of each sharded leaf, in leaf order (UNKNOWN for PRNG key data and
    complex numbers)."""
    out = [
        _stats.UNKNOWN
        if not isinstance(leaf, ArrayLeaf) or leaf.kind == PRNG_KEY
        else _stats.kind_of(leaf.dtype)
        for (_, leaf), split in zip(leaves, sharded, strict=True)
        if split
    ]
    return np.array(out, np.uint8)


def own(table: LeafTable, sharded: Sequence[bool], of: np.ndarray) -> np.ndarray:
    """This process's records of its pieces, one per sharded leaf (kinds ``of``): the record of no
    elements for a leaf it holds no piece of."""
    rank = np.cumsum(np.asarray(sharded, bool)) - 1
    out = _stats.column([_stats.empty(int(k)) for k in of.tolist()])
    mine = [(int(rank[i]), record) for i, record in zip(table.index, table.stats, strict=True) if sharded[i]]
    if mine:
        out[[r for r, _ in mine]] = _stats.column([record for _, record in mine])
    return out


def encode(records: np.ndarray | None) -> str:
    """The text a process sets: its subtree's records, base64 (NONE without)."""
    return NONE if records is None else base64.b64encode(records.tobytes()).decode("ascii")


def decode(text: str | None, count: int) -> np.ndarray | None:
    """The records ``encode`` wrote for ``count`` sharded leaves, or None: nothing sent,
    malformed, or of another size."""
    if not text:
        return None
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(data) != count * _stats.STATS_DTYPE.itemsize:
        return None
    return np.frombuffer(data, _stats.STATS_DTYPE)


def combine(texts: Sequence[str | None], mine: np.ndarray | None, of: np.ndarray) -> np.ndarray | None:
    """``mine`` combined with the records ``texts`` hold (kinds ``of``); None when any is missing."""
    if mine is None:
        return None
    tables = [mine]
    for text in texts:
        found = decode(text, len(of))
        if found is None:
            return None
        tables.append(found)
    return _stats.combine_columns(tables, of) if len(tables) > 1 else mine


def _folder(save_id: str, index: int) -> str:
    return f"treestore/{save_id}/stats/{index}/"


def send(
    runtime: Runtime,
    save_id: str,
    index: int,
    count: int,
    mine: np.ndarray | None,
    of: np.ndarray,
    deadline: float,
) -> None:
    """A process other than the primary: combine ``mine`` with its children's records (waiting for
    each until ``deadline``, a ``time.monotonic()``) and set them under its parent's folder."""
    texts = [
        runtime.get(f"{_folder(save_id, index)}{child}", max(deadline - time.monotonic(), 0.001))
        for child in children(index, count)
    ]
    gathered = combine(texts, mine, of)
    runtime.set(f"{_folder(save_id, parent(index))}{index}", encode(gathered))


def gather(
    runtime: Runtime, save_id: str, count: int, mine: np.ndarray | None, of: np.ndarray
) -> np.ndarray | None:
    """The primary, after barrier ``written`` (every child has set its records): the records of
    every process's pieces combined, with one request; None when any process sent none."""
    if mine is None:
        return None
    folder = _folder(save_id, 0)
    found = runtime.items(folder)
    return combine([found.get(f"{folder}{child}") for child in children(0, count)], mine, of)


def committed(table: LeafTable, sharded: Sequence[bool], gathered: np.ndarray | None) -> np.ndarray:
    """The manifest's ``stats`` column: the primary's records of the leaves that are not sharded,
    and ``gathered`` (every process's pieces combined) for the sharded ones; these UNKNOWN when
    ``gathered`` is None."""
    out = table.stats_column()
    split = np.flatnonzero(np.asarray(sharded, bool))
    if len(split):
        out[split] = np.zeros(1, _stats.STATS_DTYPE) if gathered is None else gathered
    return out


__all__ = [
    "FAN_IN",
    "children",
    "combine",
    "committed",
    "decode",
    "encode",
    "gather",
    "kinds",
    "own",
    "parent",
    "send",
]
