"""Version-2 manifests: the per-leaf data stored column-wise, decoded and validated with numpy.

A version-1 manifest is one msgpack map per leaf, decoded and checked in a Python loop. Version 2
keeps the same information in a handful of little-endian arrays (one record per leaf, per chunk
ref, per pack and per tree node; shapes and piece boxes as flat int arrays), so decoding is a few
``np.frombuffer`` calls and validation a few vectorised operations
(:mod:`treestore._format.manifest.check`: every bound version 1 checks, over whole columns at once).
This module holds the model and the comparisons of leaves between two manifests.

:class:`Columns` is the one in-memory model of a manifest, whatever version its bytes have (only
:func:`~treestore._format.manifest.check.validate` makes one): every reader and writer works on its
arrays; the public read-only records (``Store.manifest()``, ``LazyLeaf.entry``) are views made from
it on demand (:mod:`treestore._format.manifest.record_views`). The bytes (decoding and encoding, either
version) are :mod:`treestore._format.manifest.codec`'s.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treestore._format.commit_record import CommitRecord
from treestore._format.dtypes import (
    ITEMSIZES,
    PRNG_IMPLS,
)
from treestore._format.limits import (
    CHUNK_SLACK,
    MAX_CHUNK_BYTES,
    MAX_DIM,
)
from treestore._format.manifest.records import ChunkRef
from treestore._format.manifest.rules import check_tiling, leaf_digest, record_mismatches
from treestore._format.manifest.tree import NODE_DTYPE as NODE_DTYPE
from treestore._format.manifest.tree import Nodes

VERSION = 2
# Code tables (SPEC.md, version-2 manifest): a code is the position in its table, fixed forever.
KINDS = ("numpy", "jax", "npscalar", "prng_key", "bool", "int", "float", "complex", "str", "bytes")
ARRAY_CODES = 4  # kinds below this code are arrays, the others Python scalars
PRNG_KEY = KINDS.index("prng_key")
DTYPE_NAMES = (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
    "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz",
    "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn",
    "float6_e2m3fn", "float6_e3m2fn", "int2", "int4", "uint2", "uint4",
)  # fmt: skip
PRNG_NAMES = (None, "threefry2x32", "rbg", "unsafe_rbg")  # flags bits 2-3
WEAK_TYPE, IN_PIECES, PRNG_SHIFT, FLAG_BITS = 1, 2, 2, 0x0F

LEAF_DTYPE = np.dtype([("kind", "u1"), ("dtype", "u1"), ("ndim", "u1"), ("flags", "u1"), ("chunks", "<u4")])
CHUNK_DTYPE = np.dtype(
    [("digest", "V32"), ("raw", "<u4"), ("stored", "<u4"), ("pack", "<i4"), ("offset", "<u4")]
)
PACK_DTYPE = np.dtype([("digest", "V32"), ("raw", "<u4"), ("stored", "<u4")])
assert MAX_CHUNK_BYTES + CHUNK_SLACK < 2**32 and MAX_DIM < 2**63  # the columns hold every bound

ARRAY_FIELDS = {
    "nodes": NODE_DTYPE,
    "node_leaves": np.dtype("<u4"),
    "leaves": LEAF_DTYPE,
    "shapes": np.dtype("<u8"),
    "piece_counts": np.dtype("<u4"),
    "piece_chunks": np.dtype("<u4"),
    "piece_start": np.dtype("<u8"),
    "piece_shape": np.dtype("<u8"),
    "chunks": CHUNK_DTYPE,
    "packs": PACK_DTYPE,
}
_CODE = {name: code for code, name in enumerate(DTYPE_NAMES)}
_ITEMSIZE = np.array([ITEMSIZES.get(n, 1) for n in DTYPE_NAMES], np.int64)
_PRNG_WIDTH = np.array([0] + [PRNG_IMPLS[n] for n in PRNG_NAMES[1:] if n], np.int64)


def prefix_sums(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums with the total at the end: ``[0, c0, c0+c1, ...]`` (int64)."""
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, s + n)`` for each start s and length n."""
    ends = np.cumsum(lengths)
    return np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(starts - ends + lengths, lengths)


def _runs_differing(
    x: np.ndarray, sx: np.ndarray, y: np.ndarray, sy: np.ndarray, n: np.ndarray
) -> np.ndarray:
    """For pairs of runs ``x[sx[k] : sx[k] + n[k]]`` and ``y[sy[k] : sy[k] + n[k]]``: how many of
    their elements differ."""
    unequal = x[concat_ranges(sx, n)] != y[concat_ranges(sy, n)]
    return np.bincount(np.repeat(np.arange(len(n)), n), unequal, len(n))


def _sums(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Sums of ``values[starts[i]:starts[i+1]]`` (int64, exact for the bounded sizes summed here)."""
    total = prefix_sums(values.astype(np.int64))
    return total[starts[1:]] - total[starts[:-1]]


