"""Manifests and commit records: schema, msgpack encoding, and strict validation with bounds.

Everything read from a store passes through :func:`decode_manifest` or :func:`decode_commit_record`, which
check every field's type, every size against its bound and against the other fields, before any
other code sees it. A store can make them raise ManifestCorruptError or UnsupportedFormatError,
nothing else.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack
import numpy as np

from treestore._format.address import (
    Key,
    canonical_segment,
    check_node_keys,
    format_key,
    join_address,
    key_from_record,
    parse_address,
)
from treestore._format.commit_record import CommitRecord
from treestore._format.dtypes import (
    ARRAY_KINDS,
    NOT_IN_JAX,
    PRNG_IMPLS,
    PY_KINDS,
    dtype_from_name,
    value_from_record,
    value_to_record,
)
from treestore._format.encoding import DIGEST_BYTES, digest, from_msgpack, manifest_errors, to_msgpack
from treestore._format.encoding import Bad as _Bad
from treestore._format.encoding import check_version as _check_version
from treestore._format.encoding import count as _count
from treestore._format.encoding import field as _get
from treestore._format.limits import (
    CHUNK_SLACK,
    LEAF_BYTES_END,
    MAX_CHUNK_BYTES,
    MAX_DEPTH,
    MAX_DIM,
    MAX_GRID_CELLS,
    MAX_MANIFEST_BYTES,
    MAX_METADATA_BYTES,
    MAX_NDIM,
    MAX_PIECES,
)
from treestore.errors import InvalidInputError, ManifestCorruptError, TreestoreError, UnsupportedFormatError

MANIFEST_MAGIC = "treestore.manifest"
VERSION = 1  # the format version this module encodes and decodes (version 2: treestore._format.columns)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}\Z")


def check_name(name: object) -> str:
    """A checkpoint name: 1–200 characters of ``A-Z a-z 0-9 . _ = + -``, starting alphanumeric."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidInputError(
            f"checkpoint name {name!r} is not valid: use 1-200 characters of letters, digits and "
            "'._=+-', starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a leaf: the BLAKE3 digest of its raw bytes, raw and stored sizes.

    A small leaf lives inside a pack chunk: ``pack`` indexes the manifest's packs and ``offset``
    is where the leaf's bytes start in the pack's raw bytes.
    """

    digest: bytes
    raw_size: int
    stored_size: int
    pack: int | None = None
    offset: int = 0

    def to_record(self) -> list[object]:
        rec: list[object] = [self.digest, self.raw_size, self.stored_size]
        if self.pack is not None:
            rec += [self.pack, self.offset]
        return rec


@dataclass(frozen=True)
class Piece:
    """A box of an array leaf (``start`` and ``shape`` in the leaf's index space) whose elements,
    in C order, are the concatenated raw bytes of ``chunks``. Sharded arrays are saved as one
    piece per distinct shard; other arrays are one piece covering the whole leaf."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]

    def to_record(self) -> list[object]:
        return [list(self.start), list(self.shape), [c.to_record() for c in self.chunks]]

    @property
    def region(self) -> tuple[slice, ...]:
        return tuple(slice(a, a + n) for a, n in zip(self.start, self.shape, strict=True))


def leaf_digest(
    kind: str,
    dtype: str | None = None,
    shape: Sequence[int] | None = None,
    prng_impl: str | None = None,
    chunks: Sequence[bytes] = (),
    pieces: Sequence[tuple[Sequence[int], Sequence[int], Sequence[bytes]]] | None = None,
    *,
    value: object = None,
) -> bytes:
    """A leaf's digest (SPEC.md, section 6.7), the one rule of leaf equality for every format
    version: an array leaf's by its dtype, shape, PRNG implementation and chunk digests (piece
    by piece, with each piece's box, for a leaf saved in pieces); a Python scalar's by its kind
    and value as stored. ``chunks``: the chunk digests; ``pieces``: (start, shape, chunk
    digests) of each piece, or None for a leaf saved whole."""
    record: list[object]
    if kind not in ARRAY_KINDS:
        record = [kind, value_to_record(kind, value)]
    elif pieces:
        layout = [[list(start), list(box), list(digests)] for start, box, digests in pieces]
        record = [dtype, list(shape or ()), prng_impl, layout]
    else:
        record = [dtype, list(shape or ()), prng_impl, list(chunks)]
    return digest(to_msgpack(record))


@dataclass(frozen=True)
class LeafEntry:
    """Everything the manifest says about one leaf.

    ``chunks`` lists every chunk of an array leaf; ``pieces`` is set only for leaves saved in
    several pieces (sharded arrays), whose chunks then follow piece by piece.
    """

    address: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    chunks: tuple[ChunkRef, ...] = ()
    prng_impl: str | None = None
    value: object = None
    pieces: tuple[Piece, ...] = ()
    weak_type: bool = False  # a jax array with a weak type, as Python scalars have

    @property
    def layout(self) -> tuple[Piece, ...]:
        """The pieces of an array leaf (one covering the leaf unless it was saved sharded)."""
        if self.pieces:
            return self.pieces
        shape = self.shape or ()
        return (Piece((0,) * len(shape), shape, self.chunks),)

    @functools.cached_property
    def path(self) -> tuple[Key, ...]:
        """The typed key path the address stands for."""
        return parse_address(self.address)

    @functools.cached_property
    def digest(self) -> bytes:
        """Equal digests mean equal leaves (SPEC.md, section 6.7)."""
        if not self.is_array:
            return leaf_digest(self.kind, value=self.value)
        pieces = [(p.start, p.shape, [c.digest for c in p.chunks]) for p in self.pieces] or None
        return leaf_digest(
            self.kind, self.dtype, self.shape, self.prng_impl, [c.digest for c in self.chunks], pieces
        )

    @property
    def is_array(self) -> bool:
        return self.kind in ARRAY_KINDS

    @property
    def nbytes(self) -> int:
        return sum(c.raw_size for c in self.chunks)

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored_size for c in self.chunks if c.pack is None)


