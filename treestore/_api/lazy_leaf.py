"""One array leaf of a checkpoint as a handle: its shape, dtype and stored size from the
manifest, and reads of the whole leaf or of a slice that fetch only the chunks it needs."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from treestore._deprecated import internal_attribute
from treestore._engine.reading import read as _read
from treestore._engine.reading import region as _region
from treestore._format.codecs import stored_codec
from treestore._format.dtypes import dtype_from_name
from treestore._format.manifest.columns import Columns
from treestore._format.manifest.record_views import leaf_entry
from treestore._format.manifest.records import LeafEntry
from treestore._tree.leaves import restore_array
from treestore.errors import InvalidInputError, OutOfBoundsError

Index = Any


class LazyLeaf:
    """One array leaf of a checkpoint, read on demand.

    Basic numpy indexing (ints, slices, ``...``) reads and decodes only the chunks that hold the
    rows the index touches along the first axis; ``np.asarray(leaf)`` reads it all.

    A :class:`Checkpoint` makes its leaves (``ckpt[address]``, ``ckpt.leaves``, ``ckpt.tree``);
    the constructor's arguments are the checkpoint's own internal objects.

    Args:
        reader: The checkpoint's chunk reader.
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
        self._reader = reader
        self._columns = columns
        self._i = i
        self.address = columns.address(i)
        self.shape: tuple[int, ...] = columns.shape(i)
        self.dtype = dtype_from_name(columns.dtype_name(i), address=self.address)
        self.kind, self._prng_impl, self._weak_type = columns.restore_kind(i)

    reader = internal_attribute("LazyLeaf", "reader", "_reader", "LazyLeaf.entry (its chunks) and indexing")

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
        return stored_codec(sizes, self.dtype, self._reader.codec)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d leaf")
        return self.shape[0]

    def read(self) -> Any:
        """Read the whole leaf, as the type it was saved as.

        Returns:
            A numpy array (or numpy scalar), a jax array, or a jax PRNG key array, as saved.

        Raises:
            DamagedError: A chunk of the leaf is missing or does not match its digest.
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
            DamagedError: A chunk of the leaf is missing or does not match its digest.
        """
        box = _region.normalize(region, self.shape, self.address)
        return _region.read_region(self._reader, self._pieces, box)

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
            if len(items) - 1 >= len(self.shape):  # it stands for no dimension: axis 0 is next
                return self._split(items[1:])
            return slice(None), (Ellipsis, *items[1:])
        if len(items) - items.count(Ellipsis) > len(self.shape):
            raise OutOfBoundsError(
                f"{self.address}: too many indices for a leaf of shape {self.shape}",
                address=self.address,
            )
        return items[0], tuple(items[1:])


__all__ = ["LazyLeaf"]