@dataclass(frozen=True, eq=False)
class Columns:
    """A validated manifest. Build it with :func:`decode_any` (reading either version) or
    :func:`columns_from_fields` (writing, from a :class:`LeafTable`'s arrays); both run the same
    validation."""

    name: str
    created: float
    metadata: Any
    codec: dict[str, Any]
    chunk_size: int
    nodes: Nodes
    leaves: np.ndarray  # LEAF_DTYPE, one per leaf, in jax's flattening order
    shapes: np.ndarray  # uint64: every array leaf's dimensions, leaf after leaf
    values: tuple[object, ...]  # the value of each scalar leaf, in leaf order
    piece_counts: np.ndarray  # uint32: pieces of each leaf saved in pieces
    piece_chunks: np.ndarray  # uint32: chunk refs of each piece
    piece_start: np.ndarray  # uint64: every piece's start, piece after piece
    piece_shape: np.ndarray  # uint64: every piece's shape
    chunks: np.ndarray  # CHUNK_DTYPE, the chunk refs of every leaf, leaf after leaf
    packs: np.ndarray  # PACK_DTYPE
    # Derived while validating:
    chunk_start: np.ndarray = field(repr=False)  # int64 [n + 1]: leaf i's chunk refs
    shape_start: np.ndarray = field(repr=False)  # int64 [n + 1]: leaf i's dimensions
    leaf_nbytes: np.ndarray = field(repr=False)  # int64 [n]: raw bytes of each leaf
    # Per leaf: saved in pieces, which are in parts not read (SPEC 8): a frame's sharded
    # leaves, or those a reader of other leaves left. Such a leaf lists no piece or chunk ref.
    unread: np.ndarray = field(repr=False)
    version: int = VERSION  # the version of the bytes it was decoded from
    parts: tuple[bytes, ...] = ()  # the digests of the parts its pieces were read from (SPEC 8)
    # The optional statistics of each leaf's values (STATS_DTYPE, one record per leaf; None when
    # the manifest has none), checked as hostile input: records that make no sense are UNKNOWN.
    stats: np.ndarray | None = field(default=None, repr=False)
    stats_note: str | None = None  # why statistics were ignored (all, or some leaves'), if they were

    def __len__(self) -> int:
        return len(self.leaves)

    @property
    def nbytes(self) -> int:
        """Raw bytes of every leaf (the commit record's ``nbytes``)."""
        return int(self.leaf_nbytes.sum())

    @functools.cached_property
    def _value_rank(self) -> np.ndarray:
        return np.cumsum(self.leaves["kind"] >= ARRAY_CODES) - 1

    @functools.cached_property
    def _piece_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(rank among sharded leaves per leaf, first piece per sharded leaf, first chunk per
        piece, first dimension entry per piece)."""
        in_pieces = ((self.leaves["flags"] & IN_PIECES) != 0) & ~self.unread
        rank = np.cumsum(in_pieces) - 1
        first = prefix_sums(self.piece_counts)
        owner = np.repeat(np.flatnonzero(in_pieces), self.piece_counts)
        within = prefix_sums(self.piece_chunks)
        chunk = self.chunk_start[owner] + within[:-1] - within[first[:-1]].repeat(self.piece_counts)
        dims = prefix_sums(self.leaves["ndim"][owner])
        return rank, first, chunk, dims

    def address(self, i: int) -> str:
        """Leaf ``i``'s address: from :attr:`addresses` once that is built, else walked up
        the node table (without building every address)."""
        if "addresses" in self.__dict__:
            return self.addresses[i]
        return self.nodes.address(int(self.nodes.leaf_node[i]))

    def require_pieces(self, i: int | None = None) -> None:
        """Refuse to go on where the pieces of leaf ``i`` (None: of any leaf) are in parts not
        read: what needs them must complete the frame first (:mod:`treestore._engine.reading.parts`)."""
        if self.unread[i] if i is not None else self.unread.any():
            j = i if i is not None else int(np.argmax(self.unread))
            raise RuntimeError(f"leaf {self.address(j) or '(root)'}: its pieces are in parts not read")

    @functools.cached_property
    def addresses(self) -> list[str]:
        """Every leaf's address, by leaf index (built on first use)."""
        return self.nodes.addresses()

    @functools.cached_property
    def index(self) -> dict[str, int]:
        """Leaf index by address (built on first use)."""
        return {a: i for i, a in enumerate(self.addresses)}

    def find(self, address: str) -> int | None:
        """The index of the leaf at ``address``, or None; without building every address."""
        if "index" in self.__dict__:
            return self.index.get(address)
        return self.nodes.find(address)

    def match(self, other: Columns) -> tuple[np.ndarray, np.ndarray]:
        """Leaf indices ``(ia, ib)`` of the addresses both manifests hold, in this one's order;
        without building an address when both have the same tree (the usual case)."""
        if self.nodes.same_addresses(other.nodes):
            every = np.arange(len(self))
            return every, every
        where = other.index
        ib = np.array([where.get(a, -1) for a in self.addresses], np.int64)
        ia = np.flatnonzero(ib >= 0)
        return ia, ib[ia]

    @functools.cached_property
    def is_array(self) -> np.ndarray:
        """bool [n]: which leaves are arrays (the others are Python scalars, kept in the manifest)."""
        return self.leaves["kind"] < ARRAY_CODES

    def by_dtype(self, fn: Callable[[str], Any]) -> np.ndarray:
        """``fn`` of each leaf's dtype name, for every leaf at once (``fn`` runs once per dtype
        SPEC.md names; a Python scalar leaf gets a value too: mask with :attr:`is_array`)."""
        return np.array([fn(name) for name in DTYPE_NAMES])[self.leaves["dtype"]]

    def of_kind(self, kind: str) -> np.ndarray:
        """bool [n]: which leaves are of ``kind`` (a name :meth:`kind` gives)."""
        return self.leaves["kind"] == KINDS.index(kind)

    def kind(self, i: int) -> str:
        """Leaf i's kind: ``numpy``, ``jax``, ``npscalar``, ``prng_key`` for arrays, or the Python
        scalar's type (``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``)."""
        return KINDS[self.leaves["kind"][i]]

    def dtype_name(self, i: int) -> str:
        """Array leaf i's dtype, by its name in SPEC.md (``float32``, ``bfloat16`` ...)."""
        return DTYPE_NAMES[self.leaves["dtype"][i]]

    def value(self, i: int) -> object:
        """The value of scalar leaf i (a Python scalar, kept in the manifest)."""
        return self.values[self._value_rank[i]]

    def restore_kind(self, i: int) -> tuple[str, str | None, bool]:
        """Leaf i's kind, PRNG implementation and weak type: what turns its host array back
        into the leaf it was saved as."""
        row = self.leaves[i]
        flags = int(row["flags"])
        return KINDS[row["kind"]], PRNG_NAMES[flags >> PRNG_SHIFT], bool(flags & WEAK_TYPE)

    def as_stored(self) -> list[bool]:
        """For each leaf, whether it was saved as a numpy array (its host array is the leaf)."""
        return (self.leaves["kind"] == KINDS.index("numpy")).tolist()

    def shape(self, i: int) -> tuple[int, ...]:
        return tuple(self.shapes[self.shape_start[i] : self.shape_start[i + 1]].tolist())

    def chunk_ref(self, j: int) -> ChunkRef:
        """Chunk ref row ``j`` (of ``chunks``) as a :class:`ChunkRef`."""
        row = self.chunks[j]
        pack = int(row["pack"])
        digest, raw, stored = row["digest"].tobytes(), int(row["raw"]), int(row["stored"])
        return (
            ChunkRef(digest, raw, stored)
            if pack < 0
            else ChunkRef(digest, raw, stored, pack, int(row["offset"]))
        )

    def piece_rows(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The pieces of leaf i (saved in pieces), column-wise: their starts and shapes (one row
        of ndim ints each), and the first row and number of their chunk refs in ``chunks``."""
        self.require_pieces(i)
        rank, first, chunk, dims = self._piece_index
        r = int(rank[i])
        lo, hi = int(first[r]), int(first[r + 1])
        ndim = int(self.leaves["ndim"][i])
        a, b = int(dims[lo]), int(dims[hi])
        starts = self.piece_start[a:b].reshape(hi - lo, ndim)
        shapes = self.piece_shape[a:b].reshape(hi - lo, ndim)
        return starts, shapes, chunk[lo:hi], self.piece_chunks[lo:hi]

    def tree_record(self) -> dict[str, Any]:
        """The version-1 node record of the tree (SPEC.md, appendix A.3)."""
        return self.nodes.tree_record()

    def pack_refs(self) -> tuple[ChunkRef, ...]:
        return self._refs_of(self.packs)

    @staticmethod
    def _refs_of(packs: np.ndarray) -> tuple[ChunkRef, ...]:
        d = packs["digest"].tobytes()
        return tuple(
            ChunkRef(d[32 * j : 32 * j + 32], raw, stored)
            for j, (raw, stored) in enumerate(
                zip(packs["raw"].tolist(), packs["stored"].tolist(), strict=True)
            )
        )

    def mismatches(self, record: CommitRecord) -> list[str]:
        """How a commit record disagrees with this manifest (empty when it describes it)."""
        return record_mismatches(record, self.name, self.created, self.metadata, len(self), self.nbytes)

    def chunk_objects(self) -> dict[bytes, int]:
        """The stored size of each chunk object this checkpoint references (chunk refs outside
        packs, and packs), by digest."""
        self.require_pieces()
        own = self.chunks[self.chunks["pack"] < 0]
        digests = np.concatenate([own["digest"], self.packs["digest"]]).tobytes()
        sizes = np.concatenate([own["stored"], self.packs["stored"]]).tolist()
        return {digests[32 * j : 32 * j + 32]: n for j, n in enumerate(sizes)}

    def chunk_object_count(self) -> int:
        """How many chunk objects :meth:`chunk_objects` lists (equal digests counted apart), without
        building it."""
        self.require_pieces()
        return int(np.count_nonzero(self.chunks["pack"] < 0)) + len(self.packs)

    def chunk_digests(self) -> set[bytes]:
        """Every chunk object this checkpoint needs: chunk refs outside packs, and packs."""
        self.require_pieces()
        own = self.chunks["digest"][self.chunks["pack"] < 0]
        found = np.unique(np.concatenate([own, self.packs["digest"]])).tobytes()
        return {found[j : j + 32] for j in range(0, len(found), 32)}

    def digest(self, i: int) -> bytes:
        """Leaf i's digest, as SPEC.md section 6.7 defines it for every version
        (:func:`treestore._format.manifest.rules.leaf_digest`)."""
        row = self.leaves[i]
        kind = KINDS[row["kind"]]
        if row["kind"] >= ARRAY_CODES:
            return leaf_digest(kind, value=self.value(i))
        lo, hi = int(self.chunk_start[i]), int(self.chunk_start[i + 1])
        d = self.chunks["digest"][lo:hi].tobytes()
        chunks = [d[k : k + 32] for k in range(0, len(d), 32)]
        pieces = None
        if row["flags"] & IN_PIECES:
            starts, shapes, first, count = self.piece_rows(i)
            pieces = [
                (start, box, chunks[int(f) - lo : int(f) - lo + int(n)])
                for start, box, f, n in zip(starts.tolist(), shapes.tolist(), first, count, strict=True)
            ]
        return leaf_digest(
            kind,
            DTYPE_NAMES[row["dtype"]],
            self.shape(i),
            PRNG_NAMES[int(row["flags"]) >> PRNG_SHIFT],
            chunks,
            pieces,
        )

    def same_leaves(self, ia: np.ndarray, other: Columns, ib: np.ndarray) -> np.ndarray:
        """For each pair (``self`` leaf ia[k], ``other`` leaf ib[k]): whether their digests are
        equal (SPEC.md section 6.7), compared column by column without hashing; only scalar
        leaves and leaves saved in pieces are compared one by one."""
        self.require_pieces()
        other.require_pieces()
        ia, ib = np.asarray(ia, np.int64), np.asarray(ib, np.int64)
        a, b = self.leaves[ia], other.leaves[ib]
        array = a["kind"] < ARRAY_CODES
        same = array == (b["kind"] < ARRAY_CODES)
        for f in ("dtype", "ndim", "flags", "chunks"):
            x, y = a[f], b[f]
            if f == "flags":
                x, y = x & (FLAG_BITS ^ WEAK_TYPE), y & (FLAG_BITS ^ WEAK_TYPE)
            same &= ~array | (x == y)
        cand = np.flatnonzero(same & array)
        n = a["ndim"][cand].astype(np.int64)
        same[cand[self._differing(other, "shapes", ia[cand], ib[cand], n) > 0]] = False
        cand = cand[same[cand]]  # the chunk refs, in order (of every piece, for sharded leaves)
        k = a["chunks"][cand].astype(np.int64)
        same[cand[self._differing(other, "digest", ia[cand], ib[cand], k) > 0]] = False
        in_pieces = cand[same[cand] & ((a["flags"][cand] & IN_PIECES) != 0)]
        same[in_pieces] = self._same_pieces(ia[in_pieces], other, ib[in_pieces])
        for j in np.flatnonzero(same & ~array).tolist():  # Python scalars
            same[j] = self.digest(int(ia[j])) == other.digest(int(ib[j]))
        return same

    def chunk_changes(self, ia: np.ndarray, other: Columns, ib: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For pairs of leaves (``self`` leaf ia[k], ``other`` leaf ib[k]): whether both are
        arrays with one dtype, PRNG implementation, shape and chunking (raw sizes, and the
        same pieces for leaves saved in pieces), so that they differ only in chunk digests; and
        for those, the share of chunk refs whose digests differ (0 elsewhere)."""
        self.require_pieces()
        other.require_pieces()
        ia, ib = np.asarray(ia, np.int64), np.asarray(ib, np.int64)
        a, b = self.leaves[ia], other.leaves[ib]
        ok = (a["kind"] < ARRAY_CODES) & (b["kind"] < ARRAY_CODES)
        ok &= (a["flags"] & IN_PIECES) == (b["flags"] & IN_PIECES)
        ok &= (a["dtype"] == b["dtype"]) & (a["chunks"] == b["chunks"])
        ok &= (a["flags"] >> PRNG_SHIFT) == (b["flags"] >> PRNG_SHIFT)
        ok &= self.same_shapes(ia, other, ib)
        cand = np.flatnonzero(ok)
        k = a["chunks"][cand].astype(np.int64)
        ok[cand[self._differing(other, "raw", ia[cand], ib[cand], k) > 0]] = False
        in_pieces = np.flatnonzero(ok & ((a["flags"] & IN_PIECES) != 0))  # and the same pieces
        ok[in_pieces] = self._same_pieces(ia[in_pieces], other, ib[in_pieces])
        cand = np.flatnonzero(ok)
        k = a["chunks"][cand].astype(np.int64)
        share = np.zeros(len(ia))
        share[cand] = self._differing(other, "digest", ia[cand], ib[cand], k) / np.maximum(k, 1)
        return ok, np.where(ok, share, 0.0)

    def same_types(self, ia: np.ndarray, other: Columns, ib: np.ndarray) -> np.ndarray:
        """bool [k]: whether leaf ``ia[k]`` here and leaf ``ib[k]`` of ``other`` are of one type as
        a diff tells types: arrays of one dtype and PRNG implementation (numpy or jax alike), or
        Python scalars of one kind."""
        a, b = self.leaves[ia], other.leaves[ib]
        arrays_a, arrays_b = self.is_array[ia], other.is_array[ib]
        same_array = (a["dtype"] == b["dtype"]) & ((a["flags"] >> PRNG_SHIFT) == (b["flags"] >> PRNG_SHIFT))
        return np.where(arrays_a & arrays_b, same_array, ~arrays_a & ~arrays_b & (a["kind"] == b["kind"]))

    def same_shapes(self, ia: np.ndarray, other: Columns, ib: np.ndarray) -> np.ndarray:
        """For pairs of leaves (``self`` leaf ia[k], ``other`` leaf ib[k]): whether their shapes
        are equal (a Python scalar's shape is empty)."""
        ia, ib = np.asarray(ia, np.int64), np.asarray(ib, np.int64)
        same = self.leaves["ndim"][ia] == other.leaves["ndim"][ib]
        cand = np.flatnonzero(same)
        n = self.leaves["ndim"][ia[cand]].astype(np.int64)
        same[cand[self._differing(other, "shapes", ia[cand], ib[cand], n) > 0]] = False
        return same

    def _differing(
        self, other: Columns, column: str, ia: np.ndarray, ib: np.ndarray, n: np.ndarray
    ) -> np.ndarray:
        """For pairs of leaves (``self`` leaf ia[k], ``other`` leaf ib[k]) with n[k] dimensions
        (``column`` "shapes") or chunk refs ("raw", "digest") each: how many of them differ."""
        if column == "shapes":
            x, y, sx, sy = self.shapes, other.shapes, self.shape_start, other.shape_start
        else:
            x, y = self.chunks[column], other.chunks[column]
            sx, sy = self.chunk_start, other.chunk_start
        return _runs_differing(x, sx[ia], y, sy[ib], n)

    def _same_pieces(self, ia: np.ndarray, other: Columns, ib: np.ndarray) -> np.ndarray:
        """For pairs of leaves saved in pieces, of equal shapes and equal chunk refs: whether
        they have the same pieces (count, boxes, and chunk refs per piece)."""
        ra, rb = self._piece_index[0][ia], other._piece_index[0][ib]
        fa, fb = self._piece_index[1], other._piece_index[1]
        n = fa[ra + 1] - fa[ra]
        same = n == fb[rb + 1] - fb[rb]
        k = np.flatnonzero(same)
        ra, rb, n = ra[k], rb[k], n[k]
        differs = _runs_differing(self.piece_chunks, fa[ra], other.piece_chunks, fb[rb], n)
        da, db = self._piece_index[3], other._piece_index[3]
        m = da[fa[ra + 1]] - da[fa[ra]]  # box entries: pieces × ndim, equal in both
        differs += _runs_differing(self.piece_start, da[fa[ra]], other.piece_start, db[fb[rb]], m)
        differs += _runs_differing(self.piece_shape, da[fa[ra]], other.piece_shape, db[fb[rb]], m)
        same[k[differs > 0]] = False
        return same


__all__ = [
    "ARRAY_CODES",
    "ARRAY_FIELDS",
    "CHUNK_DTYPE",
    "DTYPE_NAMES",
    "IN_PIECES",
    "KINDS",
    "LEAF_DTYPE",
    "NODE_DTYPE",
    "PACK_DTYPE",
    "PRNG_NAMES",
    "PRNG_SHIFT",
    "WEAK_TYPE",
    "Columns",
    "check_tiling",
    "concat_ranges",
    "prefix_sums",
]
