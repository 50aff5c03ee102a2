"""A manifest's leaf, chunk-ref and pack tables built leaf by leaf (a save, derive's new leaves,
the version-1 decoder); other tables are cut from or merged out of validated ones
(:mod:`treestore._format.manifest.take`, :mod:`treestore._format.parts.merge`).

A save appends each leaf's fields to plain lists as it writes them (a few appends per leaf, no
per-leaf object), and :meth:`LeafTable.fields` turns them into the arrays of a version-2
manifest (SPEC.md §6), which :func:`treestore._format.manifest.codec.columns_from_fields` checks
exactly as readers do. The same table takes a derived checkpoint's new leaves and a version-1
manifest's leaf entries as it is decoded; a process of a multi-process save keeps its table as
written, and the primary's frame and each process's part are made from it
(:mod:`treestore._format.parts.part`, :mod:`treestore._format.parts.merge`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from treestore._format.dtypes import value_to_record
from treestore._format.manifest.columns import (
    CHUNK_DTYPE,
    DTYPE_NAMES,
    IN_PIECES,
    KINDS,
    LEAF_DTYPE,
    PACK_DTYPE,
    PRNG_NAMES,
    PRNG_SHIFT,
    WEAK_TYPE,
)
from treestore._format.manifest.records import ChunkRef
from treestore._format.stats import STATS_DTYPE, UNKNOWN_RECORD, Record, column
from treestore.errors import InvalidInputError

Ref = tuple[bytes, int, int, int, int]  # digest, raw size, stored size, pack index (-1: none), offset
PieceRow = tuple[tuple[int, ...], tuple[int, ...], int]  # start, shape, number of chunk refs
_KIND = {name: code for code, name in enumerate(KINDS)}
_DTYPE = {name: code for code, name in enumerate(DTYPE_NAMES)}
_PRNG = {name: code << PRNG_SHIFT for code, name in enumerate(PRNG_NAMES)}
_REFS_DTYPE = np.dtype(  # CHUNK_DTYPE with the digest read from bytes
    [("digest", "S32"), ("raw", "<u4"), ("stored", "<u4"), ("pack", "<i4"), ("offset", "<u4")]
)
assert _REFS_DTYPE.descr[1:] == CHUNK_DTYPE.descr[1:] and _REFS_DTYPE.itemsize == CHUNK_DTYPE.itemsize


def pack_table(packs: list[ChunkRef] | tuple[ChunkRef, ...]) -> np.ndarray:
    """Packs as the manifest's ``packs`` column (PACK_DTYPE)."""
    table = np.zeros(len(packs), PACK_DTYPE)
    if packs:
        table["digest"] = np.frombuffer(b"".join(p.digest for p in packs), "V32")
        table["raw"] = [p.raw_size for p in packs]
        table["stored"] = [p.stored_size for p in packs]
    return table


def ref_of(c: ChunkRef) -> Ref:
    return (c.digest, c.raw_size, c.stored_size, -1 if c.pack is None else c.pack, c.offset)