@dataclass(frozen=True)
class Manifest:
    name: str
    created: float
    tree: Any
    leaves: tuple[LeafEntry, ...]
    packs: tuple[ChunkRef, ...] = ()
    metadata: Any = None
    codec: dict[str, Any] = field(default_factory=dict)
    chunk_size: int = 0
    version: int = VERSION  # the version of the bytes it was decoded from

    def mismatches(self, ref: CommitRecord) -> list[str]:
        """How a commit record disagrees with this manifest (empty when it describes it)."""
        return record_mismatches(ref, self.name, self.created, self.metadata, len(self.leaves), self.nbytes)

    def chunk_digests(self) -> set[bytes]:
        """Every chunk object this checkpoint needs."""
        found = {c.digest for leaf in self.leaves for c in leaf.chunks if c.pack is None}
        found.update(p.digest for p in self.packs)
        return found

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)


def record_mismatches(
    ref: CommitRecord, name: str, created: float, metadata: Any, leaves: int, nbytes: int
) -> list[str]:
    """How a commit record disagrees with the manifest of these fields (empty when it describes
    it); every manifest form (version 1 or 2, decoded or columnar) is checked by this."""
    pairs = {
        "name": (ref.name, name),
        "created": (ref.created, created),
        "metadata": (ref.metadata, metadata),
        "leaves": (ref.leaves, leaves),
        "nbytes": (ref.nbytes, nbytes),
    }
    # Metadata is compared as encoded: NaN != NaN, and 1 == 1.0 == True, as Python values.
    # A time is compared as the float a manifest decodes it to (a record keeps an integer
    # exactly; 2**64 - 1 != float(2**64 - 1)), NaN equal to NaN.
    same = {
        "metadata": to_msgpack(ref.metadata) == to_msgpack(metadata),
        "created": _same_time(ref.created, created),
    }
    return [
        f"{k}: record {a!r:.60}, manifest {b!r:.60}" for k, (a, b) in pairs.items() if not same.get(k, a == b)
    ]


