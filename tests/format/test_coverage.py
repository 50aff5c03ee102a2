"""The coverage fingerprint a multi-process commit checks the pieces with (SPEC.md, section 8.3)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from treestore._format.parts.coverage import Coverage, P, from_text, to_text

SALT = bytes(range(16))


def by_definition(c: Coverage, leaf: int, start: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """The sum over the box's elements x of r^(leaf+1) · Π a_d^x_d, element by element."""
    total = 0
    for x in itertools.product(*(range(s, s + n) for s, n in zip(start, shape, strict=True))):
        weight = pow(c.r, leaf + 1, P)
        for d, xd in enumerate(x):
            weight = weight * pow(c.a[d], xd, P) % P
        total = (total + weight) % P
    return total


boxes = st.integers(0, 3).flatmap(
    lambda ndim: st.tuples(
        st.integers(0, 5), st.tuples(*[st.integers(0, 6)] * ndim), st.tuples(*[st.integers(0, 4)] * ndim)
    )
)


@given(boxes)
def test_a_box_is_the_sum_of_its_elements_weights(box):
    c = Coverage(SALT, 3)
    leaf, start, shape = box
    assert c.box(leaf, start, shape) == by_definition(c, leaf, start, shape)


def grid(rng: np.random.Generator, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes of a random grid over a leaf of ``shape``."""
    cuts = [sorted({0, n, *rng.integers(1, max(n, 2), 2).tolist()} - {n + 1}) for n in shape]
    cuts = [[c for c in cs if c <= n] for cs, n in zip(cuts, shape, strict=True)]
    return [
        (
            tuple(c[j] for c, j in zip(cuts, at, strict=True)),
            tuple(c[j + 1] - c[j] for c, j in zip(cuts, at, strict=True)),
        )
        for at in itertools.product(*(range(len(c) - 1) for c in cuts))
    ]


@settings(max_examples=60)
@given(st.integers(0, 2**32 - 1))
def test_pieces_that_tile_their_leaves_add_up_and_others_do_not(seed):
    rng = np.random.default_rng(seed)
    shapes = [tuple(int(n) for n in rng.integers(1, 7, int(rng.integers(1, 4)))) for _ in range(3)]
    c = Coverage(rng.bytes(16), 3)
    whole = c.sum((leaf, (0,) * len(shape), shape) for leaf, shape in enumerate(shapes))
    pieces = [
        (leaf, start, extent) for leaf, shape in enumerate(shapes) for start, extent in grid(rng, shape)
    ]
    order = rng.permutation(len(pieces))
    assert c.sum(pieces[k] for k in order) == whole  # in any order, from any processes
    leaf, start, extent = pieces[int(rng.integers(len(pieces)))]
    assert c.sum([*pieces, (leaf, start, extent)]) != whole  # a piece twice: an overlap
    assert c.sum(p for p in pieces if p != (leaf, start, extent)) != whole or not all(extent)  # a gap
    moved = (leaf, (start[0] + 1, *start[1:]), extent)  # one element further: overlap and gap, or outside
    assert c.sum([moved if p == (leaf, start, extent) else p for p in pieces]) != whole
    other = (leaf + 1) % len(shapes)
    if shapes[other] == shapes[leaf]:  # the same box, but of another leaf
        assert (
            c.sum(
                [(other, s, e) if (lf, s, e) == (leaf, start, extent) else (lf, s, e) for lf, s, e in pieces]
            )
            != whole
        )


def test_each_save_draws_its_own_numbers():
    a, b = Coverage(SALT, 2), Coverage(bytes(16), 2)
    assert (a.r, a.a) != (b.r, b.a)
    assert all(2 <= n < P for n in (a.r, *a.a, b.r, *b.a))


def test_fingerprints_as_text():
    assert from_text(to_text(12345)) == 12345 and len(to_text(P - 1)) == 32
    for bad in ("", "0" * 31, "g" * 32, f"{P:032x}", "f" * 32, " " + "0" * 31):
        assert from_text(bad) is None, bad
