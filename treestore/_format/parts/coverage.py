"""A fingerprint of how pieces cover their leaves, so a multi-process commit checks that the
pieces of every process tile every sharded leaf without seeing them (SPEC.md, section 8.3).

Element x of leaf l, in a job whose save draws the secret numbers r and a_0, a_1, … (mod the
prime P = 2¹²⁷ − 1, from the save's id), is given the weight r^(l+1) · Π_d a_d^(x_d). A piece's
fingerprint is the sum of its elements' weights, which the geometric series gives in O(ndim); a
process sends the sum over its pieces, one number. The pieces tile every leaf exactly when the
processes' sums add up to the sum over every sharded leaf's elements: otherwise the difference is
a nonzero polynomial in r and the a_d (some element is covered c ≠ 1 times, and |c − 1| ≪ P) of
degree below 2³² + 64 · 2⁴⁸, which random numbers mod P make zero with probability of about 2⁻⁷³
at most (Schwartz–Zippel). Pieces outside their leaf change the sum too, but a piece with no
elements weighs nothing: a process adds 1 for each piece outside its leaf, and the primary checks
the pieces of a leaf without elements by merging them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from treestore._kernels.digest import digest

P = 2**127 - 1
_BYTES = 16
_HEX = re.compile(r"[0-9a-f]{32}")


class Coverage:
    """The weights of one save (drawn from ``salt``, the save's id) for up to ``ndim`` dimensions."""

    def __init__(self, salt: bytes, ndim: int) -> None:
        self.r = self._draw(salt, b"leaf")
        self.a = [self._draw(salt, b"dim %d" % d) for d in range(ndim)]
        self._inverse = [pow(a - 1, P - 2, P) for a in self.a]
        self._powers: list[dict[int, int]] = [{} for _ in range(ndim)]
        self._leaf: dict[int, int] = {}

    @staticmethod
    def _draw(salt: bytes, what: bytes) -> int:
        """A number in [2, P), which keeps a - 1 invertible."""
        return 2 + int.from_bytes(digest(salt + b"\0" + what)[:_BYTES], "little") % (P - 2)

    def _power(self, d: int, k: int) -> int:
        cache = self._powers[d]
        found = cache.get(k)
        if found is None:
            found = cache[k] = pow(self.a[d], k, P)
        return found

    def box(self, leaf: int, start: Sequence[int], shape: Sequence[int]) -> int:
        """The fingerprint of the box at ``start`` of ``shape`` in leaf ``leaf``."""
        total = self._leaf.get(leaf)
        if total is None:  # pieces come leaf by leaf: the previous leaf's weight is usually known
            before = self._leaf.get(leaf - 1)
            total = pow(self.r, leaf + 1, P) if before is None else before * self.r % P
            self._leaf[leaf] = total
        for d, (s, n) in enumerate(zip(start, shape, strict=True)):
            # the geometric series: the sum of a^x for s <= x < s + n
            total = total * (self._power(d, s + n) - self._power(d, s)) % P * self._inverse[d] % P
        return total

    def sum(self, boxes: Iterable[tuple[int, Sequence[int], Sequence[int]]]) -> int:
        """The sum of the fingerprints of ``(leaf, start, shape)`` boxes, mod P."""
        return sum(self.box(leaf, start, shape) for leaf, start, shape in boxes) % P


def to_text(value: int) -> str:
    return f"{value % P:032x}"


def from_text(text: str) -> int | None:
    """A fingerprint as :func:`to_text` writes it, or None for anything else."""
    if not _HEX.fullmatch(text):
        return None
    value = int(text, 16)
    return value if value < P else None


__all__ = ["Coverage", "P", "from_text", "to_text"]