def _same_time(a: float, b: float) -> bool:
    """Whether two ``created`` times are the same float (NaN is the same as NaN)."""
    x, y = float(a), float(b)
    return x == y or (math.isnan(x) and math.isnan(y))


# --- encoding ---------------------------------------------------------------------------------
def leaf_to_record(leaf: LeafEntry) -> dict[str, object]:
    rec: dict[str, object] = {"address": leaf.address, "kind": leaf.kind}
    if leaf.is_array:
        assert leaf.shape is not None
        rec["dtype"] = leaf.dtype
        rec["shape"] = list(leaf.shape)
        if leaf.pieces:
            rec["pieces"] = [p.to_record() for p in leaf.pieces]
        else:
            rec["chunks"] = [c.to_record() for c in leaf.chunks]
        if leaf.prng_impl is not None:
            rec["prng_impl"] = leaf.prng_impl
        if leaf.weak_type:
            rec["weak_type"] = True
    else:
        rec["value"] = value_to_record(leaf.kind, leaf.value)
    return rec


def check_metadata(metadata: object) -> bytes:
    """User metadata must encode as msgpack (str keys, plain values) within 1 MiB."""
    try:
        data = to_msgpack(metadata)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidInputError(
            f"metadata must be plain data (dict, list, str, int, float, bool, bytes, None): {exc}"
        ) from None
    if len(data) > MAX_METADATA_BYTES:
        raise InvalidInputError(f"metadata is {len(data)} bytes encoded, over the 1 MiB limit")
    try:
        msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError) as exc:  # as readers decode it: map keys must be str or bytes
        raise InvalidInputError(f"metadata must have str keys in every map: {exc}") from None
    return data


def check_shape(shape: Sequence[object], itemsize: int) -> tuple[int, ...]:
    """An array leaf's shape, if readers accept it: at most MAX_NDIM dimensions, each an int in
    [0, MAX_DIM], the nonzero ones times the element size below 2**63; else ValueError. Writers
    and readers both call this."""
    if len(shape) > MAX_NDIM:
        raise ValueError(f"{len(shape)} dimensions, over the limit of {MAX_NDIM}")
    for n in shape:
        if type(n) is not int or not 0 <= n <= MAX_DIM:
            raise ValueError(f"dimension should be an integer in [0, 2**48], found {n!r:.40}")
    dims = cast(tuple[int, ...], tuple(shape))  # checked above
    if math.prod(dims if 0 not in dims else [n for n in dims if n]) * itemsize >= LEAF_BYTES_END:
        raise ValueError(f"shape {dims} of {itemsize}-byte elements is too large to exist")
    return dims


def encode_manifest(m: Manifest) -> bytes:
    """The manifest's bytes in the version-1 form (whatever ``m.version``); InvalidInputError
    when they exceed the MAX_MANIFEST_BYTES readers accept (a save then fails before it writes
    the manifest)."""
    data = to_msgpack(
        {
            "format": MANIFEST_MAGIC,
            "version": VERSION,
            "name": m.name,
            "created": m.created,
            "metadata": m.metadata,
            "codec": m.codec,
            "chunk_size": m.chunk_size,
            "tree": m.tree,
            "packs": [p.to_record() for p in m.packs],
            "leaves": [leaf_to_record(leaf) for leaf in m.leaves],
        }
    )
    return within_size(data, m.name, "store large bytes and str leaves as numpy arrays, or save fewer leaves")


