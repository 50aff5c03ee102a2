"""A scan of a store's chunk objects, as copy and verify make it: each object visited once, on a
pool of threads (each holding one object's bytes at a time, so memory stays bounded), progress
counted in raw bytes; and the check of a pack's members, each against its own digest."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from treestore._engine.objects import ChunkObject
from treestore._engine.reading.read import pack_member
from treestore._engine.threads import run_all
from treestore._format.manifest.records import ChunkRef

Slice = tuple[bytes, int, int]  # a member's digest, offset and size in its pack


class _OfChunk(Protocol):
    @property
    def ref(self) -> ChunkRef: ...


T = TypeVar("T", bound=_OfChunk)


def scan(
    items: Sequence[T],
    visit: Callable[[T], None],
    threads: int,
    role: str,
    advance: Callable[[int], None] | None = None,
) -> None:
    """``visit`` every item (a chunk object, or a job naming one by its ``ref``) on up to
    ``threads`` threads of the ``role`` pool, each visit then advancing a progress
    :func:`~treestore._engine.progress.counter` by the raw size of the item's chunk. The first
    error propagates once the running visits end; items not yet taken are skipped."""

    def job(item: T) -> None:
        visit(item)
        if advance is not None:
            advance(item.ref.raw_size)

    run_all([functools.partial(job, item) for item in items], threads, role)


def bad_members(
    raw: np.ndarray[Any, Any], obj: ChunkObject, checked: dict[Slice, bool] | None = None
) -> dict[Slice, list[int]]:
    """The members of pack ``obj`` (decoded: ``raw``) whose bytes do not match their digests,
    each with the rows of ``obj``'s leaves that reference it; ``checked`` keeps each slice's
    verdict, so that a pack several checkpoints share is checked once."""
    checked = {} if checked is None else checked
    bad: dict[Slice, list[int]] = {}
    for d, offset, size, row in obj.members():
        sound = checked.get((d, offset, size))
        if sound is None:
            sound = checked[d, offset, size] = pack_member(raw, offset, size, d) is not None
        if not sound:
            bad.setdefault((d, offset, size), []).append(row)
    return bad