class LeafTable:
    """The columns of a save's leaves, in leaf order; append with :meth:`value` and :meth:`array`.

    ``pieces_kept``: a leaf written in one piece covering all of it stays a piece (a process of
    a multi-process save writes it in its part as one) instead of becoming a plain leaf."""

    def __init__(self, *, pieces_kept: bool = False) -> None:
        self.pieces_kept = pieces_kept
        self.index: list[int] = []  # each row's leaf index in the tree saved
        self.rows: list[tuple[int, int, int, int, int]] = []
        self.shapes: list[int] = []
        self.values: list[object] = []
        self.refs: list[Ref] = []
        self.piece_counts: list[int] = []
        self.piece_chunks: list[int] = []
        self.piece_start: list[int] = []
        self.piece_shape: list[int] = []
        self.stats: list[Record] = []  # each leaf's statistics (UNKNOWN for Python scalars)
        self._measured_rows: list[tuple[list[int], np.ndarray]] = []  # (rows, their stats column)
        self.measured = False  # whether the save records statistics (the manifest's stats column)

    def __len__(self) -> int:
        return len(self.rows)

    def value(self, kind: str, value: object, address: str, leaf: int) -> None:
        """A Python scalar leaf, leaf ``leaf`` of the tree."""
        try:
            record = value_to_record(kind, value)
        except ValueError as exc:  # prepare_leaf checked it already: a value changed since
            raise InvalidInputError(f"{address or '(root)'}: {exc}", address=address) from None
        self.index.append(leaf)
        self.rows.append((_KIND[kind], 0, 0, 0, 0))
        self.values.append(record)
        self.stats.append(UNKNOWN_RECORD)

    def array(
        self,
        kind: str,
        dtype: str,
        shape: tuple[int, ...],
        prng_impl: str | None,
        weak_type: bool,
        refs: list[Ref],
        pieces: list[PieceRow] | None,
        address: str,
        leaf: int,
        stats: Record | None = None,
    ) -> None:
        """An array leaf, leaf ``leaf`` of the tree: its chunk refs, and for a leaf saved in
        pieces each piece's start, shape and number of chunk refs (the refs are the pieces',
        piece after piece). A leaf in one piece covering all of it is recorded as a plain leaf
        unless pieces are kept. ``stats``: the statistics of its values (None: the save records
        none)."""
        self.index.append(leaf)
        self.stats.append(UNKNOWN_RECORD if stats is None else stats)
        self.measured |= stats is not None
        if pieces is not None and len(pieces) == 1 and pieces[0][1] == shape and not self.pieces_kept:
            pieces = None
        flags = _PRNG[prng_impl] | (WEAK_TYPE if weak_type else 0) | (IN_PIECES if pieces is not None else 0)
        self.rows.append((_KIND[kind], _DTYPE[dtype], len(shape), flags, len(refs)))
        self.shapes += shape
        self.refs += refs
        if pieces is not None:
            self.piece_counts.append(len(pieces))
            for start, box, n in pieces:
                self.piece_start += start
                self.piece_shape += box
                self.piece_chunks.append(n)

    def packed_leaf(
        self,
        kind: str,
        dtype: str,
        shape: tuple[int, ...],
        prng_impl: str | None,
        weak_type: bool,
        ref: Ref,
        leaf: int,
    ) -> None:
        """:meth:`array` for a leaf packed whole (one chunk ref, no pieces), its statistics a
        placeholder until :meth:`set_stats` (or none, unless :attr:`measured` is set): the one
        call per leaf of a save of many small leaves, kept to what such a leaf needs."""
        self.index.append(leaf)
        self.stats.append(UNKNOWN_RECORD)
        flags = _PRNG[prng_impl] | (WEAK_TYPE if weak_type else 0)
        self.rows.append((_KIND[kind], _DTYPE[dtype], len(shape), flags, 1))
        self.shapes += shape
        self.refs.append(ref)

    def set_stats(self, rows: list[int], table: np.ndarray) -> None:
        """The statistics of rows ``rows`` (appended with a placeholder record), as rows of a
        ``stats`` column: a pack's thousands of small leaves measured at once take no record
        object each."""
        if len(rows) != len(table):
            raise ValueError(f"{len(table)} statistics for {len(rows)} rows")
        self._measured_rows.append((rows, table))

    def stats_column(self) -> np.ndarray:
        """Every row's statistics as the manifest's ``stats`` column."""
        # UNKNOWN rows are zeros: only the others are converted (at 100k small leaves nearly
        # every row is a placeholder that a pack's measurement replaces below)
        known = [i for i, r in enumerate(self.stats) if r is not UNKNOWN_RECORD]
        out = np.zeros(len(self.stats), STATS_DTYPE)
        if known:
            out[known] = column([self.stats[i] for i in known])
        for rows, table in self._measured_rows:
            out[rows] = table
        return out

    def fields(self, packs: list[ChunkRef]) -> dict[str, Any]:
        """The manifest arrays of these leaves and ``packs`` (what ``columns_from_fields`` takes,
        but the header fields and the tree)."""
        # numpy reads the refs' tuples in one pass (the digest as 32 bytes, then seen as V32)
        chunks = np.array(self.refs, _REFS_DTYPE).view(CHUNK_DTYPE) if self.refs else np.zeros(0, CHUNK_DTYPE)
        return {
            "leaves": np.array(self.rows, LEAF_DTYPE) if self.rows else np.zeros(0, LEAF_DTYPE),
            "shapes": np.array(self.shapes, "<u8"),
            "values": self.values,
            "piece_counts": np.array(self.piece_counts, "<u4"),
            "piece_chunks": np.array(self.piece_chunks, "<u4"),
            "piece_start": np.array(self.piece_start, "<u8"),
            "piece_shape": np.array(self.piece_shape, "<u8"),
            "chunks": chunks,
            "packs": pack_table(packs),
            **({"stats": self.stats_column()} if self.measured else {}),
        }