def within_size(data: bytes, name: str, advice: str = "save fewer leaves") -> bytes:
    """``data``, the encoded manifest of checkpoint ``name``, once it is within the
    MAX_MANIFEST_BYTES readers accept: InvalidInputError otherwise (a save then fails before it
    writes the manifest). The one size check of every manifest writer."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidInputError(
            f"the manifest of checkpoint {name!r} would be {len(data)} bytes, over the "
            f"{MAX_MANIFEST_BYTES // 2**20} MiB readers accept: {advice} per checkpoint",
            checkpoint=name,
        )
    return data


def manifest_record(data: bytes, checkpoint: str) -> dict[str, Any]:
    """The msgpack map of a manifest's bytes, once they are within MAX_MANIFEST_BYTES: the one
    front door of every manifest decoder (ManifestCorruptError otherwise)."""
    what = f"manifest of checkpoint {checkpoint!r}"
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestCorruptError(f"{what} is over its size limit", checkpoint=checkpoint)
    return from_msgpack(data, what, checkpoint)


# --- decoding and validation ------------------------------------------------------------------
def _chunk(rec: object, npacks: int) -> ChunkRef:
    if not isinstance(rec, list) or len(rec) not in (3, 5):
        raise _Bad(f"chunk reference should be a list of 3 or 5, found {rec!r:.80}")
    d = rec[0]
    if type(d) is not bytes or len(d) != DIGEST_BYTES:
        raise _Bad("chunk digest should be 32 bytes")
    size = _count(rec[1], "chunk size", MAX_CHUNK_BYTES)
    stored = _count(rec[2], "stored chunk size", MAX_CHUNK_BYTES + CHUNK_SLACK)
    if len(rec) == 3:
        return ChunkRef(d, size, stored)
    pack = _count(rec[3], "pack index", max(npacks - 1, 0))
    if pack >= npacks:
        raise _Bad(f"pack index {pack} is out of range ({npacks} packs)")
    return ChunkRef(d, size, stored, pack, _count(rec[4], "pack offset", MAX_CHUNK_BYTES))


def _pieces(
    records: list[Any], shape: tuple[int, ...], itemsize: int, packs: tuple[ChunkRef, ...]
) -> tuple[Piece, ...]:
    """Pieces that tile ``shape`` exactly: inside it, no overlaps, no holes."""
    if not 1 <= len(records) <= MAX_PIECES:
        raise _Bad(f"{len(records)} pieces; a sharded leaf has 1 to {MAX_PIECES}")
    pieces = []
    for rec in records:
        if not isinstance(rec, list) or len(rec) != 3:
            raise _Bad("a piece should be [start, shape, chunks]")
        start_rec, shape_rec, chunk_recs = rec
        if not (isinstance(start_rec, list) and isinstance(shape_rec, list) and isinstance(chunk_recs, list)):
            raise _Bad("a piece should be [start, shape, chunks] lists")
        if len(start_rec) != len(shape) or len(shape_rec) != len(shape):
            raise _Bad(f"a piece of a {len(shape)}-d leaf has {len(start_rec)}-d start")
        start = tuple(_count(a, "piece start", MAX_DIM) for a in start_rec)
        extent = tuple(_count(n, "piece dimension", MAX_DIM) for n in shape_rec)
        if any(a + n > dim for a, n, dim in zip(start, extent, shape, strict=True)):
            raise _Bad(f"piece at {start} of shape {extent} lies outside shape {shape}")
        chunks = tuple(_chunk(c, len(packs)) for c in chunk_recs)
        if sum(c.raw_size for c in chunks) != math.prod(extent) * itemsize:
            raise _Bad(f"piece at {start} of shape {extent}: chunks hold the wrong number of bytes")
        pieces.append(Piece(start, extent, chunks))
    if sum(math.prod(p.shape) for p in pieces) != math.prod(shape):
        raise _Bad("pieces do not cover the leaf exactly")
    _check_disjoint(pieces, shape)
    return tuple(pieces)


def _check_disjoint(pieces: list[Piece], shape: tuple[int, ...]) -> None:
    """With volumes summing to the whole, disjoint pieces tile it (:func:`check_tiling`)."""
    start = np.array([p.start for p in pieces], np.int64).reshape(len(pieces), len(shape))
    extent = np.array([p.shape for p in pieces], np.int64).reshape(len(pieces), len(shape))
    check_tiling(start, extent, shape)


def check_tiling(start: np.ndarray, extent: np.ndarray, shape: tuple[int, ...]) -> None:
    """Boxes (``start`` and ``extent``, int64 arrays of one row per piece) inside ``shape`` whose
    volumes sum to its volume tile it exactly unless two overlap: count how often each cell of
    the grid their boundaries span is covered (at most MAX_GRID_CELLS cells); Bad otherwise.

    A tiling covers each cell once, so the cells the boxes cover, counted from their corners
    first, must add up to the grid's: then counting the cover touches each cell once (hostile
    boxes that each cover the whole grid would cost pieces x cells)."""
    if len(start) == 1 or not shape:
        return
    ends = start + extent
    bounds = [np.unique(np.r_[0, dim, start[:, d], ends[:, d]]) for d, dim in enumerate(shape)]
    cells = math.prod(len(b) - 1 for b in bounds)
    if cells > MAX_GRID_CELLS:
        raise _Bad(f"pieces form an irregular grid of {cells} cells, over the limit of {MAX_GRID_CELLS}")
    cover = np.zeros([len(b) - 1 for b in bounds], np.int32)
    lo = np.stack([np.searchsorted(b, start[:, d]) for d, b in enumerate(bounds)], 1).tolist()
    hi = np.stack([np.searchsorted(b, ends[:, d]) for d, b in enumerate(bounds)], 1).tolist()
    if int(np.prod(np.subtract(hi, lo), axis=1).sum()) != cells:
        raise _Bad("pieces overlap or leave holes")
    for a, z in zip(lo, hi, strict=True):
        cover[tuple(map(slice, a, z))] += 1
    if cover.size and (cover.min() != 1 or cover.max() != 1):
        raise _Bad("pieces overlap or leave holes")


def _leaf(rec: object, packs: tuple[ChunkRef, ...]) -> LeafEntry:
    if not isinstance(rec, dict):
        raise _Bad("leaf entry is not a map")
    address = _get(rec, "address", str)
    try:
        try:
            if address:
                for segment in address.split("/"):
                    canonical_segment(segment)
        except TreestoreError as exc:
            raise _Bad(f"bad address {address!r:.200}: {exc}") from None
        kind = _get(rec, "kind", str)
        if kind in PY_KINDS.values():
            try:
                value = value_from_record(kind, rec.get("value"))
            except ValueError as exc:
                raise _Bad(str(exc)) from None
            return LeafEntry(address, kind, value=value)
        if kind not in ARRAY_KINDS:
            raise UnsupportedFormatError(f"{address or '(root)'}: unknown leaf kind {kind!r}")
        dtype_name = _get(rec, "dtype", str)
        dtype = dtype_from_name(dtype_name, address=address)
        try:
            shape = check_shape(_get(rec, "shape", list), dtype.itemsize)
        except ValueError as exc:
            raise _Bad(str(exc)) from None
        pieces: tuple[Piece, ...] = ()
        if "pieces" in rec:
            pieces = _pieces(_get(rec, "pieces", list), shape, dtype.itemsize, packs)
            chunks = tuple(c for p in pieces for c in p.chunks)
        else:
            chunks = tuple(_chunk(c, len(packs)) for c in _get(rec, "chunks", list))
        if kind == "jax" and dtype_name in NOT_IN_JAX:
            raise _Bad(f"a jax array cannot have dtype {dtype_name}")
        expected = math.prod(shape) * dtype.itemsize
        if sum(c.raw_size for c in chunks) != expected:
            raise _Bad(
                f"shape {shape} of {dtype_name} needs {expected} bytes, chunks hold "
                f"{sum(c.raw_size for c in chunks)}"
            )
        for c in chunks:
            if c.pack is not None and c.offset + c.raw_size > packs[c.pack].raw_size:
                raise _Bad(f"bytes {c.offset}..{c.offset + c.raw_size} lie outside pack {c.pack}")
        impl = rec.get("prng_impl")
        if kind == "prng_key":
            if not isinstance(impl, str) or impl not in PRNG_IMPLS:
                raise UnsupportedFormatError(f"{address or '(root)'}: unknown PRNG impl {impl!r}")
            width = PRNG_IMPLS[impl]
            if dtype_name != "uint32" or not shape or shape[-1] != width:
                raise _Bad(
                    f"{impl} key data must be uint32 of shape (..., {width}), found {dtype_name}{shape}"
                )
        weak = rec.get("weak_type", False)
        if type(weak) is not bool:
            raise _Bad("field 'weak_type' should be bool")
        return LeafEntry(address, kind, dtype_name, shape, chunks, impl, pieces=pieces, weak_type=weak)
    except _Bad as exc:
        raise _Bad(f"leaf {address or '(root)'}: {exc}") from None
    except UnsupportedFormatError as exc:
        exc.address = address
        raise


def _check_tree(node: object, leaves: tuple[LeafEntry, ...], seen: set[int]) -> None:
    """Check a node record; every leaf must sit at the position its address names.

    Iterative, so a tree as deep as MAX_DEPTH never meets Python's recursion limit."""
    stack: list[tuple[object, str, int]] = [(node, "", 0)]  # (node, address, depth)
    while stack:
        node, address, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _Bad(f"tree is nested deeper than {MAX_DEPTH}")
        if not isinstance(node, dict):
            raise _Bad("tree node is not a map")
        kind = _get(node, "type", str)
        if kind == "leaf":
            i = _count(node.get("leaf"), "leaf index", len(leaves) - 1)
            if i in seen:
                raise _Bad(f"leaf {i} appears twice in the tree")
            if leaves[i].address != address:
                raise _Bad(f"leaf {leaves[i].address!r} sits at address {address!r} in the tree")
            seen.add(i)
            continue
        if kind == "none":
            continue
        if kind not in ("dict", "list", "tuple", "namedtuple", "ordereddict", "custom"):
            raise UnsupportedFormatError(f"unknown tree node type {kind!r}")
        children = _get(node, "children", list)
        if kind in ("list", "tuple"):
            segments = [str(i) for i in range(len(children))]
        else:
            records = _get(node, "keys", list)
            if len(records) != len(children):
                raise _Bad(f"{kind} node has {len(records)} keys for {len(children)} children")
            try:
                keys: list[Key] = [key_from_record(k) for k in records]
                segments = [format_key(k) for k in keys]
                check_node_keys(keys, segments, address)
            except TreestoreError as exc:
                raise _Bad(f"bad key in {kind} node at {address or '(root)'}: {exc}") from None
            if kind in ("namedtuple", "custom"):
                _get(node, "name", str)
        stack.extend(
            (child, join_address(address, segment), depth + 1)
            for segment, child in zip(reversed(segments), reversed(children), strict=True)
        )


