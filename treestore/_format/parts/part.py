"""Each process's part of a multi-process save's manifest, in columns, and the
summary it sends the primary.

A process of a multi-process save writes the pieces it owns, and its packs, as a part (SPEC.md,
section 8.5): a record in the version-2 manifest's conventions (section 6), stored as a
manifest-like object named by its digest. It tells the primary, through the job's runtime, only a
:class:`Summary`: the part's digest and size, a few counts and the fingerprint of how its pieces
cover their leaves (:mod:`treestore._format.parts.coverage`), so the primary's commit never reads the
parts. Readers decode each part without trusting it (:func:`decode_part`) and merge them
(:mod:`treestore._format.parts.merge`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._format.encoding import Bad, from_msgpack, to_msgpack
from treestore._format.encoding import field as _get
from treestore._format.limits import MAX_PART_BYTES
from treestore._format.manifest.codec import binary_array
from treestore._format.manifest.columns import CHUNK_DTYPE, IN_PIECES, PACK_DTYPE, concat_ranges, prefix_sums
from treestore._format.parts.coverage import Coverage, P, from_text, to_text
from treestore._kernels.digest import digest
from treestore.errors import TreestoreError

PART_FORMAT = "treestore.part"
PART_FIELDS: dict[str, np.dtype[Any]] = {
    "piece_leaves": np.dtype("<u4"),  # the leaf index of each piece
    "piece_chunks": np.dtype("<u4"),  # chunk refs of each piece
    "piece_start": np.dtype("<u8"),  # each piece's start, the leaf's ndim entries per piece
    "piece_shape": np.dtype("<u8"),  # each piece's shape
    "chunks": CHUNK_DTYPE,  # every piece's chunk refs, piece after piece; packs index `packs`
    "packs": PACK_DTYPE,  # this process's packs
}


def layout_digest(tree: object, sharded: Iterable[tuple[str, str | None, tuple[int, ...]] | None]) -> bytes:
    """What every process of a save must agree on: the tree's node record, and the kind, dtype
    and shape of each sharded leaf (None for the others)."""
    return digest(to_msgpack([tree, [None if s is None else [s[0], s[1], list(s[2])] for s in sharded]]))


@dataclass(frozen=True, eq=False)
class Part:
    """One process's pieces and packs (PART_FIELDS); the pack indices of its chunk refs index
    its own packs."""

    piece_leaves: np.ndarray
    piece_chunks: np.ndarray
    piece_start: np.ndarray
    piece_shape: np.ndarray
    chunks: np.ndarray
    packs: np.ndarray

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray]) -> Part:
        """A part from the arrays of PART_FIELDS, by name."""
        return cls(*(arrays[key] for key in PART_FIELDS))


@dataclass(frozen=True)
class Summary:
    """What a process tells the primary of its part (SPEC.md, section 8.2): its part (digest
    and size; no part when the save has no sharded leaf), its numbers of pieces and packs, the
    most pieces it holds of one leaf, the coverage fingerprint of its pieces, and the leaf
    indices ``[first, end)`` its pieces lie in (0, 0 without pieces)."""

    layout: bytes
    part: bytes | None
    size: int
    pieces: int
    packs: int
    most: int
    cover: int
    first: int = 0
    end: int = 0


def part_from_fields(
    fields: Mapping[str, Any], index: np.ndarray, coverage: Coverage | None = None
) -> tuple[Part, int]:
    """This process's part — the pieces of the leaves it wrote and the packs they use,
    renumbered — and the coverage fingerprint of its pieces (0 without ``coverage``).
    ``fields``: the manifest arrays of what it wrote (``leaves``, ``shapes``, the piece columns,
    ``chunks``, ``packs``), a leaf written in one piece kept as a piece; ``index``: each row's
    leaf index in the tree. The fingerprint is a Python sum over the pieces this process owns,
    as its save was."""
    rows = fields["leaves"]
    count = rows["chunks"].astype(np.int64)
    ndim = rows["ndim"].astype(np.int64)
    in_pieces = np.flatnonzero(rows["flags"] & IN_PIECES)
    per_leaf = fields["piece_counts"].astype(np.int64)
    owner = np.repeat(in_pieces, per_leaf)  # each piece's row
    refs = fields["chunks"][concat_ranges(prefix_sums(count)[in_pieces], count[in_pieces])]
    inside = refs["pack"] >= 0
    used = np.unique(refs["pack"][inside])
    packs = fields["packs"]
    if not np.array_equal(used, np.arange(len(packs))):  # keep only the packs the pieces use
        refs["pack"][inside] = np.searchsorted(used, refs["pack"][inside])
        packs = packs[used]
    starts, shapes = fields["piece_start"], fields["piece_shape"]
    leaves = np.asarray(index, np.int64)[owner]
    cover = 0
    if coverage is not None:
        dims = ndim[owner]
        at = prefix_sums(dims)
        for i, a, b in zip(leaves.tolist(), at[:-1].tolist(), at[1:].tolist(), strict=True):
            cover += coverage.box(i, starts[a:b].tolist(), shapes[a:b].tolist())
        # A piece outside its leaf (even with no elements) adds one: the sums cannot agree.
        bounds = fields["shapes"][concat_ranges(prefix_sums(ndim)[owner], dims)]
        piece = np.repeat(np.arange(len(owner)), dims)
        beyond = np.bincount(piece, starts + shapes > bounds, len(owner))
        cover += int(np.count_nonzero(beyond))
    part = Part(
        leaves.astype("<u4"),
        fields["piece_chunks"].astype("<u4"),
        starts.astype("<u8"),
        shapes.astype("<u8"),
        refs,
        packs,
    )
    return part, cover % P


def most_pieces(part: Part) -> int:
    """The most pieces the part holds of one leaf."""
    if not len(part.piece_leaves):
        return 0
    return int(np.unique(part.piece_leaves, return_counts=True)[1].max())


def leaf_range(part: Part) -> tuple[int, int]:
    """The leaf indices ``[first, end)`` the part's pieces lie in; (0, 0) without pieces."""
    if not len(part.piece_leaves):
        return 0, 0
    return int(part.piece_leaves.min()), int(part.piece_leaves.max()) + 1


