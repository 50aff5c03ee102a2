"""Byte planes, compiled and numpy: the install splits and joins them with its compiled part, and
a compiled part that makes other bytes than numpy's planes is left unused."""

from __future__ import annotations

import sys

import numpy as np
import pytest


def test_the_install_splits_and_joins_planes_with_its_compiled_part():
    """The README's install builds the byte planes' compiled loops (setup.py): the codec path the
    benchmarks measure is the one ``pip install`` gives. Without a C compiler the build goes on
    without them, and this test says so."""
    from treestore._kernels import planes

    assert planes._COMPILED is not None, "treestore/_kernels/_planes.c was not built: numpy splits the planes"
    assert planes.joined_fast(3)


def test_compiled_planes_that_differ_from_numpy_are_not_used(monkeypatch):
    """The compiled loops are checked against numpy's planes at import, every width: loops that
    make other bytes (a miscompiled build, say) are left for numpy's."""
    from treestore._kernels import planes

    split, join = planes._COMPILED or pytest.skip("no compiled part in this install")

    def wrong_split(src, dst, width):
        split(src, dst, width)
        if width == 5:
            np.frombuffer(dst, np.uint8)[0] ^= 1

    def wrong_join(src, dst, width):
        join(src, dst, width)
        if width == 7:
            np.frombuffer(dst, np.uint8)[-1] ^= 1

    assert planes.same_as_numpy(split, join)
    assert not planes.same_as_numpy(wrong_split, join)
    assert not planes.same_as_numpy(split, wrong_join)
    from treestore._kernels import _planes

    monkeypatch.setattr(planes, "same_as_numpy", lambda *fns: False)
    assert planes.compiled() is None
    monkeypatch.undo()
    from treestore import _kernels

    monkeypatch.setitem(sys.modules, "treestore._kernels._planes", None)  # not built
    monkeypatch.delattr(_kernels, "_planes")
    assert planes.compiled() is None
    with pytest.raises(ValueError, match="whole number of elements"):
        _planes.split(np.zeros(7, np.uint8), np.zeros(7, np.uint8), 2)
    with pytest.raises(ValueError, match="at least as long"):
        _planes.join(np.zeros(8, np.uint8), np.zeros(6, np.uint8), 2)
