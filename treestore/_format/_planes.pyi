"""Byte planes of chunk objects, compiled (``_planes.c``)."""

from typing_extensions import Buffer

def split(src: Buffer, dst: Buffer, width: int, /) -> None:
    """The byte planes of ``src`` (a whole number of ``width``-byte elements) into ``dst``."""

def join(src: Buffer, dst: Buffer, width: int, /) -> None:
    """The byte planes ``src`` joined into the elements they split, in ``dst``."""