def encode_part(part: Part, layout: bytes) -> bytes:
    """The part record of ``part`` (SPEC.md, section 8.5)."""
    record: dict[str, Any] = {"format": PART_FORMAT, "layout": layout}
    record.update((key, getattr(part, key).tobytes()) for key in PART_FIELDS)
    return to_msgpack(record)


def decode_part(data: bytes, layout: bytes) -> Part:
    """A part, decoded without trusting it: Bad when it is malformed, or when its
    process saved another tree than ``layout`` says. What its arrays hold is checked with every
    part's at once (:func:`treestore._format.parts.merge.combine`)."""
    try:
        rec = from_msgpack(data, "it", None)
    except TreestoreError as exc:
        raise Bad(exc.message) from None
    if rec.get("format") != PART_FORMAT:
        raise Bad(f"its format is {rec.get('format')!r:.60}, expected {PART_FORMAT!r}")
    if _get(rec, "layout", bytes) != layout:
        raise Bad("it holds pieces of another tree than the manifest's (its layout differs)")
    part = Part.of({key: binary_array(rec, key, dtype) for key, dtype in PART_FIELDS.items()})
    if len(part.piece_chunks) != len(part.piece_leaves):
        raise Bad(f"{len(part.piece_chunks)} piece chunk counts for {len(part.piece_leaves)} pieces")
    return part


def encode_summary(summary: Summary | str) -> str:
    """The text a process sends the primary: its summary, or (a str) the error that stopped it."""
    if isinstance(summary, str):
        return json.dumps({"ok": False, "error": summary[:2000]})
    s = summary
    return json.dumps(
        {
            "ok": True,
            "layout": s.layout.hex(),
            "part": None if s.part is None else s.part.hex(),
            "size": s.size,
            "pieces": s.pieces,
            "packs": s.packs,
            "most": s.most,
            "cover": to_text(s.cover),
            "leaves": [s.first, s.end],
        }
    )


_COUNTS = ("size", "pieces", "packs", "most")


def decode_summary(text: str, layout: bytes) -> Summary | str:
    """A summary as :func:`encode_summary` wrote it, or (a str) what is wrong: the process's
    error, another tree, or malformed text."""
    try:
        rec = json.loads(text)
    except (ValueError, RecursionError):  # nested too deep: no summary a process writes
        return "its summary is not valid JSON"
    if not isinstance(rec, dict) or type(rec.get("ok")) is not bool:
        return "its summary is malformed"
    if not rec["ok"]:
        return str(rec.get("error"))[:2000]
    try:
        found = bytes.fromhex(rec["layout"])
        part = None if rec["part"] is None else bytes.fromhex(rec["part"])
        counts = [rec[key] for key in _COUNTS]
        cover = from_text(rec["cover"])
        first, end = rec["leaves"]
    except (KeyError, TypeError, ValueError):
        return "its summary is malformed"
    if any(type(n) is not int or not 0 <= n < 2**63 for n in [*counts, first, end]) or cover is None:
        return "its summary is malformed"
    if (part is not None and len(part) != 32) or counts[0] > MAX_PART_BYTES:
        return "its summary is malformed"
    if not (first < end if counts[1] else first == end == 0):  # pieces lie in [first, end)
        return "its summary is malformed"
    if found != layout:
        return (
            "it saved another tree than the primary: every process must save the same tree "
            "(the same structure, and each sharded leaf with the same kind, dtype and shape)"
        )
    size, pieces, packs, most = counts
    return Summary(found, part, size, pieces, packs, most, cover, first, end)


__all__ = [
    "PART_FIELDS",
    "PART_FORMAT",
    "Part",
    "Summary",
    "decode_part",
    "decode_summary",
    "encode_part",
    "encode_summary",
    "layout_digest",
    "leaf_range",
    "most_pieces",
    "part_from_fields",
]
