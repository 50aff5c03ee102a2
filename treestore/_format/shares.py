"""Each process's share of a multi-process save: its staging record, in columns.

A process of a multi-process save writes the pieces it owns, and its packs, as its staging record
(SPEC.md, section 3.4) in the version-2 manifest's conventions (section 5.7): little-endian bin
fields, one record per piece, per chunk ref and per pack. The primary decodes each record without
trusting it (:func:`decode_share`) and merges them (:mod:`treestore._format.shares_merge`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._format.columns import CHUNK_DTYPE, PACK_DTYPE
from treestore._format.columns_codec import binary_array
from treestore._format.encoding import Bad, digest, from_msgpack, to_msgpack
from treestore._format.encoding import field as _get
from treestore._format.manifest import ChunkRef, LeafEntry
from treestore.errors import TreestoreError

STAGING_FORMAT = "treestore.staging"
SHARE_FIELDS: dict[str, np.dtype[Any]] = {
    "piece_leaves": np.dtype("<u4"),  # the leaf index of each piece
    "piece_chunks": np.dtype("<u4"),  # chunk refs of each piece
    "piece_start": np.dtype("<u8"),  # each piece's start, the leaf's ndim entries per piece
    "piece_shape": np.dtype("<u8"),  # each piece's shape
    "chunks": CHUNK_DTYPE,  # every piece's chunk refs, piece after piece; packs index `packs`
    "packs": PACK_DTYPE,  # this process's packs
}


def ref_table(refs: Sequence[ChunkRef]) -> np.ndarray:
    """Chunk refs as CHUNK_DTYPE records (pack -1 for a chunk of its own)."""
    table = np.zeros(len(refs), CHUNK_DTYPE)
    if refs:
        table["digest"] = np.frombuffer(b"".join(r.digest for r in refs), "V32")
        table["raw"] = [r.raw_size for r in refs]
        table["stored"] = [r.stored_size for r in refs]
        table["pack"] = [-1 if r.pack is None else r.pack for r in refs]
        table["offset"] = [r.offset for r in refs]
    return table


def pack_table(packs: Sequence[ChunkRef]) -> np.ndarray:
    table = np.zeros(len(packs), PACK_DTYPE)
    if packs:
        table["digest"] = np.frombuffer(b"".join(p.digest for p in packs), "V32")
        table["raw"] = [p.raw_size for p in packs]
        table["stored"] = [p.stored_size for p in packs]
    return table


def layout_digest(tree: object, sharded: Iterable[tuple[str, str | None, tuple[int, ...]] | None]) -> bytes:
    """What every process of a save must agree on: the tree's node record, and the kind, dtype
    and shape of each sharded leaf (None for the others)."""
    return digest(to_msgpack([tree, [None if s is None else [s[0], s[1], list(s[2])] for s in sharded]]))


@dataclass(frozen=True, eq=False)
class Share:
    """One process's pieces and packs (SHARE_FIELDS), or the error that stopped it."""

    piece_leaves: np.ndarray
    piece_chunks: np.ndarray
    piece_start: np.ndarray
    piece_shape: np.ndarray
    chunks: np.ndarray
    packs: np.ndarray
    error: str | None = None

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray], error: str | None = None) -> Share:
        """A share of the arrays of SHARE_FIELDS, by name."""
        a = arrays
        return cls(
            a["piece_leaves"],
            a["piece_chunks"],
            a["piece_start"],
            a["piece_shape"],
            a["chunks"],
            a["packs"],
            error,
        )

    @classmethod
    def failed(cls, error: str) -> Share:
        return cls.of({key: np.zeros(0, dtype) for key, dtype in SHARE_FIELDS.items()}, error)


def share_from_entries(
    where: Mapping[str, int], entries: Iterable[LeafEntry], packs: Sequence[ChunkRef]
) -> Share:
    """This process's share: the pieces of its leaf entries (``where`` gives each address's leaf
    index) and its packs. Python work in the pieces this process owns, as its save already did."""
    leaves: list[int] = []
    counts: list[int] = []
    starts: list[int] = []
    shapes: list[int] = []
    refs: list[ChunkRef] = []
    for entry in entries:
        i = where[entry.address]
        for piece in entry.pieces:
            leaves.append(i)
            counts.append(len(piece.chunks))
            starts += piece.start
            shapes += piece.shape
            refs += piece.chunks
    return Share(
        np.array(leaves, "<u4"),
        np.array(counts, "<u4"),
        np.array(starts, "<u8"),
        np.array(shapes, "<u8"),
        ref_table(refs),
        pack_table(packs),
    )


def encode_share(share: Share, layout: bytes) -> bytes:
    """The staging record of ``share`` (SPEC.md, section 3.4)."""
    record: dict[str, Any] = {"format": STAGING_FORMAT, "ok": share.error is None}
    if share.error is not None:
        record["error"] = share.error
    else:
        record["layout"] = layout
        record.update((key, getattr(share, key).tobytes()) for key in SHARE_FIELDS)
    return to_msgpack(record)


def decode_share(data: bytes, layout: bytes) -> Share:
    """A staging record's share, decoded without trusting it: Bad when it is malformed, or when
    its process saved another tree than ``layout`` says. What its arrays hold is checked with
    every process's at once (:func:`treestore._format.shares_merge.combine`)."""
    try:
        rec = from_msgpack(data, "it", None)
    except TreestoreError as exc:
        raise Bad(exc.message) from None
    if rec.get("format") != STAGING_FORMAT:
        raise Bad(
            f"its format is {rec.get('format')!r:.60}, expected {STAGING_FORMAT!r} "
            "(every process of a save must run the same treestore version)"
        )
    if not _get(rec, "ok", bool):
        return Share.failed(_get(rec, "error", str)[:2000])
    if _get(rec, "layout", bytes) != layout:
        raise Bad(
            "it saved another tree than process 0: every process must save the same tree "
            "(the same structure, and each sharded leaf with the same kind, dtype and shape)"
        )
    share = Share.of({key: binary_array(rec, key, dtype) for key, dtype in SHARE_FIELDS.items()})
    if len(share.piece_chunks) != len(share.piece_leaves):
        raise Bad(f"{len(share.piece_chunks)} piece chunk counts for {len(share.piece_leaves)} pieces")
    return share


__all__ = [
    "SHARE_FIELDS",
    "STAGING_FORMAT",
    "Share",
    "decode_share",
    "encode_share",
    "layout_digest",
    "pack_table",
    "ref_table",
    "share_from_entries",
]
