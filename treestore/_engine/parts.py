"""Reading a manifest stored in parts (SPEC.md, section 5.8): every part is fetched at once,
checked against its digest and decoded without trusting it, and merged with the frame into the
checkpoint's columns, which are checked as any manifest is. A reader needs every part of the
checkpoint, whichever leaves it reads: each process's part holds its pieces of every leaf.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Sequence
from dataclasses import replace

from treestore._format import layout as _layout
from treestore._format.columns import Columns
from treestore._format.encoding import Bad, digest
from treestore._format.parted import Parted
from treestore._format.shares import Share, decode_part
from treestore._format.shares_merge import combine, merge, plan_from_frame
from treestore._storage.base import Storage
from treestore.errors import InvalidInputError, ManifestCorruptError, OutOfMemoryError

READERS = 64  # parts read at once


def part_bytes(storage: Storage, found: bytes, size: int) -> bytes | str:
    """The bytes of the part of digest ``found`` and ``size`` bytes, checked against both, or (a
    str) why not; a failing storage raises StorageError."""
    data = storage.read_range(_layout.manifest_path(found), 0, size + 1)
    if data is None:
        return f"its part {found.hex()[:16]} is missing"
    if len(data) != size or digest(data) != found:
        return f"its part {found.hex()[:16]} does not match its digest ({len(data)} bytes, {size} expected)"
    return data


def read_parts(storage: Storage, parted: Parted) -> list[Share | str]:
    """Each part of ``parted``, decoded, or (a str) why it cannot be used; a failing storage
    raises StorageError."""

    def read(k: int) -> Share | str:
        found, size = parted.parts[k]
        data = part_bytes(storage, found, size)
        if isinstance(data, str):
            return data
        try:
            return decode_part(data, parted.layout)
        except Bad as exc:
            return f"its part {found.hex()[:16]} is malformed: {exc}"

    if not parted.parts:
        return []
    with cf.ThreadPoolExecutor(min(READERS, len(parted.parts))) as pool:
        return list(pool.map(read, range(len(parted.parts))))


def named(problems: dict[int, str]) -> str:
    """What is wrong with each process's share, as one line naming them (the first 20)."""
    lines = [f"process {k}: {why}" for k, why in sorted(problems.items())]
    return "; ".join(lines[:20] + ([f"(and {len(lines) - 20} more)"] if len(lines) > 20 else []))


def complete(parted: Parted, shares: Sequence[Share]) -> tuple[Columns | None, dict[int, str]]:
    """The columns of ``parted`` with its decoded parts (part k being process k's): (the columns,
    {}) or (None, what is wrong with each process's part); InvalidInputError naming the leaf
    (and the processes) when the pieces do not make a readable manifest."""
    frame = parted.frame
    plan = plan_from_frame(frame)
    combined, problems = combine(plan, shares)
    if combined is None:
        return None, problems
    header = {
        "name": frame.name,
        "created": frame.created,
        "metadata": frame.metadata,
        "codec": frame.codec,
        "chunk_size": frame.chunk_size,
    }
    columns = merge(plan, combined, header)
    return replace(columns, parts=tuple(d for d, _ in parted.parts)), {}


def merged(storage: Storage, parted: Parted) -> tuple[Columns | None, dict[int, str]]:
    """``parted`` completed with its parts, read from ``storage``: (the columns, {}) or (None,
    what is wrong with each process's part); InvalidInputError as :func:`complete` raises it."""
    shares = read_parts(storage, parted)
    problems = {k: found for k, found in enumerate(shares) if isinstance(found, str)}
    if problems:
        return None, problems
    return complete(parted, [s for s in shares if isinstance(s, Share)])


def assemble(storage: Storage, parted: Parted) -> Columns:
    """The checkpoint's columns: ``parted`` completed with its parts. ManifestCorruptError
    naming the checkpoint, and each process whose part is missing, damaged or malformed."""
    name = parted.name
    try:
        columns, problems = merged(storage, parted)
    except MemoryError:
        raise OutOfMemoryError(
            f"manifest of checkpoint {name!r}: out of memory merging its parts", checkpoint=name
        ) from None
    except InvalidInputError as exc:
        raise ManifestCorruptError(
            f"manifest of checkpoint {name!r} is stored in parts that do not make a readable "
            f"manifest: {exc.message}",
            checkpoint=name,
            address=exc.address,
        ) from None
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as exc:  # a check missed
        raise ManifestCorruptError(
            f"manifest of checkpoint {name!r}: unexpected malformation of its parts "
            f"({type(exc).__name__}: {exc})",
            checkpoint=name,
        ) from exc
    if columns is None:
        raise ManifestCorruptError(
            f"manifest of checkpoint {name!r} is stored in parts, and some cannot be read: {named(problems)}",
            checkpoint=name,
        )
    return columns


__all__ = ["READERS", "assemble", "complete", "merged", "named", "part_bytes", "read_parts"]
