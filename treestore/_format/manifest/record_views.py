"""A manifest as public read-only records, made from its columns on demand.

:class:`Manifest` is what ``Store.manifest()`` and ``Checkpoint.manifest`` return: a view of the
one in-memory model (:class:`~treestore._format.manifest.columns.Columns`). Its header fields are the
columns'; its tree record, packs and leaf entries are made when first asked for, and a leaf's
:class:`~treestore._format.manifest.records.LeafEntry` only when that leaf is asked for — looking at one
leaf of a manifest of a million makes one record.

:class:`Stored` is the internal view of one leaf that loads and exports use: what the leaf is,
without its chunk refs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from treestore._format.commit_record import CommitRecord
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
from treestore._format.manifest.records import ChunkRef, LeafEntry, Piece
from treestore.errors import OutOfMemoryError


class Manifest:
    """A checkpoint's manifest (SPEC.md §6), read-only.

    ``name``, ``created``, ``metadata``, ``codec``, ``chunk_size`` and ``version`` (of the bytes
    it was decoded from) are the stored fields; ``tree`` is the node record of the tree
    (SPEC.md, appendix A.3); ``leaves`` the leaf entries in the tree's flattening order, each
    made on first use; ``packs`` the pack chunks. ``columns`` is the model it views.

    Attributes:
        name: The checkpoint's name.
        created: When the checkpoint was saved, in seconds since the Unix epoch.
        metadata: The metadata the save was given (any msgpack value); None when it was given
            none.
        codec: The compression settings the writer asked for, a dict with the keys ``name``,
            ``level`` and ``byte_planes`` (informational: each chunk's header says how it is
            encoded); a copy.
        chunk_size: The writer's chunk size in bytes (informational).
        version: The format version of the manifest's bytes (1 or 2).
        tree: The node record of the tree (SPEC.md, appendix A.3): nested dicts whose
            ``"leaf"`` entries are indices into ``leaves``.
        leaves: The :class:`~treestore.types.LeafEntry` of each leaf, in the tree's flattening
            order: a sequence that makes an entry when it is first asked for.
        packs: The pack chunks, the chunk refs that a pack member's ``pack`` indexes.
        nbytes: Raw bytes of all array leaves (Python scalars count 0).
        columns: The in-memory model of the manifest that this object views.

    Args:
        columns: The decoded manifest to view, with every leaf's pieces read (a manifest stored
            in parts, read for some leaves only, is refused with RuntimeError).

    Examples:
        >>> import numpy as np, treestore
        >>> _ = treestore.save("memory://doc/view", {"w": np.zeros(3), "step": 7}, "a")
        >>> m = treestore.Store("memory://doc/view").manifest("a")
        >>> len(m.leaves), m.leaves[0].address, m.leaves[0].value
        (2, 'step', 7)
    """

    def __init__(self, columns: Columns) -> None:
        columns.require_pieces()  # the columns of some leaves of a manifest are not a manifest
        self.columns = columns

    def __repr__(self) -> str:
        return f"Manifest(name={self.name!r}, leaves={len(self.columns)}, version={self.version})"

    @property
    def name(self) -> str:
        return self.columns.name

    @property
    def created(self) -> float:
        return self.columns.created

    @property
    def metadata(self) -> Any:
        return self.columns.metadata

    @property
    def codec(self) -> dict[str, Any]:
        return dict(self.columns.codec)

    @property
    def chunk_size(self) -> int:
        return self.columns.chunk_size

    @property
    def version(self) -> int:
        return self.columns.version

    @functools.cached_property
    def tree(self) -> dict[str, Any]:
        with _named(self.columns):
            return self.columns.tree_record()

    @functools.cached_property
    def leaves(self) -> LeafEntries:
        return LeafEntries(self.columns)

    @functools.cached_property
    def packs(self) -> tuple[ChunkRef, ...]:
        with _named(self.columns):
            return self.columns.pack_refs()

    @property
    def nbytes(self) -> int:
        """Raw bytes of every leaf."""
        return self.columns.nbytes

    def mismatches(self, record: CommitRecord) -> list[str]:
        """How a commit record disagrees with this manifest (empty when it describes it).

        Args:
            record: The commit record that names this manifest (``checkpoints/<name>``).

        Returns:
            One line for each of ``name``, ``created``, ``metadata``, ``leaves`` and ``nbytes``
            on which the two differ, such as ``"leaves: record 3, manifest 2"`` (values cut to
            60 characters); empty when they agree. Metadata is compared as encoded, and times as
            floats, NaN equal to NaN.
        """
        return self.columns.mismatches(record)

    def chunk_digests(self) -> set[bytes]:
        """Every chunk object this checkpoint needs.

        Returns:
            The 32-byte digests, which name the chunk objects, of the chunk refs outside packs
            and of the packs (a pack member's own digest names no object and is left out).
        """
        return self.columns.chunk_digests()


@dataclass(frozen=True)
class Stored:
    """Stored leaf ``index`` of a manifest's columns: its kind, dtype name, shape and raw size,
    or its value; no chunk refs. Made only for the leaves an operation looks at (those a
    ``like=`` load matches, those an export writes)."""

    address: str
    index: int
    kind: str
    dtype: str | None
    shape: tuple[int, ...] | None
    value: Any
    prng_impl: str | None
    weak_type: bool
    nbytes: int  # raw bytes (0 for a scalar leaf)

    @property
    def is_array(self) -> bool:
        return self.shape is not None


def stored(columns: Columns, i: int) -> Stored:
    """Leaf ``i`` of ``columns`` as :class:`Stored`."""
    return stored_rows(columns, [i])[0]


def stored_rows(columns: Columns, rows: Sequence[int]) -> list[Stored]:
    """:func:`stored` of each leaf of ``rows``, the columns read once for all of them (a
    ``like=`` load of 100k leaves asked numpy for each field of each leaf)."""
    at = np.asarray(rows, np.int64)
    table = columns.leaves[at]
    kinds, dtypes, flags = table["kind"].tolist(), table["dtype"].tolist(), table["flags"].tolist()
    nbytes = columns.leaf_nbytes[at].tolist()
    if len(rows) > 1:  # every address built at once, the shapes read as lists
        addresses = columns.addresses
        starts, shapes = columns.shape_start.tolist(), columns.shapes.tolist()
        where = [addresses[i] for i in rows]
        dims = [tuple(shapes[starts[i] : starts[i + 1]]) for i in rows]
    else:  # a leaf's address walked up to, without building every address
        where = [columns.address(i) for i in rows]
        dims = [columns.shape(i) for i in rows]
    out = []
    for i, address, shape, kind, dtype, flag, size in zip(
        rows, where, dims, kinds, dtypes, flags, nbytes, strict=True
    ):
        if kind >= ARRAY_CODES:
            out.append(Stored(address, i, KINDS[kind], None, None, columns.value(i), None, False, 0))
            continue
        prng_impl, weak = PRNG_NAMES[flag >> PRNG_SHIFT], bool(flag & WEAK_TYPE)
        out.append(Stored(address, i, KINDS[kind], DTYPE_NAMES[dtype], shape, None, prng_impl, weak, size))
    return out


class LeafEntries(Sequence[LeafEntry]):
    """The leaf entries of a :class:`Columns`, each made on first use and kept."""

    def __init__(self, columns: Columns) -> None:
        self._columns = columns
        self._made: dict[int, LeafEntry] = {}

    def __len__(self) -> int:
        return len(self._columns)

    @overload
    def __getitem__(self, i: int) -> LeafEntry: ...
    @overload
    def __getitem__(self, i: slice) -> list[LeafEntry]: ...
    def __getitem__(self, i: int | slice) -> LeafEntry | list[LeafEntry]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"leaf {i} of {n}")
        i %= n
        entry = self._made.get(i)
        if entry is None:
            with _named(self._columns):
                entry = self._made[i] = leaf_entry(self._columns, i)
        return entry

    def __iter__(self) -> Iterator[LeafEntry]:
        return (self[i] for i in range(len(self)))


@contextmanager
def _named(c: Columns) -> Iterator[None]:
    """Running out of memory while making records names the checkpoint."""
    try:
        yield
    except MemoryError:
        raise OutOfMemoryError(
            f"out of memory making the records of the manifest of checkpoint {c.name!r}", checkpoint=c.name
        ) from None


def leaf_entry(c: Columns, i: int) -> LeafEntry:
    """Leaf ``i`` of ``c`` as a :class:`LeafEntry`."""
    row = c.leaves[i]
    kind = KINDS[row["kind"]]
    address = c.address(i)
    if row["kind"] >= ARRAY_CODES:
        return LeafEntry(address, kind, value=c.value(i))
    c.require_pieces(i)
    flags = int(row["flags"])
    lo = int(c.chunk_start[i])
    chunks = _refs(c, lo, int(c.chunk_start[i + 1]))
    pieces: tuple[Piece, ...] = ()
    if flags & IN_PIECES:
        starts, shapes, first, count = c.piece_rows(i)
        pieces = tuple(
            Piece(tuple(start), tuple(box), chunks[f - lo : f - lo + n])
            for start, box, f, n in zip(
                starts.tolist(), shapes.tolist(), first.tolist(), count.tolist(), strict=True
            )
        )
    return LeafEntry(
        address,
        kind,
        DTYPE_NAMES[row["dtype"]],
        c.shape(i),
        chunks,
        PRNG_NAMES[flags >> PRNG_SHIFT],
        pieces=pieces,
        weak_type=bool(flags & WEAK_TYPE),
    )


def _refs(c: Columns, start: int, end: int) -> tuple[ChunkRef, ...]:
    rows = c.chunks[start:end]
    digests = rows["digest"].tobytes()
    out = []
    for j, (raw, stored, pack, offset) in enumerate(
        zip(*(rows[f].tolist() for f in ("raw", "stored", "pack", "offset")), strict=True)
    ):
        d = digests[32 * j : 32 * j + 32]
        out.append(ChunkRef(d, raw, stored) if pack < 0 else ChunkRef(d, raw, stored, pack, offset))
    return tuple(out)


__all__ = ["LeafEntries", "Manifest", "Stored", "leaf_entry", "stored"]
