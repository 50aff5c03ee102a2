"""The version-1 manifest codec (SPEC.md, appendix A): one msgpack map per leaf, decoded
straight into the one in-memory model (:class:`~treestore._format.manifest.columns.Columns`) and encoded
from it. Version 1 is a codec, not a model: no leaf entry object is made either way.

A version-1 manifest is checked by its own rules leaf by leaf as it is decoded (each field's
type, every size against its bound and against the other fields), then as a version-2 reader
checks its columns (:func:`~treestore._format.manifest.check.validate`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from treestore._format.address import canonical_segment
from treestore._format.dtypes import (
    ARRAY_KINDS,
    NOT_IN_JAX,
    PRNG_IMPLS,
    PY_KINDS,
    dtype_from_name,
    value_from_record,
    value_to_record,
)
from treestore._format.encoding import DIGEST_BYTES, manifest_errors, to_msgpack
from treestore._format.encoding import Bad as _Bad
from treestore._format.encoding import check_version as _check_version
from treestore._format.encoding import count as _count
from treestore._format.encoding import field as _get
from treestore._format.limits import CHUNK_SLACK, MAX_CHUNK_BYTES, MAX_DIM, MAX_PIECES
from treestore._format.manifest.check import validate
from treestore._format.manifest.columns import (
    ARRAY_CODES,
    DTYPE_NAMES,
    IN_PIECES,
    KINDS,
    PRNG_NAMES,
    PRNG_SHIFT,
    WEAK_TYPE,
    Columns,
)
from treestore._format.manifest.leaf_table import LeafTable, PieceRow, Ref
from treestore._format.manifest.records import ChunkRef
from treestore._format.manifest.rules import (
    MANIFEST_MAGIC,
    check_metadata,
    check_shape,
    check_tiling,
    header_record,
    within_size,
)
from treestore._format.manifest.tree import nodes_from_tree
from treestore._kernels.room import ROOM_EVERY, check_room
from treestore.errors import InvalidInputError, TreestoreError, UnsupportedFormatError

VERSION = 1


# --- decoding -------------------------------------------------------------------------------------
def decode_v1(rec: dict[str, Any], checkpoint: str) -> Columns:
    """The columns of a version-1 manifest's decoded msgpack map, checked by version 1's rules
    and then as version 2's readers check columns; ManifestDamagedError or
    UnsupportedFormatError otherwise, whatever the map holds."""
    what = f"manifest of checkpoint {checkpoint!r}"
    version = _check_version(rec, MANIFEST_MAGIC, what, checkpoint)
    with manifest_errors(what, checkpoint):
        if version != VERSION:
            raise _Bad(f"it is a version-{version} manifest, not the version-1 form this decodes")
        packs: list[Ref] = [_chunk(p, 0) for p in _get(rec, "packs", list)]
        table = LeafTable(pieces_kept=True)  # a leaf's pieces are what its record says
        addresses: list[str] = []
        for i, x in enumerate(_get(rec, "leaves", list)):
            if i % ROOM_EVERY == 0:
                check_room()  # stop while running out can still be reported
            addresses.append(_leaf(x, packs, table, i))
        nodes = nodes_from_tree(_get(rec, "tree", dict), len(addresses))
        for stored, placed in zip(addresses, nodes.addresses(), strict=True):
            if stored != placed:
                raise _Bad(f"leaf {stored!r:.200} sits at address {placed!r:.200} in the tree")
        codec = _get(rec, "codec", dict)
        try:
            check_metadata(rec.get("metadata"))  # the bound writers keep to
        except InvalidInputError as exc:
            raise _Bad(str(exc)) from None
        fields = table.fields([ChunkRef(d, raw, stored) for d, raw, stored, _, _ in packs])
        fields.update(
            name=_get(rec, "name", str),
            created=float(_get(rec, "created", float)),
            metadata=rec.get("metadata"),
            codec=codec,
            chunk_size=_count(rec.get("chunk_size"), "chunk_size", MAX_CHUNK_BYTES),
        )
        return replace(validate(fields, nodes), version=VERSION)


def _chunk(rec: object, npacks: int) -> Ref:
    if not isinstance(rec, list) or len(rec) not in (3, 5):
        raise _Bad(f"chunk reference should be a list of 3 or 5, found {rec!r:.80}")
    d = rec[0]
    if type(d) is not bytes or len(d) != DIGEST_BYTES:
        raise _Bad("chunk digest should be 32 bytes")
    size = _count(rec[1], "chunk size", MAX_CHUNK_BYTES)
    stored = _count(rec[2], "stored chunk size", MAX_CHUNK_BYTES + CHUNK_SLACK)
    if len(rec) == 3:
        return (d, size, stored, -1, 0)
    pack = _count(rec[3], "pack index", max(npacks - 1, 0))
    if pack >= npacks:
        raise _Bad(f"pack index {pack} is out of range ({npacks} packs)")
    return (d, size, stored, pack, _count(rec[4], "pack offset", MAX_CHUNK_BYTES))


def _pieces(
    records: list[Any], shape: tuple[int, ...], itemsize: int, npacks: int
) -> tuple[list[PieceRow], list[Ref]]:
    """Pieces that tile ``shape`` exactly (inside it, no overlaps, no holes), and their chunk
    refs piece after piece."""
    if not 1 <= len(records) <= MAX_PIECES:
        raise _Bad(f"{len(records)} pieces; a sharded leaf has 1 to {MAX_PIECES}")
    pieces: list[PieceRow] = []
    refs: list[Ref] = []
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
        chunks = [_chunk(c, npacks) for c in chunk_recs]
        if sum(c[1] for c in chunks) != math.prod(extent) * itemsize:
            raise _Bad(f"piece at {start} of shape {extent}: chunks hold the wrong number of bytes")
        pieces.append((start, extent, len(chunks)))
        refs += chunks
    if sum(math.prod(p[1]) for p in pieces) != math.prod(shape):
        raise _Bad("pieces do not cover the leaf exactly")
    ndim = len(shape)
    starts = np.array([p[0] for p in pieces], np.int64).reshape(len(pieces), ndim)
    extents = np.array([p[1] for p in pieces], np.int64).reshape(len(pieces), ndim)
    check_tiling(starts, extents, shape)  # with volumes summing to the whole, disjoint pieces tile it
    return pieces, refs


def _leaf(rec: object, packs: list[Ref], table: LeafTable, i: int) -> str:
    """Append leaf record ``i`` to ``table``, once it is valid; its address."""
    if not isinstance(rec, dict):
        raise _Bad("leaf entry is not a map")
    address = _get(rec, "address", str)
    where = address or "(root)"
    try:
        try:
            for segment in address.split("/") if address else ():
                canonical_segment(segment)
        except TreestoreError as exc:
            raise _Bad(f"bad address {address!r:.200}: {exc}") from None
        kind = _get(rec, "kind", str)
        if kind in PY_KINDS.values():
            try:
                table.value(kind, value_from_record(kind, rec.get("value")), address, i)
            except (ValueError, InvalidInputError) as exc:
                raise _Bad(str(exc)) from None
            return address
        if kind not in ARRAY_KINDS:
            raise UnsupportedFormatError(f"{where}: unsupported leaf kind {kind!r}")
        dtype_name = _get(rec, "dtype", str)
        dtype = dtype_from_name(dtype_name, address=address)  # its names are DTYPE_NAMES (tested)
        try:
            shape = check_shape(_get(rec, "shape", list), dtype.itemsize)
        except ValueError as exc:
            raise _Bad(str(exc)) from None
        pieces: list[PieceRow] | None = None
        if "pieces" in rec:
            pieces, refs = _pieces(_get(rec, "pieces", list), shape, dtype.itemsize, len(packs))
        else:
            refs = [_chunk(c, len(packs)) for c in _get(rec, "chunks", list)]
        if kind == "jax" and dtype_name in NOT_IN_JAX:
            raise _Bad(f"a jax array cannot have dtype {dtype_name}")
        expected = math.prod(shape) * dtype.itemsize
        held = sum(r[1] for r in refs)
        if held != expected:
            raise _Bad(f"shape {shape} of {dtype_name} needs {expected} bytes, chunks hold {held}")
        for _, raw, _, pack, offset in refs:
            if pack >= 0 and offset + raw > packs[pack][1]:
                raise _Bad(f"bytes {offset}..{offset + raw} lie outside pack {pack}")
        impl = rec.get("prng_impl")
        if kind == "prng_key":
            if not isinstance(impl, str) or impl not in PRNG_IMPLS:
                raise UnsupportedFormatError(f"{where}: unsupported PRNG implementation {impl!r}")
            width = PRNG_IMPLS[impl]
            if dtype_name != "uint32" or not shape or shape[-1] != width:
                raise _Bad(
                    f"{impl} key data must be uint32 of shape (..., {width}), found {dtype_name}{shape}"
                )
        elif impl is not None and impl not in PRNG_NAMES:
            raise UnsupportedFormatError(f"{where}: unsupported PRNG implementation {impl!r:.40}")
        weak = rec.get("weak_type", False)
        if type(weak) is not bool:
            raise _Bad("field 'weak_type' should be bool")
        table.array(kind, dtype_name, shape, impl, weak, refs, pieces, address, i)
        return address
    except _Bad as exc:
        raise _Bad(f"leaf {where}: {exc}") from None
    except UnsupportedFormatError as exc:
        exc.address = address
        raise


# --- encoding -------------------------------------------------------------------------------------
def encode_v1(c: Columns) -> bytes:
    """The bytes of manifest ``c`` in the version-1 form (which holds no statistics);
    InvalidInputError beyond the MAX_MANIFEST_BYTES readers accept."""
    c.require_pieces()
    data = to_msgpack(
        {
            **header_record(c, VERSION),
            "tree": c.nodes.tree_record(),
            "packs": [[bytes(d), raw, stored] for d, raw, stored in c.packs.tolist()],
            "leaves": _leaf_records(c),
        }
    )
    return within_size(data, c.name, "store large bytes and str leaves as numpy arrays, or save fewer leaves")


def _leaf_records(c: Columns) -> list[dict[str, object]]:
    refs = [
        [bytes(d), raw, stored] if pack < 0 else [bytes(d), raw, stored, pack, offset]
        for d, raw, stored, pack, offset in c.chunks.tolist()
    ]
    shapes = c.shapes.tolist()
    addresses = c.addresses
    out: list[dict[str, object]] = []
    value = 0
    for i, (kind, dtype, _, flags, _) in enumerate(c.leaves.tolist()):
        rec: dict[str, object] = {"address": addresses[i], "kind": KINDS[kind]}
        out.append(rec)
        if kind >= ARRAY_CODES:
            rec["value"] = value_to_record(KINDS[kind], c.values[value])
            value += 1
            continue
        lo, hi = int(c.chunk_start[i]), int(c.chunk_start[i + 1])
        rec["dtype"] = DTYPE_NAMES[dtype]
        rec["shape"] = shapes[c.shape_start[i] : c.shape_start[i + 1]]
        if flags & IN_PIECES:
            starts, boxes, first, count = c.piece_rows(i)
            rec["pieces"] = [
                [start, box, refs[f : f + n]]
                for start, box, f, n in zip(
                    starts.tolist(), boxes.tolist(), first.tolist(), count.tolist(), strict=True
                )
            ]
        else:
            rec["chunks"] = refs[lo:hi]
        impl = PRNG_NAMES[flags >> PRNG_SHIFT]
        if impl is not None:
            rec["prng_impl"] = impl
        if flags & WEAK_TYPE:
            rec["weak_type"] = True
    return out


__all__ = ["VERSION", "decode_v1", "encode_v1"]
