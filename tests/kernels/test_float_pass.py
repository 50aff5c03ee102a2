"""The compiled one-pass statistics of float32 and bfloat16 chunks: built by the install on
x86-64, and left unused where it differs from numpy's passes. (That records do not depend on
whether it was built is tests/engine/test_stats.py's.)"""

from __future__ import annotations

import numpy as np
import pytest


def test_the_install_measures_float32_and_bfloat16_with_its_compiled_pass():
    """The README's install builds the one-pass statistics (``_planes.c``) on x86-64: the path
    the benchmarks measure is the one ``pip install`` gives. (Elsewhere numpy's passes measure.)"""
    import platform

    from treestore._kernels import float_pass

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the compiled statistics are built for x86-64 only")

    assert float_pass.COMPILED is not None, (
        "treestore/_kernels/_planes.c was not built: numpy measures floats"
    )


def test_a_compiled_pass_that_differs_from_numpy_is_not_used(monkeypatch):
    """The compiled pass is checked against numpy at import: one that gives another minimum, a
    sum off by more than rounding, or a finite sum over a NaN or an infinity (a miscompiled
    build, say) is left for numpy's passes, as is an install where it was not built."""
    import sys

    from treestore._kernels import float_pass

    fn = float_pass.COMPILED or pytest.skip("no compiled part in this install")
    assert float_pass.same_as_numpy(fn)
    assert not float_pass.same_as_numpy(lambda x, w: (fn(x, w)[0] - 1, *fn(x, w)[1:]))
    assert not float_pass.same_as_numpy(lambda x, w: (*fn(x, w)[:2], fn(x, w)[2] * (1 + 1e-9)))
    assert not float_pass.same_as_numpy(lambda x, w: (*fn(x, w)[:2], 1.0))
    monkeypatch.setattr(float_pass, "same_as_numpy", lambda fn: False)
    assert float_pass.compiled() is None
    monkeypatch.undo()
    from treestore import _kernels
    from treestore._kernels import _planes

    monkeypatch.setitem(sys.modules, "treestore._kernels._planes", None)  # not built
    monkeypatch.delattr(_kernels, "_planes")
    assert float_pass.compiled() is None

    with pytest.raises(ValueError, match=r"float32 \(4\) or bfloat16 \(2\)"):
        _planes.float_stats(np.zeros(6, np.uint8), 4)
    with pytest.raises(ValueError, match=r"float32 \(4\) or bfloat16 \(2\)"):
        _planes.float_stats(np.zeros(8, np.uint8), 8)
