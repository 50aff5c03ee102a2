"""Byte planes (SPEC.md section 4): byte j of every element of a chunk gathered into plane j,
and joined back. The package's compiled loops (``_planes.c``, built at install) do it where they
were built and make the same bytes as numpy at every width up to :data:`WIDEST` (checked at
import); numpy does the same bytes elsewhere.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from treestore._kernels.scratch import scratch

_Planes = Callable[[Any, Any, int], None]
WIDEST = 8  # the widest elements checked: the format's MAX_PLANE_WIDTH at least (codecs asserts it)


def compiled() -> tuple[_Planes, _Planes] | None:
    """The compiled byte planes (``split(src, dst, width)``, ``join(src, dst, width)``:
    ``_planes.c``, built when the package is installed); None where no compiler built them or
    they fail a self-test (numpy then)."""
    try:
        from treestore._kernels import _planes
    except ImportError:
        return None
    return (_planes.split, _planes.join) if same_as_numpy(_planes.split, _planes.join) else None


def same_as_numpy(split: _Planes, join: _Planes) -> bool:
    """Whether ``split`` and ``join`` make exactly the byte planes of SPEC.md section 4."""
    data = np.random.default_rng(0).integers(0, 256, 8 * 1000 + 7, dtype=np.uint8)
    for width in range(1, WIDEST + 1):
        n = data.nbytes // width * width
        planes, back = np.empty(n, np.uint8), np.empty(n, np.uint8)
        split(data[:n], planes, width)
        if not np.array_equal(planes.reshape(width, -1), data[:n].reshape(-1, width).T):
            return False
        join(planes, back, width)
        if not np.array_equal(back, data[:n]):
            return False
    return True


_COMPILED = compiled()


# Without the compiled part, the planes of 2- and 4-byte elements are split, and those of 2-byte ones
# joined, by arithmetic on the elements as unsigned words (plane j is the word's byte j: on
# little-endian hosts) in a few contiguous numpy passes, where that beats numpy's strided copy;
# wider joins stay plane-by-plane copies, which numpy does faster than the word passes.
_LITTLE = sys.byteorder == "little"
_SPLIT_WORDS: dict[int, type[np.unsignedinteger[Any]]] = {2: np.uint16, 4: np.uint32} if _LITTLE else {}
_JOIN_WORDS: dict[int, type[np.unsignedinteger[Any]]] = {2: np.uint16} if _LITTLE else {}


def joined_fast(width: int) -> bool:
    """Whether planes of ``width`` bytes are joined in one step after all are decoded (the
    compiled join, or word arithmetic) rather than copied into place plane by plane."""
    return _COMPILED is not None or width in _JOIN_WORDS


def split_planes(raw: np.ndarray[Any, Any], planes: np.ndarray[Any, Any], width: int) -> None:
    """Byte planes of ``raw`` (1-D uint8, a multiple of ``width``) into ``planes`` (as long)."""
    size = raw.nbytes
    whole = raw.flags.c_contiguous and planes.flags.c_contiguous
    if _COMPILED is not None and whole:
        _COMPILED[0](raw, planes, width)
        return
    word = _SPLIT_WORDS.get(width)
    if word is None or not whole:
        np.copyto(planes.reshape(width, -1), raw.reshape(-1, width).T)
        return
    values: np.ndarray[Any, Any] = raw.view(word)
    rows = planes.reshape(width, -1)
    shifted: np.ndarray[Any, Any] = scratch(size, "words").view(word)
    np.copyto(rows[0], values, casting="unsafe")  # the low byte
    for j in range(1, width):
        np.right_shift(values, 8 * j, out=shifted)
        np.copyto(rows[j], shifted, casting="unsafe")


def join_planes(planes: np.ndarray[Any, Any], out: np.ndarray[Any, Any], width: int) -> None:
    """Join byte planes ``planes`` (1-D uint8, ``width`` planes one after the other) into ``out``
    (1-D uint8, as long, C-contiguous)."""
    size = out.nbytes
    if _COMPILED is not None and planes.flags.c_contiguous:
        _COMPILED[1](planes[:size], out, width)
        return
    rows = planes[:size].reshape(width, -1)
    word = _JOIN_WORDS.get(width)
    if word is None:
        out.reshape(-1, width)[:] = rows.T
        return
    values: np.ndarray[Any, Any] = out.view(word)
    shifted: np.ndarray[Any, Any] = scratch(size, "words").view(word)
    np.copyto(values, rows[0], casting="unsafe")
    for j in range(1, width):
        np.left_shift(rows[j], 8 * j, out=shifted, dtype=word, casting="unsafe")
        np.bitwise_or(values, shifted, out=values)
