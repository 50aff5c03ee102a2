"""A committed checkpoint, read-only: its manifest up front, its leaves as handles read on demand
(:mod:`treestore._api.lazy_leaf`), its statistics and its tree."""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterator
from glob import escape as glob_escape
from typing import Any

import numpy as np

from treestore._api.health import ValueStats, health, leaf_stats, nonfinite_leaves
from treestore._api.lazy_leaf import LazyLeaf
from treestore._deprecated import internal_attribute
from treestore._engine.reading import memory as _memory
from treestore._engine.reading import parts as _parts
from treestore._engine.reading import read as _read
from treestore._format import select as _select
from treestore._format.manifest.columns import Columns
from treestore._format.manifest.frame import Frame
from treestore._format.manifest.record_views import Manifest
from treestore._storage.base import Storage
from treestore._tree.structure import rebuild

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
        storage: The storage of the checkpoint's store.
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

    def __init__(self, storage: Storage, columns: Columns | Frame) -> None:
        self._storage = storage
        self._in_parts = columns if isinstance(columns, Frame) else None
        # Every leaf's address, kind, dtype and shape; a frame's sharded leaves wait for parts.
        self._frame = columns.columns if isinstance(columns, Frame) else columns
        self._parts: _parts.Decoded = {}  # the parts read so far, by index
        self.name = self._frame.name
        self.url = storage.url
        self._reader = _read.ChunkReader(storage, self._frame)
        self._readers = [self._reader]
        self._source = self._frame  # where leaf entries come from: the frame, or the whole
        # Of a frame: columns completed for some leaves, each with the leaves it completes.
        self._some: list[tuple[np.ndarray, Columns, _read.ChunkReader]] = []
        self._made: dict[int, Any] = {}  # leaf index -> its LazyLeaf or value, made on first use

    @functools.cached_property
    def _columns(self) -> Columns:
        """The whole manifest's columns (one stored in parts: completed with every part, on
        first use)."""
        if self._in_parts is None:
            return self._frame
        whole = _parts.assemble(self._storage, self._in_parts, cache=self._parts)
        self._reader = _read.ChunkReader(self._storage, whole)
        self._readers.append(self._reader)
        self._source = whole
        return whole

    columns = internal_attribute("Checkpoint", "columns", "_columns", "Checkpoint.manifest")
    reader = internal_attribute(
        "Checkpoint", "reader", "_reader", "Checkpoint.bytes_read, and its leaves to read"
    )
    storage = internal_attribute(
        "Checkpoint", "storage", "_storage", "Checkpoint.url (a Store of it: treestore.Store(url))"
    )

    @functools.cached_property
    def manifest(self) -> Manifest:
        """The whole manifest, as a read-only view (its leaf entries made as they are read)."""
        with _memory.memory_named(f"reading the manifest of checkpoint {self.name!r}", self.name):
            return Manifest(self._columns)

    def __repr__(self) -> str:
        return f"Checkpoint({self.url!r}, {self.name!r}, leaves={len(self._frame)})"

    def _leaf(self, i: int) -> Any:
        found = self._made.get(i, _MISSING)
        if found is _MISSING:
            columns, reader = self._source, self._reader
            if columns.unread[i]:  # a sharded leaf of a frame: only the parts it needs are read
                columns, reader = self._completing(i)
            array = columns.is_array[i]
            found = self._made[i] = LazyLeaf(reader, columns, i) if array else columns.value(i)
        return found

    def _completing(self, i: int) -> tuple[Columns, _read.ChunkReader]:
        """Columns in which sharded leaf ``i`` of the frame is complete, and their reader: made
        from the parts that hold it, for every leaf those parts alone complete (each later leaf
        they hold needs no other merge; where every process holds every leaf, that is all)."""
        for mask, columns, reader in self._some:
            if mask[i]:
                return columns, reader
        assert self._in_parts is not None
        one = np.zeros(len(self._frame), bool)
        one[i] = True
        mask = self._frame.unread & self._in_parts.covered(self._in_parts.needed(one))
        columns = _parts.assemble(self._storage, self._in_parts, mask, self._parts)
        reader = _read.ChunkReader(self._storage, columns)
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
            return {a: self._leaf(i) for i, a in enumerate(self._columns.addresses)}

    @property
    def tree(self) -> Any:
        """The checkpoint's tree with LazyLeaf handles in place of arrays."""
        with _memory.memory_named(f"building the tree of checkpoint {self.name!r}", self.name):
            return rebuild(self._columns.tree_record(), self._leaf)

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
            patterns: Patterns over addresses (one or a list; quotes around digit-only keys may be
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
        that match ``select`` (patterns over addresses; default: every leaf). Read from the
        manifest alone (of one stored in parts, its frame): no chunk is read. Leaves without
        statistics (saved with ``SaveOptions(stats=False)``, by an older treestore, complex
        leaves saved before complex statistics existed, PRNG key data) are left out: unknown,
        not healthy.

        Args:
            select: Patterns over addresses (one or a list); every pattern must match one.

        Returns:
            dict[str, ValueStats]: ``{address: ValueStats}``.

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
            dict[bytes, int]: ``{digest: stored size in bytes}``, each object once (a pack once
            for all the leaves it holds).
        """
        return self._columns.chunk_objects()

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
