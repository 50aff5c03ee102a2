"""Lazy, read-only views of a checkpoint: leaf handles that read only the chunks a slice needs."""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Iterator
from glob import escape as glob_escape
from typing import Any

import numpy as np

from treestore._api.health import ValueStats, health, leaf_stats, nonfinite_leaves
from treestore._engine import memory as _memory
from treestore._engine import parts as _parts
from treestore._engine import read as _read
from treestore._engine import region as _region
from treestore._format import select as _select
from treestore._format.codecs import stored_codec
from treestore._format.columns import ARRAY_CODES, DTYPE_NAMES, Columns
from treestore._format.dtypes import dtype_from_name
from treestore._format.parted import Parted
from treestore._format.records import LeafEntry
from treestore._format.views import Manifest, leaf_entry
from treestore._storage.base import Storage
from treestore._tree.leaves import restore_array
from treestore._tree.structure import rebuild
from treestore.errors import InvalidInputError, OutOfBoundsError

Index = Any


class LazyLeaf:
    """One array leaf of a checkpoint, read on demand.

    Basic numpy indexing (ints, slices, ``...``) reads and decodes only the chunks that hold the
    rows the index touches along the first axis; ``np.asarray(leaf)`` reads it all.

    A :class:`Checkpoint` makes its leaves (``ckpt[address]``, ``ckpt.leaves``, ``ckpt.tree``);
    the constructor's arguments are the checkpoint's own internal objects.

    Args:
        reader: The checkpoint's chunk reader, kept as ``reader``.
        columns: The checkpoint's decoded manifest, which holds the leaf.
        i: The leaf's index in the manifest (the tree's flattening order).

    Attributes:
        address: The leaf's address.
        shape: Its shape.
        dtype: Its numpy dtype.

    Raises:
        OutOfBoundsError: An index out of bounds.
        InvalidInputError: Advanced indexing (arrays, masks), which does not read lazily.

    Examples:
        >>> import numpy as np, treestore
        >>> _ = treestore.save("memory://doc/lazy", {"emb": np.arange(8.0).reshape(4, 2)}, "c")
        >>> leaf = treestore.open("memory://doc/lazy")["emb"]
        >>> leaf.shape, leaf.dtype, leaf[-1]
        ((4, 2), dtype('float64'), array([6., 7.]))
    """

    def __init__(self, reader: _read.ChunkReader, columns: Columns, i: int) -> None:
        self.reader = reader
        self._columns = columns
        self._i = i
        self.address = columns.address(i)
        self.shape: tuple[int, ...] = columns.shape(i)
        self.dtype = dtype_from_name(DTYPE_NAMES[columns.leaves["dtype"][i]], address=self.address)
        self.kind, self._prng_impl, self._weak_type = columns.restore_kind(i)

    @functools.cached_property
    def entry(self) -> LeafEntry:
        """The leaf's manifest entry (made on first use)."""
        return leaf_entry(self._columns, self._i)

    @functools.cached_property
    def _pieces(self) -> _region.LeafPieces:
        return _region.leaf_pieces(self._columns, self._i)

    def _chunk_rows(self) -> np.ndarray[Any, Any]:
        return self._columns.chunks[
            self._columns.chunk_start[self._i] : self._columns.chunk_start[self._i + 1]
        ]

    def __repr__(self) -> str:
        return f"LazyLeaf({self.address!r}, shape={self.shape}, dtype={self.dtype.name})"

    @property
    def ndim(self) -> int:
        """Its number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Its number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Its raw bytes (before compression)."""
        return int(self._columns.leaf_nbytes[self._i])

    @property
    def stored_bytes(self) -> int:
        """Bytes of this leaf's own chunk objects (0 for leaves packed with others)."""
        rows = self._chunk_rows()
        return int(rows["stored"][rows["pack"] < 0].sum())

    @property
    def chunks(self) -> int:
        """How many chunk refs it has (one for a leaf packed with others)."""
        return len(self._chunk_rows())

    @property
    def packed(self) -> bool:
        """Whether this leaf is stored inside a pack with other small leaves."""
        return bool(np.any(self._chunk_rows()["pack"] >= 0))

    @property
    def codec(self) -> str:
        """How its chunks are stored: "raw", "zstd", "zstd+planes" (with "/raw" when some did
        not compress), or "-" for a packed or empty leaf."""
        if self.packed:
            return "-"
        rows = self._chunk_rows()
        sizes = list(zip(rows["raw"].tolist(), rows["stored"].tolist(), strict=True))
        return stored_codec(sizes, self.dtype, self.reader.codec)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d leaf")
        return self.shape[0]

    def read(self) -> Any:
        """Read the whole leaf, as the type it was saved as.

        Returns:
            A numpy array (or numpy scalar), a jax array, or a jax PRNG key array, as saved.

        Raises:
            CorruptionError: A chunk of the leaf is missing or does not match its digest.
        """
        return restore_array(self.kind, self.region(), self._prng_impl, weak_type=self._weak_type)

    def region(self, region: Any = ()) -> np.ndarray[Any, Any]:
        """The elements in a box, reading only the chunks that hold them.

        Args:
            region: Unit-step slices, one per leading dimension (default: the whole leaf).

        Returns:
            A new C-ordered numpy array.

        Raises:
            OutOfBoundsError: A slice with a step other than 1.
            CorruptionError: A chunk of the leaf is missing or does not match its digest.
        """
        box = _region.normalize(region, self.shape, self.address)
        return _region.read_region(self.reader, self._pieces, box)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        data = self.region()
        return data if dtype is None else data.astype(dtype)

    def __getitem__(self, index: Index) -> np.ndarray[Any, Any]:
        if not self.shape:
            return np.asarray(self)[index]
        first, rest = self._split(index)
        local: int | slice
        rows = self.shape[0]
        if isinstance(first, (int, np.integer)):
            i = int(first)
            if not -rows <= i < rows:
                raise OutOfBoundsError(
                    f"{self.address}: index {i} is out of bounds for axis 0 with size {rows}",
                    address=self.address,
                )
            i %= rows
            start, stop, local = i, i + 1, 0
        else:
            picked = range(rows)[first]
            if not picked:
                start = stop = 0
                local = slice(0, 0)
            else:
                start, stop = min(picked), max(picked) + 1
                end = picked.stop - start
                local = slice(picked.start - start, end if end >= 0 else None, picked.step)
        block = self.region(slice(start, stop))
        return block[(local, *rest)]

    def _split(self, index: Index) -> tuple[Any, tuple[Any, ...]]:
        items = index if isinstance(index, tuple) else (index,)
        for item in items:
            if not (isinstance(item, (int, np.integer, slice)) or item is Ellipsis):
                raise InvalidInputError(
                    f"{self.address}: only basic indexing (ints, slices, ...) reads lazily; "
                    f"got {type(item).__name__} — use np.asarray(leaf)[...] to read it all"
                )
        if not items:
            return slice(None), ()
        if items[0] is Ellipsis:
            if len(items) - 1 >= len(self.shape):
                return slice(None), items
            return slice(None), (Ellipsis, *items[1:])
        if len(items) - items.count(Ellipsis) > len(self.shape):
            raise OutOfBoundsError(
                f"{self.address}: too many indices for a leaf of shape {self.shape}",
                address=self.address,
            )
        return items[0], tuple(items[1:])