def decode_manifest(data: bytes, checkpoint: str) -> Manifest:
    return manifest_from_record(manifest_record(data, checkpoint), checkpoint)


def manifest_from_record(rec: dict[str, Any], checkpoint: str) -> Manifest:
    """A version-1 manifest from its decoded msgpack map (see :func:`decode_manifest`)."""
    what = f"manifest of checkpoint {checkpoint!r}"
    version = _check_version(rec, MANIFEST_MAGIC, what, checkpoint)
    with manifest_errors(what, checkpoint):
        if version != VERSION:
            raise _Bad(f"it is a version-{version} manifest, not the version-1 form this decodes")
        packs = tuple(_chunk(p, 0) for p in _get(rec, "packs", list))
        leaves = tuple(_leaf(x, packs) for x in _get(rec, "leaves", list))
        addresses = [leaf.address for leaf in leaves]
        if len(set(addresses)) != len(addresses):
            raise _Bad("two leaves share an address")
        tree = _get(rec, "tree", dict)
        seen: set[int] = set()
        _check_tree(tree, leaves, seen)
        if len(seen) != len(leaves):
            raise _Bad(f"tree references {len(seen)} of {len(leaves)} leaves")
        codec = _get(rec, "codec", dict)
        try:
            check_metadata(rec.get("metadata"))  # the bound writers keep to
        except InvalidInputError as exc:
            raise _Bad(str(exc)) from None
        return Manifest(
            name=_get(rec, "name", str),
            created=float(_get(rec, "created", float)),
            tree=tree,
            leaves=leaves,
            packs=packs,
            metadata=rec.get("metadata"),
            codec=codec,
            chunk_size=_count(rec.get("chunk_size"), "chunk_size", MAX_CHUNK_BYTES),
            version=version,
        )
