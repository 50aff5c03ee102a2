"""Byte planes of chunk objects, compiled (``_planes.c``)."""

from typing_extensions import Buffer

def split(src: Buffer, dst: Buffer, width: int, /) -> None:
    """The byte planes of ``src`` (a whole number of ``width``-byte elements) into ``dst``."""

def join(src: Buffer, dst: Buffer, width: int, /) -> None:
    """The byte planes ``src`` joined into the elements they split, in ``dst``."""

def float_stats(src: Buffer, width: int, /) -> tuple[float, float, float]:
    """(minimum, maximum, sum of squares in float64) of float32 (``width`` 4) or bfloat16 (2)
    elements in one pass; the sum is NaN or infinite where an element is."""
