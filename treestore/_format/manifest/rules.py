"""The rules every manifest codec and writer shares, whatever the format version: a checkpoint
name, user metadata, an array's shape, pieces that tile a leaf, a leaf's digest (SPEC.md §6.7),
the size bound in each direction, and how a commit record must agree with its manifest.

The decoders (:mod:`treestore._format.manifest.codec`, and :mod:`treestore._format.manifest.v1` for
version 1) check every field's type, every size against its bound and against the other
fields, before any other code sees it: a store can make them raise ManifestDamagedError or
UnsupportedFormatError, nothing else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, cast

import msgpack
import numpy as np

from treestore._format.commit_record import CommitRecord
from treestore._format.dtypes import (
    ARRAY_KINDS,
    value_to_record,
)
from treestore._format.encoding import Bad as _Bad
from treestore._format.encoding import from_msgpack, to_msgpack
from treestore._format.limits import (
    LEAF_BYTES_END,
    MAX_DIM,
    MAX_GRID_CELLS,
    MAX_MANIFEST_BYTES,
    MAX_METADATA_BYTES,
    MAX_NDIM,
)
from treestore._kernels.digest import digest
from treestore.errors import InvalidInputError, ManifestDamagedError

MANIFEST_MAGIC = "treestore.manifest"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+-]{0,199}\Z")


def check_name(name: object) -> str:
    """A checkpoint name: 1–200 characters of ``A-Z a-z 0-9 . _ = + -``, starting alphanumeric."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidInputError(
            f"checkpoint name {name!r} is not valid: use 1-200 characters of letters, digits and "
            "'._=+-', starting with a letter or digit"
        )
    return name


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
    version (:meth:`Columns.same_leaves` applies it column by column, without hashing;
    ``tests/format/test_columns.py`` keeps the two equal): an array leaf's by its dtype, shape, PRNG
    implementation and chunk digests (piece by piece, with each piece's box, for a leaf saved in
    pieces); a Python scalar's by its kind and value as stored. ``chunks``: the chunk digests;
    ``pieces``: (start, shape, chunk digests) of each piece, or None for a leaf saved whole."""
    record: list[object]
    if kind not in ARRAY_KINDS:
        record = [kind, value_to_record(kind, value)]
    elif pieces:
        boxes = [[list(start), list(box), list(digests)] for start, box, digests in pieces]
        record = [dtype, list(shape or ()), prng_impl, boxes]
    else:
        record = [dtype, list(shape or ()), prng_impl, list(chunks)]
    return digest(to_msgpack(record))


def record_mismatches(
    record: CommitRecord, name: str, created: float, metadata: Any, leaves: int, nbytes: int
) -> list[str]:
    """How a commit record disagrees with the manifest of these fields (empty when it describes
    it); every manifest form (version 1 or 2, decoded or columnar) is checked by this."""
    pairs = {
        "name": (record.name, name),
        "created": (record.created, created),
        "metadata": (record.metadata, metadata),
        "leaves": (record.leaves, leaves),
        "nbytes": (record.nbytes, nbytes),
    }
    # Metadata is compared as encoded: NaN != NaN, and 1 == 1.0 == True, as Python values.
    # A time is compared as the float a manifest decodes it to (a record keeps an integer
    # exactly; 2**64 - 1 != float(2**64 - 1)), NaN equal to NaN.
    same = {
        "metadata": to_msgpack(record.metadata) == to_msgpack(metadata),
        "created": _same_time(record.created, created),
    }
    return [
        f"{k}: record {a!r:.60}, manifest {b!r:.60}" for k, (a, b) in pairs.items() if not same.get(k, a == b)
    ]


def _same_time(a: float, b: float) -> bool:
    """Whether two ``created`` times are the same float (NaN is the same as NaN)."""
    x, y = float(a), float(b)
    return x == y or (math.isnan(x) and math.isnan(y))


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


def header_record(c: Any, version: int) -> dict[str, Any]:
    """The fields every version of a manifest starts with (SPEC.md §6.1, A.1), of a manifest
    ``c`` (its ``name``, ``created``, ``metadata``, ``codec`` and ``chunk_size``)."""
    return {
        "format": MANIFEST_MAGIC,
        "version": version,
        "name": c.name,
        "created": c.created,
        "metadata": c.metadata,
        "codec": c.codec,
        "chunk_size": c.chunk_size,
    }


def within_size(data: bytes, name: str, advice: str = "save fewer leaves") -> bytes:
    """``data``, the encoded manifest of checkpoint ``name``, once it is within the
    MAX_MANIFEST_BYTES readers accept: InvalidInputError otherwise (a save then fails before it
    writes the manifest). Both manifest encoders (``encode_columns``, ``encode_v1``) end with it."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidInputError(
            f"the manifest of checkpoint {name!r} would be {len(data)} bytes, over the "
            f"{MAX_MANIFEST_BYTES // 2**20} MiB readers accept: {advice} per checkpoint",
            checkpoint=name,
        )
    return data


def manifest_record(data: bytes, checkpoint: str) -> dict[str, Any]:
    """The msgpack map of a manifest's bytes, once they are within MAX_MANIFEST_BYTES: the one
    front door of every manifest decoder (ManifestDamagedError otherwise)."""
    what = f"manifest of checkpoint {checkpoint!r}"
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestDamagedError(f"{what} is over its size limit", checkpoint=checkpoint)
    return from_msgpack(data, what, checkpoint)


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
