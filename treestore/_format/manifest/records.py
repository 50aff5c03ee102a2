"""The public records of a manifest (SPEC.md §6): a chunk reference, a piece of a leaf saved in
pieces, and a leaf's entry. Small immutable values, made on demand: the engine names one chunk
by a :class:`ChunkRef`, and :mod:`treestore._format.manifest.record_views` makes
:class:`LeafEntry` records from the columns when a caller asks for a leaf's record.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from treestore._deprecated import renamed_attribute
from treestore._format.address import Key, parse_address
from treestore._format.dtypes import ARRAY_KINDS
from treestore._format.manifest.rules import leaf_digest


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a leaf: the BLAKE3 digest of its raw bytes, raw and stored sizes.

    A small leaf lives inside a pack chunk: ``pack`` indexes the manifest's packs and ``offset``
    is where the leaf's bytes start in the pack's raw bytes.

    Attributes:
        digest: The 32-byte BLAKE3 digest of the chunk's raw (decoded) bytes. For a chunk object
            of its own it is also the object's name; for a pack member it is the digest of the
            member's bytes only (the pack's object is named by the pack's own digest).
        raw_size: The chunk's raw bytes (for a pack member, its bytes inside the pack), at most
            256 MiB.
        stored_size: The bytes of the stored chunk object, header included (informational); 0
            for a pack member, whose bytes are stored in the pack's object.
        pack: The index, in the manifest's ``packs``, of the pack that holds this member; None for
            a chunk object of its own.
        offset: Where the member's bytes start in the pack's raw bytes; 0 when ``pack`` is None.
    """

    digest: bytes
    raw_size: int
    stored_size: int
    pack: int | None = None
    offset: int = 0


@dataclass(frozen=True)
class Piece:
    """A box of an array leaf (``start`` and ``shape`` in the leaf's index space) whose elements,
    in C order, are the concatenated raw bytes of ``chunks``. Sharded arrays are saved as one
    piece per distinct shard; other arrays are one piece covering the whole leaf.

    Attributes:
        start: The index of the box's first element, one entry per dimension of the leaf.
        shape: The box's extent, one entry per dimension of the leaf (``start[d] + shape[d]``
            is at most the leaf's ``shape[d]``).
        chunks: The chunk refs whose raw bytes, concatenated in order, are the box's elements in
            C order, little-endian; empty for an empty box.
    """

    start: tuple[int, ...]
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]

    @property
    def region(self) -> tuple[slice, ...]:
        """The box as one slice per dimension, to index the leaf with."""
        return tuple(slice(a, a + n) for a, n in zip(self.start, self.shape, strict=True))


@dataclass(frozen=True)
class LeafEntry:
    """Everything the manifest says about one leaf.

    ``chunks`` lists every chunk of an array leaf; ``pieces`` is set only for leaves saved in
    several pieces (sharded arrays), whose chunks then follow piece by piece.

    Attributes:
        address: The leaf's canonical address in the tree (see :func:`treestore.format_address`);
            the empty string for a tree that is one leaf.
        kind: What the leaf was saved as: an array kind, ``"numpy"``, ``"jax"``, ``"npscalar"``
            (a 0-d numpy value, restored as a numpy scalar) or ``"prng_key"`` (a typed jax PRNG
            key, stored as its key data), or a Python scalar kind, ``"bool"``, ``"int"``,
            ``"float"``, ``"complex"``, ``"str"`` or ``"bytes"``.
        dtype: The array's element type by name (``"float32"``, ``"bfloat16"``, ...; ``"uint32"``
            for a PRNG key); None for a Python scalar.
        shape: The array's shape (``()`` for an ``npscalar``; a PRNG key's is that of its key
            data, whose last dimension is 2 or 4); None for a Python scalar.
        chunks: The array's chunk refs in order: their raw bytes, concatenated, are its elements
            in C order, little-endian (for a sharded leaf, piece after piece). Empty for a Python
            scalar and for an array with no elements.
        prng_impl: A PRNG key's implementation, ``"threefry2x32"``, ``"rbg"`` or
            ``"unsafe_rbg"``; None for every other kind.
        value: A Python scalar's value, kept in the manifest (an ``int`` of any size, a
            ``complex``, ``bytes``, ...); None for an array.
        pieces: A sharded array's pieces, one per distinct shard, in manifest order; empty for
            every other leaf (:attr:`all_pieces` gives one piece covering an unsharded array).
        weak_type: Whether the leaf is a weakly typed jax array (as jax makes from Python
            scalars); False for every other leaf.
    """

    address: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    chunks: tuple[ChunkRef, ...] = ()
    prng_impl: str | None = None
    value: object = None
    pieces: tuple[Piece, ...] = ()
    weak_type: bool = False

    @property
    def all_pieces(self) -> tuple[Piece, ...]:
        """The pieces of an array leaf (one covering the leaf unless it was saved sharded)."""
        if self.pieces:
            return self.pieces
        shape = self.shape or ()
        return (Piece((0,) * len(shape), shape, self.chunks),)

    layout = renamed_attribute("LeafEntry", "layout", "all_pieces")

    @functools.cached_property
    def path(self) -> tuple[Key, ...]:
        """The typed key path the address stands for."""
        return parse_address(self.address)

    @functools.cached_property
    def digest(self) -> bytes:
        """Equal digests mean equal leaves (SPEC.md, section 6.7)."""
        if not self.is_array:
            return leaf_digest(self.kind, value=self.value)
        pieces = [(p.start, p.shape, [c.digest for c in p.chunks]) for p in self.pieces] or None
        return leaf_digest(
            self.kind, self.dtype, self.shape, self.prng_impl, [c.digest for c in self.chunks], pieces
        )

    @property
    def is_array(self) -> bool:
        """Whether the leaf is an array (kind ``numpy``, ``jax``, ``npscalar`` or ``prng_key``)."""
        return self.kind in ARRAY_KINDS

    @property
    def nbytes(self) -> int:
        """The leaf's raw bytes (0 for a Python scalar)."""
        return sum(c.raw_size for c in self.chunks)

    @property
    def stored_bytes(self) -> int:
        """The stored bytes of the leaf's own chunk objects (its bytes inside packs not counted)."""
        return sum(c.stored_size for c in self.chunks if c.pack is None)


__all__ = ["ChunkRef", "LeafEntry", "Piece"]
