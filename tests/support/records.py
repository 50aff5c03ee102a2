"""Version-1 manifests written by hand, as a hostile or a hand-made store holds them: a test
describes the leaves with the public records (``LeafEntry``, ``ChunkRef``, ``Piece``) and this
writes the bytes itself (SPEC.md, appendix A), independently of treestore's encoders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from treestore._format.dtypes import value_to_record
from treestore._format.encoding import to_msgpack
from treestore._format.manifest.codec import decode_any
from treestore._format.manifest.columns import Columns
from treestore._format.manifest.records import ChunkRef, LeafEntry


@dataclass(frozen=True)
class Hand:
    """A manifest's fields as a test writes them (the fields of ``treestore.types.Manifest``)."""

    name: str
    created: float
    tree: Any
    leaves: tuple[LeafEntry, ...]
    packs: tuple[ChunkRef, ...] = ()
    metadata: Any = None
    codec: dict[str, Any] = field(default_factory=dict)
    chunk_size: int = 0


def ref_record(c: ChunkRef) -> list[object]:
    return [c.digest, c.raw_size, c.stored_size] + ([] if c.pack is None else [c.pack, c.offset])


def leaf_record(e: LeafEntry) -> dict[str, object]:
    rec: dict[str, object] = {"address": e.address, "kind": e.kind}
    if not e.is_array:  # an int leaf's value may be given as its stored text, whatever its length
        rec["value"] = (
            e.value if e.kind == "int" and isinstance(e.value, str) else value_to_record(e.kind, e.value)
        )
        return rec
    rec["dtype"] = e.dtype
    rec["shape"] = list(e.shape or ())
    if e.pieces:
        rec["pieces"] = [[list(p.start), list(p.shape), [ref_record(c) for c in p.chunks]] for p in e.pieces]
    else:
        rec["chunks"] = [ref_record(c) for c in e.chunks]
    if e.prng_impl is not None:
        rec["prng_impl"] = e.prng_impl
    if e.weak_type:
        rec["weak_type"] = True
    return rec


def v1_bytes(m: Any) -> bytes:
    """The version-1 bytes of ``m`` (a :class:`Hand`, or any manifest view with its fields)."""
    return to_msgpack(
        {
            "format": "treestore.manifest",
            "version": 1,
            "name": m.name,
            "created": m.created,
            "metadata": m.metadata,
            "codec": m.codec,
            "chunk_size": m.chunk_size,
            "tree": m.tree,
            "packs": [ref_record(p) for p in m.packs],
            "leaves": [leaf_record(e) for e in m.leaves],
        }
    )


def columns_of(m: Any) -> Columns:
    """``m`` as a reader reads it (ManifestDamagedError or UnsupportedFormatError where readers
    refuse it)."""
    c = decode_any(v1_bytes(m), m.name)
    assert isinstance(c, Columns)
    return c
