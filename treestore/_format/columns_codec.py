"""Version-2 manifests as bytes: decoding (either version, validated as readers validate it)
and encoding, the one encoder every writer uses (SPEC.md, section 6).

:func:`decode_any` is what readers call: a version-1 manifest is decoded once and checked in its
version-2 form too; :func:`encode` and :func:`encode_columns` refuse what readers would refuse.
:func:`columns_from_manifest` and :func:`columns_from_fields` build the columns of a manifest a
writer holds as leaf entries, or assembled column by column.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from treestore._format.columns import (
    _CODE,
    ARRAY_CODES,
    ARRAY_FIELDS,
    KINDS,
    PRNG_NAMES,
    VERSION,
    Columns,
)
from treestore._format.columns_check import validate
from treestore._format.columns_tree import Nodes, check_nodes, nodes_from_tree
from treestore._format.dtypes import value_to_record
from treestore._format.encoding import FORMAT_VERSION, Bad, manifest_errors, to_msgpack
from treestore._format.encoding import count as _count
from treestore._format.encoding import field as _get
from treestore._format.leaf_table import LeafTable, ref_of
from treestore._format.limits import MAX_CHUNK_BYTES, MAX_NDIM
from treestore._format.manifest import (
    MANIFEST_MAGIC,
    Manifest,
    check_metadata,
    encode_manifest,
    manifest_from_record,
    manifest_record,
    within_size,
)
from treestore._format.parted import Parted, parts_fields, parts_from_record
from treestore.errors import (
    InvalidInputError,
    ManifestCorruptError,
    OutOfMemoryError,
    UnsupportedFormatError,
)


def _array(rec: dict[str, Any], key: str) -> np.ndarray:
    return binary_array(rec, key, ARRAY_FIELDS[key])


def binary_array(rec: dict[str, Any], key: str, dtype: np.dtype[Any]) -> np.ndarray:
    """The records of bin field ``key`` of a decoded record, as a read-only array of ``dtype``
    (Bad when the field is missing, not bin, or not a whole number of records)."""
    data = _get(rec, key, bytes)
    if len(data) % dtype.itemsize:
        raise Bad(
            f"field {key!r} holds {len(data)} bytes, not a whole number of {dtype.itemsize}-byte records"
        )
    return np.frombuffer(data, dtype)


def _str_list(rec: dict[str, Any], key: str) -> tuple[str, ...]:
    items = _get(rec, key, list)
    if any(type(s) is not str for s in items):
        raise Bad(f"field {key!r} should be a list of str")
    return tuple(items)


def decode_columns(data: bytes, checkpoint: str) -> Columns | Parted:
    """A version-2 manifest's bytes, validated (a manifest stored in parts: its frame);
    ManifestCorruptError, UnsupportedFormatError or OutOfMemoryError otherwise, whatever the
    bytes."""
    return _decode_record(manifest_record(data, checkpoint), checkpoint)


def decode_any(data: bytes, checkpoint: str) -> Columns | Parted:
    """A manifest of either version as :class:`Columns`, validated as readers validate it (one
    stored in parts: its frame, which :mod:`treestore._engine.parts` completes). A version-1
    manifest is checked by its own decoder, then as a version-2 reader checks its columns."""
    what = f"manifest of checkpoint {checkpoint!r}"
    rec = manifest_record(data, checkpoint)
    if rec.get("version") == VERSION and type(rec.get("version")) is int:
        return _decode_record(rec, checkpoint)
    m = manifest_from_record(rec, checkpoint)
    try:
        return replace(columns_from_manifest(m), version=m.version)
    except InvalidInputError as exc:  # a version-1 manifest no version-1 writer writes
        raise ManifestCorruptError(f"{what}: {exc}", checkpoint=checkpoint) from None


def _decode_record(rec: dict[str, Any], checkpoint: str) -> Columns | Parted:
    what = f"manifest of checkpoint {checkpoint!r}"
    try:
        with manifest_errors(what, checkpoint):
            if rec.get("format") != MANIFEST_MAGIC:
                raise Bad(f"format is {rec.get('format')!r:.60}, expected {MANIFEST_MAGIC!r}")
            version = rec.get("version")
            if type(version) is not int:
                raise Bad("it has no integer version")
            if version != VERSION:
                raise UnsupportedFormatError(
                    f"format version {version!r:.20} is not {VERSION}, the columnar manifest this decodes"
                )
            try:
                check_metadata(rec.get("metadata"))  # the bound writers keep to
            except InvalidInputError as exc:
                raise Bad(str(exc)) from None
            fields: dict[str, Any] = {key: _array(rec, key) for key in ARRAY_FIELDS}
            fields.update(
                name=_get(rec, "name", str),
                created=float(_get(rec, "created", float)),
                metadata=rec.get("metadata"),
                codec=_get(rec, "codec", dict),
                chunk_size=_count(rec.get("chunk_size"), "chunk_size", MAX_CHUNK_BYTES),
                values=_get(rec, "values", list),
                stats=rec.get("stats"),  # optional: checked, and ignored when it makes no sense
            )
            segments, names = _str_list(rec, "segments"), _str_list(rec, "node_names")
            nodes = check_nodes(
                segments, fields["nodes"], names, fields["node_leaves"], len(fields["leaves"])
            )
            if not _get(rec, "parts", list):
                return validate(fields, nodes)
            parted = parts_from_record(rec, len(fields["leaves"]))
            return Parted(validate(fields, nodes, waiting=True), *parted)
    except MemoryError:
        raise OutOfMemoryError(f"{what}: out of memory decoding it", checkpoint=checkpoint) from None
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:  # a check missed
        raise ManifestCorruptError(
            f"{what}: unexpected malformation ({type(exc).__name__}: {exc})", checkpoint=checkpoint
        ) from exc


def encode_columns(manifest: Columns | Parted) -> bytes:
    """The bytes of a version-2 manifest (or of the frame of one stored in parts);
    InvalidInputError beyond the MAX_MANIFEST_BYTES readers accept."""
    parted = manifest if isinstance(manifest, Parted) else None
    c = manifest.frame if isinstance(manifest, Parted) else manifest
    if parted is None:
        c.require_pieces()  # a reader's columns of some leaves are not a manifest
    data = to_msgpack(
        {
            "format": MANIFEST_MAGIC,
            "version": VERSION,
            "name": c.name,
            "created": c.created,
            "metadata": c.metadata,
            "codec": c.codec,
            "chunk_size": c.chunk_size,
            "segments": list(c.nodes.segments),
            "nodes": c.nodes.table.tobytes(),
            "node_names": list(c.nodes.names),
            "node_leaves": c.nodes.leaves.tobytes(),
            "leaves": c.leaves.tobytes(),
            "shapes": c.shapes.tobytes(),
            "values": stored_values(c),
            "piece_counts": c.piece_counts.tobytes(),
            "piece_chunks": c.piece_chunks.tobytes(),
            "piece_start": c.piece_start.tobytes(),
            "piece_shape": c.piece_shape.tobytes(),
            "chunks": c.chunks.tobytes(),
            "packs": c.packs.tobytes(),
            **parts_fields(parted),
            **({} if c.stats is None else {"stats": c.stats.tobytes()}),
        }
    )
    return within_size(data, c.name)


def stored_values(c: Columns) -> list[object]:
    """The value of each scalar leaf of ``c`` as a manifest stores it (SPEC.md, section 6.4)."""
    kinds = c.leaves["kind"]
    scalars = np.flatnonzero(kinds >= ARRAY_CODES).tolist()
    return [value_to_record(KINDS[kinds[i]], v) for i, v in zip(scalars, c.values, strict=True)]


def encode(columns: Columns, version: int = FORMAT_VERSION) -> bytes:
    """The bytes of a checked manifest in format ``version`` (1 or 2): the one encoder every
    writer (save, derive, copy) uses. Version 1 holds no statistics. InvalidInputError naming
    the checkpoint when readers would refuse them (over MAX_MANIFEST_BYTES)."""
    if version == VERSION:
        return encode_columns(columns)
    if version == 1:
        return encode_manifest(columns.to_manifest())
    raise InvalidInputError(f"checkpoint {columns.name!r}: cannot write format version {version!r}")


def columns_from_manifest(m: Manifest) -> Columns:
    """The version-2 form of a version-1 manifest, checked exactly as readers check it
    (InvalidInputError naming the checkpoint when they would refuse it)."""
    try:
        return _from_manifest(m)
    except (Bad, UnsupportedFormatError) as exc:
        raise InvalidInputError(
            f"checkpoint {m.name!r}: its manifest would not be readable: {exc}", checkpoint=m.name
        ) from None


def _from_manifest(m: Manifest) -> Columns:
    """The columns of version-1 leaf entries, appended to the one table builder a save uses."""
    nodes = nodes_from_tree(m.tree, len(m.leaves))
    table = LeafTable(pieces_kept=True)  # a leaf's pieces are what its entry says
    for i, leaf in enumerate(m.leaves):
        where = leaf.address or "(root)"
        if leaf.kind not in KINDS:
            raise UnsupportedFormatError(f"{where}: unknown leaf kind {leaf.kind!r}")
        if KINDS.index(leaf.kind) >= ARRAY_CODES:
            try:
                value_to_record(leaf.kind, leaf.value)
            except ValueError as exc:
                raise Bad(f"leaf {where}: {exc}") from None
            table.value(leaf.kind, leaf.value, leaf.address, i)
            continue
        if leaf.dtype not in _CODE:
            raise UnsupportedFormatError(f"{where}: unknown dtype {leaf.dtype!r}")
        if leaf.prng_impl not in PRNG_NAMES:
            raise UnsupportedFormatError(f"{where}: unknown PRNG impl {leaf.prng_impl!r}")
        shape = tuple(leaf.shape or ())
        if len(shape) > MAX_NDIM:
            raise Bad(f"a leaf has more than {MAX_NDIM} dimensions")
        pieces = None
        if leaf.pieces:
            if any(len(p.start) != len(shape) or len(p.shape) != len(shape) for p in leaf.pieces):
                raise Bad(f"leaf {where}: a piece has other dimensions than the leaf")
            if tuple(c for p in leaf.pieces for c in p.chunks) != tuple(leaf.chunks):
                raise Bad(f"leaf {where}: its chunks are not its pieces' chunks")
            pieces = [(tuple(p.start), tuple(p.shape), len(p.chunks)) for p in leaf.pieces]
        if any(type(r.digest) is not bytes or len(r.digest) != 32 for r in leaf.chunks):
            raise Bad("a chunk digest is not 32 bytes")
        refs = [ref_of(r) for r in leaf.chunks]
        table.array(
            leaf.kind, leaf.dtype, shape, leaf.prng_impl, leaf.weak_type, refs, pieces, leaf.address, i
        )
    if any(type(p.digest) is not bytes or len(p.digest) != 32 for p in m.packs):
        raise Bad("a chunk digest is not 32 bytes")
    try:
        fields = table.fields(list(m.packs))
    except (OverflowError, ValueError, TypeError):
        raise Bad("a size, offset, dimension or count does not fit its column") from None
    fields.update(
        name=m.name,
        created=float(m.created),
        metadata=m.metadata,
        codec=dict(m.codec),
        chunk_size=_count(m.chunk_size, "chunk_size", MAX_CHUNK_BYTES),
    )
    check_metadata(m.metadata)
    return validate(fields, nodes)


def columns_from_fields(
    fields: dict[str, Any], tree: object, *, waiting: bool | np.ndarray = False
) -> Columns:
    """A version-2 manifest assembled column by column (a multi-process save merging its
    processes' parts), checked exactly as readers check one: ``fields`` holds what
    :func:`decode_columns` reads from a manifest's bytes (the arrays of ARRAY_FIELDS but
    ``nodes`` and ``node_leaves``, in those dtypes; ``name``, ``created``, ``metadata``, ``codec``,
    ``chunk_size``; ``values`` as stored), ``tree`` the version-1 node record or a
    :class:`~treestore._format.columns_tree.Nodes` table, ``waiting`` as :func:`validate`
    takes it. InvalidInputError naming the checkpoint when readers would refuse it."""
    name = fields["name"]
    check_metadata(fields["metadata"])
    try:
        for key in ARRAY_FIELDS.keys() & fields.keys():
            if fields[key].dtype != ARRAY_FIELDS[key]:
                raise Bad(f"field {key!r} has dtype {fields[key].dtype}, not {ARRAY_FIELDS[key]}")
        chunk_size = _count(fields["chunk_size"], "chunk_size", MAX_CHUNK_BYTES)
        nleaves = len(fields["leaves"])
        nodes = tree if isinstance(tree, Nodes) else nodes_from_tree(tree, nleaves)
        if len(nodes.leaves) != nleaves:
            raise Bad(f"the tree has {len(nodes.leaves)} leaves, the columns {nleaves}")
        return validate({**fields, "chunk_size": chunk_size}, nodes, waiting=waiting)
    except (Bad, UnsupportedFormatError) as exc:
        raise InvalidInputError(
            f"checkpoint {name!r}: its manifest would not be readable: {exc}", checkpoint=name
        ) from None


__all__ = [
    "binary_array",
    "columns_from_fields",
    "columns_from_manifest",
    "decode_any",
    "decode_columns",
    "encode",
    "encode_columns",
    "stored_values",
]