_MISSING = object()


class _Addresses(Collection[str]):
    """A checkpoint's addresses as a collection: membership without building them all."""

    def __init__(self, columns: Columns) -> None:
        self._columns = columns

    def __contains__(self, address: object) -> bool:
        return isinstance(address, str) and self._columns.find(address) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns.addresses)

    def __len__(self) -> int:
        return len(self._columns)


class Checkpoint:
    """A read-only view of one committed checkpoint, as :func:`treestore.open` returns it.

    Nothing but its manifest is read up front (of one stored in parts, its frame: a sharded
    leaf's parts are read when it is asked for). ``ckpt[address]`` is the leaf at ``address``: a
    :class:`LazyLeaf` for an array, the value for a Python scalar.

    Make one with :func:`treestore.open` or :meth:`Store.open`: the constructor's arguments are
    internal objects those functions read from the store.

    Args:
        storage: The storage of the checkpoint's store, kept as ``storage``.
        columns: The checkpoint's decoded manifest; of one stored in parts, its frame (the
            parts are read when a leaf needs them).

    Attributes:
        name: The checkpoint's name.
        url: Its store's URL.
        metadata: The metadata it was saved with.
        created: When it was saved (seconds since the epoch).
        codec: The codec it was saved with.
        num_leaves: How many leaves its tree holds.
        nbytes: Raw bytes of all its array leaves.
        leaves: Address -> LazyLeaf or value, in tree order.
        tree: The checkpoint's tree with LazyLeaf handles in place of arrays.

    Examples:
        >>> import numpy as np, treestore
        >>> _ = treestore.save("memory://doc/open", {"emb": np.arange(12).reshape(6, 2)}, "c")
        >>> ckpt = treestore.open("memory://doc/open")
        >>> ckpt["emb"]
        LazyLeaf('emb', shape=(6, 2), dtype=int64)
        >>> ckpt["emb"][4:]
        array([[ 8,  9],
               [10, 11]])
        >>> _ = treestore.save("memory://doc/sel", {"layer": {"0": {"w": 1.0, "b": 2.0}}}, "c")
        >>> treestore.open("memory://doc/sel").select("layer/0/*")
        ['layer/"0"/b', 'layer/"0"/w']
    """

    def __init__(self, storage: Storage, columns: Columns | Parted) -> None:
        self.storage = storage
        self._parted = columns if isinstance(columns, Parted) else None
        # Every leaf's address, kind, dtype and shape; a frame's sharded leaves wait for parts.
        self._frame = columns.frame if isinstance(columns, Parted) else columns
        self._parts: _parts.Decoded = {}  # the parts read so far, by index
        self.name = self._frame.name
        self.url = storage.url
        self.reader = _read.ChunkReader(storage, self._frame)
        self._readers = [self.reader]
        self._source = self._frame  # where leaf entries come from: the frame, or the whole
        # Of a frame: columns completed for some leaves, each with the leaves it completes.
        self._some: list[tuple[np.ndarray, Columns, _read.ChunkReader]] = []
        self._made: dict[int, Any] = {}  # leaf index -> its LazyLeaf or value, made on first use

    @functools.cached_property
    def columns(self) -> Columns:
        """The whole manifest's columns (one stored in parts: completed with every part, on
        first use)."""
        if self._parted is None:
            return self._frame
        whole = _parts.assemble(self.storage, self._parted, cache=self._parts)
        self.reader = _read.ChunkReader(self.storage, whole)
        self._readers.append(self.reader)
        self._source = whole
        return whole

    @functools.cached_property
    def manifest(self) -> Manifest:
        """The whole manifest, as a read-only view (its leaf entries made as they are read)."""
        with _memory.memory_named(f"reading the manifest of checkpoint {self.name!r}", self.name):
            return Manifest(self.columns)

    def __repr__(self) -> str:
        return f"Checkpoint({self.url!r}, {self.name!r}, leaves={len(self._frame)})"

    def _leaf(self, i: int) -> Any:
        found = self._made.get(i, _MISSING)
        if found is _MISSING:
            columns, reader = self._source, self.reader
            if columns.unread[i]:  # a sharded leaf of a frame: only the parts it needs are read
                columns, reader = self._completing(i)
            array = columns.leaves["kind"][i] < ARRAY_CODES
            found = self._made[i] = LazyLeaf(reader, columns, i) if array else columns.value(i)
        return found

    def _completing(self, i: int) -> tuple[Columns, _read.ChunkReader]:
        """Columns in which sharded leaf ``i`` of the frame is complete, and their reader: made
        from the parts that hold it, for every leaf those parts alone complete (each later leaf
        they hold needs no other merge; where every process holds every leaf, that is all)."""
        for mask, columns, reader in self._some:
            if mask[i]:
                return columns, reader
        assert self._parted is not None
        one = np.zeros(len(self._frame), bool)
        one[i] = True
        mask = self._frame.unread & self._parted.covered(self._parted.needed(one))
        columns = _parts.assemble(self.storage, self._parted, mask, self._parts)
        reader = _read.ChunkReader(self.storage, columns)
        self._readers.append(reader)
        self._some.append((mask, columns, reader))
        return columns, reader

    @property
    def metadata(self) -> Any:
        """The metadata it was saved with (None when none was given)."""
        return self._frame.metadata

    @property
    def created(self) -> float:
        """When it was saved (seconds since the epoch)."""
        return self._frame.created

    @property
    def codec(self) -> dict[str, Any]:
        """The codec it was saved with (name, level, byte planes)."""
        return dict(self._frame.codec)

    @property
    def num_leaves(self) -> int:
        """How many leaves its tree holds."""
        return len(self._frame)

    @property
    def nbytes(self) -> int:
        """Raw bytes of all its array leaves."""
        return self._frame.nbytes

    @property
    def leaves(self) -> dict[str, Any]:
        """Address -> LazyLeaf (arrays) or value (Python scalars), in tree order."""
        with _memory.memory_named(f"listing the leaves of checkpoint {self.name!r}", self.name):
            return {a: self._leaf(i) for i, a in enumerate(self.columns.addresses)}

    @property
    def tree(self) -> Any:
        """The checkpoint's tree with LazyLeaf handles in place of arrays."""
        with _memory.memory_named(f"building the tree of checkpoint {self.name!r}", self.name):
            return rebuild(self.columns.tree_record(), self._leaf)

    def __getitem__(self, address: str) -> Any:
        """The leaf at ``address`` — as the manifest spells it, or with digit keys as bare digits
        when that names one leaf (``h/3/w`` for ``h/"3"/w``)."""
        i = None
        if isinstance(address, str):  # by a walk down the tree: no address is built
            i = self._frame.find(address)
            if i is None:
                i = self._frame.nodes.find_loose(address)
        if i is None:
            self.select(glob_escape(address) if isinstance(address, str) else address)
            raise KeyError(address)  # select raised for anything it did not find
        return self._leaf(i)

    def __contains__(self, address: object) -> bool:
        return address in _Addresses(self._frame)

    def select(self, patterns: _select.Patterns) -> list[str]:
        """The addresses, in tree order, that match any of the patterns.

        Args:
            patterns: Globs over addresses (one or a list; quotes around digit-only keys may be
                left out); every pattern must match one.

        Returns:
            The matching addresses.

        Raises:
            NoMatchError: A pattern matches no leaf.
        """
        return _select.select(
            self._frame.addresses, patterns, where=f"checkpoint {self.name!r}", checkpoint=self.name
        )

    def stats(self, select: _select.Patterns = None) -> dict[str, ValueStats]:
        """The statistics of each leaf's values recorded when it was saved — NaN and ±inf counts,
        min and max of the finite elements, L2 norm — by address, in tree order, for the leaves
        that match ``select`` (globs over addresses; default: every leaf). Read from the
        manifest alone (of one stored in parts, its frame): no chunk is read. Leaves without
        statistics (saved with ``SaveOptions(stats=False)``, by an older treestore, complex or
        PRNG key data) are left out: unknown, not healthy.

        Args:
            select: Glob patterns over addresses (one or a list); every pattern must match one.

        Returns:
            ``{address: ValueStats}``.

        Raises:
            NoMatchError: A pattern matches no leaf.

        >>> import numpy as np, treestore
        >>> _ = treestore.save("memory://doc/ckstats", {"b": np.arange(4), "w": np.ones(4)}, "a")
        >>> {a: (s.min, s.max, s.l2) for a, s in treestore.open("memory://doc/ckstats").stats().items()}
        {'b': (0, 3, 3.7416573867739413), 'w': (1.0, 1.0, 2.0)}
        """
        frame = self._frame
        if select is None:
            return leaf_stats(frame)
        chosen = self.select(select)
        return leaf_stats(frame, [i for a in chosen if (i := frame.find(a)) is not None])

    @property
    def healthy(self) -> bool | None:
        """False when the recorded statistics say a leaf holds NaN or ±inf, True when the
        checkpoint has statistics and none does, None when it has none (unknown); from the
        manifest alone."""
        return health(self._frame)

    def nonfinite(self) -> list[str]:
        """The leaves that hold NaN or ±inf, from the manifest alone (no chunk is read).

        A leaf counts when its recorded statistics (for a Python float, its value) say so;
        leaves without statistics are left out.

        Returns:
            Their addresses, in tree order (empty when there is none).
        """
        return [self._frame.address(int(i)) for i in nonfinite_leaves(self._frame)]

    def chunk_objects(self) -> dict[bytes, int]:
        """The chunk objects this checkpoint references (of one stored in parts, every part's).

        Returns:
            ``{digest: stored size in bytes}``, each object once (a pack once for all the leaves
            it holds).
        """
        return self.columns.chunk_objects()

    @property
    def stored_bytes(self) -> int:
        """Bytes of every chunk object this checkpoint references (shared ones included)."""
        return sum(self.chunk_objects().values())

    @property
    def bytes_read(self) -> int:
        """Chunk-object bytes this view has read so far."""
        return sum(reader.bytes_read for reader in self._readers)


# The doctests of the methods: the classes report themselves as treestore.X (or treestore.types.X),
# which hides their methods from doctest's search of this module.
__test__ = {
    f"{cls.__name__}.{name}": getattr(cls, name)
    for cls in (
        Checkpoint,
        LazyLeaf,
    )
    for name, value in vars(cls).items()
    if not name.startswith("__") and ">>>" in (getattr(value, "__doc__", None) or "")
}
