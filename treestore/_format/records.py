"""The public records of a manifest (SPEC.md §6): a chunk reference, a piece of a leaf saved in
pieces, and a leaf's entry. Small immutable values, made on demand: the engine names one chunk
by a :class:`ChunkRef`, and :mod:`treestore._format.views` makes :class:`LeafEntry` records from
the columns when a caller asks for a leaf's record.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from treestore._format.address import Key, parse_address
from treestore._format.dtypes import ARRAY_KINDS
from treestore._format.manifest import leaf_digest


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a leaf: the BLAKE3 digest of its raw bytes, raw and stored sizes.

    A small leaf lives inside a pack chunk: ``pack`` indexes the manifest's packs and ``offset``
    is where the leaf's bytes start in the pack's raw bytes.
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
    piece per distinct shard; other arrays are one piece covering the whole leaf."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]

    @property
    def region(self) -> tuple[slice, ...]:
        return tuple(slice(a, a + n) for a, n in zip(self.start, self.shape, strict=True))


@dataclass(frozen=True)
class LeafEntry:
    """Everything the manifest says about one leaf.

    ``chunks`` lists every chunk of an array leaf; ``pieces`` is set only for leaves saved in
    several pieces (sharded arrays), whose chunks then follow piece by piece.
    """

    address: str
    kind: str
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    chunks: tuple[ChunkRef, ...] = ()
    prng_impl: str | None = None
    value: object = None
    pieces: tuple[Piece, ...] = ()
    weak_type: bool = False  # a jax array with a weak type, as Python scalars have

    @property
    def layout(self) -> tuple[Piece, ...]:
        """The pieces of an array leaf (one covering the leaf unless it was saved sharded)."""
        if self.pieces:
            return self.pieces
        shape = self.shape or ()
        return (Piece((0,) * len(shape), shape, self.chunks),)

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
        return self.kind in ARRAY_KINDS

    @property
    def nbytes(self) -> int:
        return sum(c.raw_size for c in self.chunks)

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored_size for c in self.chunks if c.pack is None)


__all__ = ["ChunkRef", "LeafEntry", "Piece"]
