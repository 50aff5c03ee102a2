"""Reading a manifest stored in parts (SPEC.md, section 8.7): the parts a reader needs are
fetched at once, checked against their digests and decoded without trusting them, and merged
with the frame into the checkpoint's columns, which are checked as any manifest is.

A reader of every leaf reads every part. A reader of some leaves (``leaves``, a bool mask over
the frame's) reads only the parts whose leaf range meets one of them saved in pieces, and gets
columns in which the other sharded leaves wait for their parts (``Columns.unread``): each leaf
it reads is checked as in a whole manifest, and a frame that lists a part's range wrongly leaves
a gap in a leaf read, which is refused.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import MutableMapping, Sequence
from dataclasses import replace

import numpy as np

from treestore._format import paths as _paths
from treestore._format.encoding import Bad
from treestore._format.manifest.columns import Columns
from treestore._format.manifest.frame import Frame
from treestore._format.parts.merge import frame_leaves_of, gather, merge
from treestore._format.parts.part import PART_FIELDS, Part, decode_part
from treestore._kernels.digest import digest
from treestore._storage.base import Storage
from treestore.errors import InvalidInputError, ManifestDamagedError, OutOfMemoryError

READERS = 64  # parts read at once


def part_bytes(storage: Storage, found: bytes, size: int) -> bytes | str:
    """The bytes of the part of digest ``found`` and ``size`` bytes, checked against both, or (a
    str) why not; a failing storage raises StorageError."""
    data = storage.read_range(_paths.manifest_path(found), 0, size + 1)
    if data is None:
        return f"its part {found.hex()[:16]} is missing"
    if len(data) != size or digest(data) != found:
        return f"its part {found.hex()[:16]} does not match its digest ({len(data)} bytes, {size} expected)"
    return data


UNREAD_PART = Part.of({key: np.zeros(0, dtype) for key, dtype in PART_FIELDS.items()})  # a part left
Decoded = MutableMapping[int, "Part | str"]  # part index -> the part, decoded, or why it cannot be used


def read_parts(
    storage: Storage, frame: Frame, which: Sequence[int] | None = None, cache: Decoded | None = None
) -> list[Part | str]:
    """Each part of ``frame``, decoded, or (a str) why it cannot be used: those in ``which``
    (default: every part), the others :data:`UNREAD_PART`. ``cache`` keeps what was read, for the
    next call. A failing storage raises StorageError."""

    def read(k: int) -> Part | str:
        found, size = frame.parts[k].digest, frame.parts[k].size
        data = part_bytes(storage, found, size)
        if isinstance(data, str):
            return data
        try:
            return decode_part(data, frame.layout)
        except Bad as exc:
            return f"its part {found.hex()[:16]} is malformed: {exc}"

    cache = {} if cache is None else cache
    wanted = range(len(frame.parts)) if which is None else which
    missing = [k for k in wanted if k not in cache]
    if missing:
        with cf.ThreadPoolExecutor(min(READERS, len(missing))) as pool:
            cache.update(zip(missing, pool.map(read, missing), strict=True))
    chosen = set(wanted)
    return [cache[k] if k in chosen else UNREAD_PART for k in range(len(frame.parts))]


def named(problems: dict[int, str]) -> str:
    """What is wrong with each process's part, as one line naming them (the first 20)."""
    lines = [f"process {k}: {why}" for k, why in sorted(problems.items())]
    return "; ".join(lines[:20] + ([f"(and {len(lines) - 20} more)"] if len(lines) > 20 else []))


def complete(
    frame: Frame, decoded: Sequence[Part], leaves: np.ndarray | None = None
) -> tuple[Columns | None, dict[int, str]]:
    """The columns of ``frame`` with its decoded parts (part k being process k's;
    :data:`UNREAD_PART` for one a reader of ``leaves`` does not need): (the columns, {}) or (None,
    what is wrong with each process's part); InvalidInputError naming the leaf (and the
    processes) when the pieces do not make a readable manifest. With ``leaves`` (a bool mask),
    only their pieces are listed; the other sharded leaves wait."""
    head = frame.columns
    frame_leaves = frame_leaves_of(head)
    gathered, problems = gather(frame_leaves, decoded, frame.ranges, leaves)
    if gathered is None:
        return None, problems
    header = {
        "name": head.name,
        "created": head.created,
        "metadata": head.metadata,
        "codec": head.codec,
        "chunk_size": head.chunk_size,
    }
    columns = merge(frame_leaves, gathered, header, None if leaves is None else ~leaves)
    read = tuple(p.digest for p, got in zip(frame.parts, decoded, strict=True) if got is not UNREAD_PART)
    return replace(columns, parts=read, stats=head.stats, stats_note=head.stats_note), {}


def merged(
    storage: Storage, frame: Frame, leaves: np.ndarray | None = None, cache: Decoded | None = None
) -> tuple[Columns | None, dict[int, str]]:
    """``frame`` completed with the parts a reader of ``leaves`` (a bool mask; None: every
    leaf) needs, read from ``storage`` (or found in ``cache``): (the columns, {}) or (None, what
    is wrong with each process's part); InvalidInputError as :func:`complete` raises it."""
    which = None if leaves is None else frame.needed(leaves).tolist()
    decoded = read_parts(storage, frame, which, cache)
    problems = {k: found for k, found in enumerate(decoded) if isinstance(found, str)}
    if problems:
        return None, problems
    return complete(frame, [s for s in decoded if isinstance(s, Part)], leaves)


def assemble(
    storage: Storage, frame: Frame, leaves: np.ndarray | None = None, cache: Decoded | None = None
) -> Columns:
    """The checkpoint's columns: ``frame`` completed with its parts (those a reader of
    ``leaves`` needs, as :func:`merged` reads them). ManifestDamagedError naming the
    checkpoint, and each process whose part is missing, damaged or malformed."""
    name = frame.name
    try:
        columns, problems = merged(storage, frame, leaves, cache)
    except MemoryError:
        raise OutOfMemoryError(
            f"manifest of checkpoint {name!r}: out of memory merging its parts", checkpoint=name
        ) from None
    except InvalidInputError as exc:
        raise ManifestDamagedError(
            f"manifest of checkpoint {name!r} is stored in parts that do not make a readable "
            f"manifest: {exc.message}",
            checkpoint=name,
            address=exc.address,
        ) from None
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:  # a check missed
        raise ManifestDamagedError(
            f"manifest of checkpoint {name!r}: unexpected malformation of its parts "
            f"({type(exc).__name__}: {exc})",
            checkpoint=name,
        ) from exc
    if columns is None:
        raise ManifestDamagedError(
            f"manifest of checkpoint {name!r} is stored in parts, and some cannot be read: {named(problems)}",
            checkpoint=name,
        )
    return columns


__all__ = [
    "READERS",
    "UNREAD_PART",
    "Decoded",
    "assemble",
    "complete",
    "merged",
    "named",
    "part_bytes",
    "read_parts",
]
