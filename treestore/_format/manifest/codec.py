"""Manifests as bytes: decoding either version into the one model, validated as readers
validate it, and encoding it (SPEC.md, section 6): a save's manifest and a multi-process save's
frame through :func:`encode_columns`, derive's and copy's through :func:`encode`, which writes
version 1 too. A multi-process save's parts are encoded by :mod:`treestore._format.parts.part`.

:func:`decode_any` is what readers call: a version-1 manifest goes to its codec
(:mod:`treestore._format.manifest.v1`) and is checked in its version-2 form too; :func:`encode` and
:func:`encode_columns` refuse what readers would refuse. :func:`columns_from_fields` builds the
columns of a manifest a writer assembled column by column.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from treestore._format.dtypes import value_to_record
from treestore._format.encoding import FORMAT_VERSION, Bad, manifest_errors, to_msgpack
from treestore._format.encoding import count as _count
from treestore._format.encoding import field as _get
from treestore._format.limits import MAX_CHUNK_BYTES
from treestore._format.manifest.check import validate
from treestore._format.manifest.columns import (
    ARRAY_CODES,
    ARRAY_FIELDS,
    KINDS,
    VERSION,
    Columns,
)
from treestore._format.manifest.frame import Frame, parts_fields, parts_from_record
from treestore._format.manifest.rules import (
    MANIFEST_MAGIC,
    check_metadata,
    header_record,
    manifest_record,
    within_size,
)
from treestore._format.manifest.tree import Nodes, check_nodes, nodes_from_tree
from treestore._format.manifest.v1 import decode_v1, encode_v1
from treestore.errors import (
    InvalidInputError,
    ManifestDamagedError,
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


def decode_columns(data: bytes, checkpoint: str) -> Columns | Frame:
    """A version-2 manifest's bytes, validated (a manifest stored in parts: its frame);
    ManifestDamagedError, UnsupportedFormatError or OutOfMemoryError otherwise, whatever the
    bytes."""
    return _decode_record(manifest_record(data, checkpoint), checkpoint)


def decode_any(data: bytes, checkpoint: str) -> Columns | Frame:
    """A manifest of either version as :class:`Columns`, validated as readers validate it (one
    stored in parts: its frame, which :mod:`treestore._engine.reading.parts` completes). A version-1
    manifest is checked by its own decoder, then as a version-2 reader checks its columns."""
    rec = manifest_record(data, checkpoint)
    if rec.get("version") == VERSION and type(rec.get("version")) is int:
        return _decode_record(rec, checkpoint)
    with _unforeseen(checkpoint):
        return decode_v1(rec, checkpoint)


@contextmanager
def _unforeseen(checkpoint: str) -> Iterator[None]:
    """What a decoder did not foresee still names the checkpoint: running out of memory is an
    OutOfMemoryError, an exception a check missed a ManifestDamagedError."""
    what = f"manifest of checkpoint {checkpoint!r}"
    try:
        yield
    except MemoryError:
        raise OutOfMemoryError(f"{what}: out of memory decoding it", checkpoint=checkpoint) from None
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:  # a check missed
        raise ManifestDamagedError(
            f"{what}: unexpected malformation ({type(exc).__name__}: {exc})", checkpoint=checkpoint
        ) from exc


def _decode_record(rec: dict[str, Any], checkpoint: str) -> Columns | Frame:
    what = f"manifest of checkpoint {checkpoint!r}"
    with _unforeseen(checkpoint), manifest_errors(what, checkpoint):
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
        nodes = check_nodes(segments, fields["nodes"], names, fields["node_leaves"], len(fields["leaves"]))
        if not _get(rec, "parts", list):
            return validate(fields, nodes)
        layout, parts = parts_from_record(rec, len(fields["leaves"]))
        return Frame(validate(fields, nodes, unread=True), layout, parts)


def encode_columns(manifest: Columns | Frame) -> bytes:
    """The bytes of a version-2 manifest (or of the frame of one stored in parts);
    InvalidInputError beyond the MAX_MANIFEST_BYTES readers accept."""
    frame = manifest if isinstance(manifest, Frame) else None
    c = manifest.columns if isinstance(manifest, Frame) else manifest
    if frame is None:
        c.require_pieces()  # a reader's columns of some leaves are not a manifest
    data = to_msgpack(
        {
            **header_record(c, VERSION),
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
            **parts_fields(frame),
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
    """The bytes of a checked manifest in format ``version`` (1 or 2), as derive and copy write
    it (a save calls :func:`encode_columns`). Version 1 holds no statistics. InvalidInputError naming
    the checkpoint when readers would refuse them (over MAX_MANIFEST_BYTES)."""
    if version == VERSION:
        return encode_columns(columns)
    if version == 1:
        return encode_v1(columns)
    raise InvalidInputError(f"checkpoint {columns.name!r}: cannot write format version {version!r}")


def columns_from_fields(
    fields: dict[str, Any], tree: object, *, unread: bool | np.ndarray = False
) -> Columns:
    """A version-2 manifest assembled column by column (a multi-process save merging its
    processes' parts), checked exactly as readers check one: ``fields`` holds what
    :func:`decode_columns` reads from a manifest's bytes (the arrays of ARRAY_FIELDS but
    ``nodes`` and ``node_leaves``, in those dtypes; ``name``, ``created``, ``metadata``, ``codec``,
    ``chunk_size``; ``values`` as stored), ``tree`` the version-1 node record or a
    :class:`~treestore._format.manifest.tree.Nodes` table, ``unread`` as :func:`validate`
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
        return validate({**fields, "chunk_size": chunk_size}, nodes, unread=unread)
    except (Bad, UnsupportedFormatError) as exc:
        raise InvalidInputError(
            f"checkpoint {name!r}: its manifest would not be readable: {exc}", checkpoint=name
        ) from None


__all__ = [
    "binary_array",
    "columns_from_fields",
    "decode_any",
    "decode_columns",
    "encode",
    "encode_columns",
    "stored_values",
]
