"""The checks a manifest's columns pass before they become :class:`Columns`.

:func:`validate` is the one validation every manifest goes through, whatever its version and
whoever made it (a reader decoding bytes, a save or derive assembling a table, the merge of a
multi-process checkpoint's parts), for it alone makes :class:`Columns`
(``tests/package/test_layering.py`` keeps it so; other modules only derive columns from such with
``dataclasses.replace``): every bound of SPEC.md §10 over whole columns at once, and each rule
that needs Python (dtype names, the piece grid) once per distinct value or per leaf saved in
pieces.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from treestore._format.dtypes import NOT_IN_JAX, dtype_from_name, value_from_record
from treestore._format.encoding import Bad
from treestore._format.limits import CHUNK_SLACK, MAX_CHUNK_BYTES, MAX_DIM, MAX_NDIM, MAX_PIECES
from treestore._format.manifest.columns import (
    _CODE,
    _ITEMSIZE,
    _PRNG_WIDTH,
    ARRAY_CODES,
    ARRAY_FIELDS,
    DTYPE_NAMES,
    FLAG_BITS,
    IN_PIECES,
    KINDS,
    PRNG_KEY,
    PRNG_NAMES,
    PRNG_SHIFT,
    Columns,
    _sums,
    concat_ranges,
    prefix_sums,
)
from treestore._format.manifest.rules import check_shape, check_tiling
from treestore._format.manifest.tree import Nodes
from treestore._format.stats import check_column
from treestore._kernels.room import ROOM_EVERY, check_room
from treestore.errors import UnsupportedFormatError

PIECE_FIELDS = ("piece_counts", "piece_chunks", "piece_start", "piece_shape")


def validate(fields: dict[str, Any], nodes: Nodes, *, unread: bool | np.ndarray = False) -> Columns:
    """Check every column (the tree checked already) and build :class:`Columns`; Bad or
    UnsupportedFormatError otherwise. ``unread``: the leaves saved in pieces that are in parts
    not read (SPEC.md, section 8) — True for every such leaf (the frame of a manifest stored in
    parts), or a mask — which list no piece and no chunk ref here; the others are checked as
    in any manifest."""
    for key in ARRAY_FIELDS.keys() & fields.keys():  # a Columns never changes, whoever holds it
        fields[key].flags.writeable = False
    leaves = fields["leaves"]
    n = len(leaves)

    def at(where: np.ndarray | int) -> str:  # leaf i's address, or the first the mask marks
        i = where if isinstance(where, int) else int(np.argmax(where))
        return nodes.address(int(nodes.leaf_node[i])) or "(root)"

    kind, dtype, flags = leaves["kind"], leaves["dtype"], leaves["flags"]
    ndim, nchunks = leaves["ndim"].astype(np.int64), leaves["chunks"].astype(np.int64)
    if (bad := kind >= len(KINDS)).any():
        raise UnsupportedFormatError(
            f"{at(bad)}: unsupported leaf kind code {int(kind.max())}", address=at(bad)
        )
    array = kind < ARRAY_CODES
    if (bad := ~array & ((dtype != 0) | (ndim != 0) | (flags != 0) | (nchunks != 0))).any():
        raise Bad(f"leaf {at(bad)}: a scalar leaf has a dtype, dimensions, flags or chunks")
    if (bad := flags > FLAG_BITS).any():
        raise Bad(f"leaf {at(bad)}: undefined flag bits {int(flags[np.argmax(bad)])}")
    if (bad := array & (dtype >= len(DTYPE_NAMES))).any():
        name = f"code {int(dtype[np.argmax(bad)])}"
        raise UnsupportedFormatError(f"{at(bad)}: unsupported dtype {name}", address=at(bad))
    for code in np.unique(dtype[array]).tolist():  # a name this numpy lacks is unsupported
        dtype_from_name(DTYPE_NAMES[code], address=at(array & (dtype == code)))
    in_jax = np.array([name not in NOT_IN_JAX for name in DTYPE_NAMES])
    if (bad := (kind == KINDS.index("jax")) & ~in_jax[dtype]).any():
        raise Bad(f"leaf {at(bad)}: a jax array cannot have dtype {DTYPE_NAMES[dtype[np.argmax(bad)]]}")
    prng = (flags >> PRNG_SHIFT).astype(np.int64)
    if (bad := (kind == PRNG_KEY) != (prng != 0)).any():
        raise Bad(f"leaf {at(bad)}: a PRNG implementation belongs to prng_key leaves, and only to them")
    if (bad := ndim > MAX_NDIM).any():
        raise Bad(f"leaf {at(bad)}: {int(ndim.max())} dimensions, over the limit of {MAX_NDIM}")
    shape_start = prefix_sums(ndim)
    shapes = fields["shapes"]
    if len(shapes) != shape_start[-1]:
        raise Bad(f"{len(shapes)} dimensions stored for {int(shape_start[-1])}")
    if (shapes > MAX_DIM).any():
        raise Bad(f"a dimension is over 2**48: {int(shapes.max())}")
    key = (kind == PRNG_KEY) & ((dtype != _CODE["uint32"]) | (ndim == 0))
    last = (
        shapes[np.maximum(shape_start[1:] - 1, 0)].astype(np.int64) if len(shapes) else np.zeros(n, np.int64)
    )
    if (bad := key | ((kind == PRNG_KEY) & (last != _PRNG_WIDTH[prng]))).any():
        j = int(np.argmax(bad))
        impl, width = PRNG_NAMES[prng[j]], _PRNG_WIDTH[prng[j]]
        raise Bad(f"leaf {at(bad)}: {impl} key data must be uint32 of shape (..., {width})")
    nbytes = _leaf_bytes(shapes, shape_start, ndim, _ITEMSIZE[dtype], array, at)
    chunk_start = prefix_sums(nchunks)
    chunks, packs = fields["chunks"], fields["packs"]
    if len(chunks) != chunk_start[-1]:
        raise Bad(f"{len(chunks)} chunk refs stored for {int(chunk_start[-1])}")
    _check_refs(chunks, packs)
    held = _sums(chunks["raw"], chunk_start)
    in_pieces = (flags & IN_PIECES) != 0
    in_parts = unread is True
    unread = in_pieces & unread if unread is not False else np.zeros(n, bool)  # their parts hold them
    if (in_parts and any(len(fields[key]) for key in PIECE_FIELDS)) or nchunks[unread].any():
        raise Bad("a manifest in parts lists pieces or chunk refs of a leaf its parts hold")
    if (bad := (held != nbytes) & ~unread).any():
        j = int(np.argmax(bad))
        raise Bad(f"leaf {at(bad)}: its shape needs {int(nbytes[j])} bytes, chunks hold {int(held[j])}")
    values = fields["values"]
    scalars = np.flatnonzero(~array)
    if len(values) != len(scalars):
        raise Bad(f"{len(values)} values for {len(scalars)} scalar leaves")
    decoded = []
    for j, (i, rec) in enumerate(zip(scalars.tolist(), values, strict=True)):
        if j % ROOM_EVERY == 0:
            check_room()  # stop while running out can still be reported
        try:
            decoded.append(value_from_record(KINDS[kind[i]], rec))
        except ValueError as exc:
            raise Bad(f"leaf {at(i)}: {exc}") from None
    measured = array & (kind != PRNG_KEY)
    elements = nbytes // _ITEMSIZE[dtype]
    stats, note = check_column(fields.get("stats"), DTYPE_NAMES, dtype, measured, elements)
    columns = Columns(
        fields["name"], fields["created"], fields["metadata"], fields["codec"], fields["chunk_size"],
        nodes, leaves, shapes, tuple(decoded), fields["piece_counts"], fields["piece_chunks"],
        fields["piece_start"], fields["piece_shape"], chunks, packs, chunk_start, shape_start, nbytes,
        unread, stats=stats, stats_note=note,
    )  # fmt: skip
    _check_pieces(columns, at)
    return columns


def _leaf_bytes(
    shapes: np.ndarray, starts: np.ndarray, ndim: np.ndarray, itemsize: np.ndarray, array: np.ndarray, at: Any
) -> np.ndarray:
    """Raw bytes of each leaf; check_shape runs once per distinct (element size, shape)."""
    nbytes = np.zeros(len(ndim), np.int64)
    for d in np.unique(ndim[array]).tolist():
        rows = np.flatnonzero(array & (ndim == d))
        table = np.empty((len(rows), d + 1), np.uint64)
        table[:, 0] = itemsize[rows]
        table[:, 1:] = shapes[starts[rows][:, None] + np.arange(d)]
        flat = np.ascontiguousarray(table).view(np.dtype((np.void, 8 * (d + 1)))).ravel()
        _, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
        sizes = []
        for j in first.tolist():
            size, *shape = table[j].tolist()
            try:
                check_shape(shape, size)
            except ValueError as exc:
                raise Bad(f"leaf {at(int(rows[j]))}: {exc}") from None
            sizes.append(math.prod(shape) * size)
        nbytes[rows] = np.array(sizes, np.int64)[inverse.ravel()]
    return nbytes


def _check_refs(chunks: np.ndarray, packs: np.ndarray) -> None:
    for what, table in (("chunk", chunks), ("pack", packs)):
        if (table["raw"] > MAX_CHUNK_BYTES).any():
            found = int(table["raw"].max())
            raise Bad(f"{what} raw size should be an integer in [0, {MAX_CHUNK_BYTES}], found {found}")
        if (table["stored"] > MAX_CHUNK_BYTES + CHUNK_SLACK).any():
            raise Bad(
                f"{what} stored size {int(table['stored'].max())} is over {MAX_CHUNK_BYTES + CHUNK_SLACK}"
            )
    pack, offset = chunks["pack"].astype(np.int64), chunks["offset"].astype(np.int64)
    if ((pack < -1) | (pack >= len(packs))).any():
        raise Bad(f"a pack index is out of range ({len(packs)} packs)")
    if (offset > MAX_CHUNK_BYTES).any():
        raise Bad(f"pack offset should be an integer in [0, {MAX_CHUNK_BYTES}], found {int(offset.max())}")
    own = pack < 0
    if (own & (offset != 0)).any():
        raise Bad("a chunk ref outside a pack has a nonzero offset")
    inside = ~own
    ends = offset[inside] + chunks["raw"][inside]
    if (bad := ends > packs["raw"][pack[inside]]).any():
        j = int(np.argmax(bad))
        raise Bad(f"bytes {int(offset[inside][j])}..{int(ends[j])} lie outside pack {int(pack[inside][j])}")


def _check_pieces(c: Columns, at: Any) -> None:
    """Pieces tile their leaf: counts, boxes and sizes vectorised, the grid per sharded leaf."""
    leaves = c.leaves
    in_pieces = np.flatnonzero(((leaves["flags"] & IN_PIECES) != 0) & ~c.unread)
    counts = c.piece_counts.astype(np.int64)
    if len(counts) != len(in_pieces):
        raise Bad(f"{len(counts)} piece counts for {len(in_pieces)} leaves saved in pieces")
    if (bad := (counts < 1) | (counts > MAX_PIECES)).any():
        j = int(np.argmax(bad))
        raise Bad(
            f"leaf {at(int(in_pieces[j]))}: {int(counts[j])} pieces; a sharded leaf has 1 to {MAX_PIECES}"
        )
    first = prefix_sums(counts)
    if len(c.piece_chunks) != first[-1]:
        raise Bad(f"{len(c.piece_chunks)} piece records for {int(first[-1])} pieces")
    if (bad := _sums(c.piece_chunks, first) != leaves["chunks"][in_pieces]).any():
        raise Bad(f"leaf {at(int(in_pieces[np.argmax(bad)]))}: its pieces' chunk refs are not its chunk refs")
    owner = np.repeat(in_pieces, counts)  # the leaf of each piece
    ndim = leaves["ndim"][owner].astype(np.int64)
    dims = prefix_sums(ndim)
    if len(c.piece_start) != dims[-1] or len(c.piece_shape) != dims[-1]:
        raise Bad(
            f"piece boxes hold {len(c.piece_start)} and {len(c.piece_shape)} entries for {int(dims[-1])}"
        )
    if (c.piece_start > MAX_DIM).any() or (c.piece_shape > MAX_DIM).any():
        raise Bad("a piece start or dimension is over 2**48")
    of = np.repeat(np.arange(len(owner)), ndim)  # the piece of each box entry
    if (bad := c.piece_start + c.piece_shape > c.shapes[concat_ranges(c.shape_start[owner], ndim)]).any():
        raise Bad(f"leaf {at(int(owner[of[np.argmax(bad)]]))}: a piece lies outside it")
    # Inside its leaf, a piece's dimensions multiply to at most the leaf's: no overflow.
    volume = np.ones(len(owner), np.int64)
    np.multiply.at(volume, of, c.piece_shape.astype(np.int64))
    chunk = c._piece_index[2]
    raw = prefix_sums(c.chunks["raw"].astype(np.int64))
    held = raw[chunk + c.piece_chunks] - raw[chunk]
    if (bad := held != volume * _ITEMSIZE[leaves["dtype"][owner]]).any():
        raise Bad(f"leaf {at(int(owner[np.argmax(bad)]))}: a piece's chunks hold the wrong number of bytes")
    # With the pieces' bytes summing to the leaf's (checked above), disjoint pieces tile it.
    # Leaves sharded alike (the usual case) have equal boxes: each distinct grid is checked once.
    tiled: set[tuple[tuple[int, ...], bytes, bytes]] = set()
    for r, i in enumerate(in_pieces.tolist()):
        if counts[r] > 1:
            a, z = int(dims[first[r]]), int(dims[first[r + 1]])
            grid = (c.shape(i), c.piece_start[a:z].tobytes(), c.piece_shape[a:z].tobytes())
            if grid in tiled:
                continue
            start = c.piece_start[a:z].astype(np.int64).reshape(int(counts[r]), -1)
            extent = c.piece_shape[a:z].astype(np.int64).reshape(int(counts[r]), -1)
            try:
                check_tiling(start, extent, grid[0])
            except Bad as exc:
                raise Bad(f"leaf {at(i)}: {exc}") from None
            tiled.add(grid)
