"""The fetcher's plan of slices, for leaves of every shape (hypothesis), on stand-in device
arrays: the chunks are the leaf's bytes, the window is respected and emptied, a slice takes at
most its target and two rows on the device, a leaf has one slice height or two, and bytes are
fetched twice only as documented (two rows a slice, and up to a chunk for the last slice but
none with ``exact``)."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from treestore._engine.saving import device_fetch, slicing
from treestore._engine.saving.device_fetch import Fetcher, Window, chunk_step


class _Piece:
    """A slice on its way to the host."""

    def __init__(self, a: np.ndarray[Any, Any]) -> None:
        self.a, self.nbytes = a, a.nbytes

    def copy_to_host_async(self) -> None:
        pass


class _Device:
    """A stand-in device array: what the fetcher reads of one."""

    def __init__(self, a: np.ndarray[Any, Any]) -> None:
        self.a, self.shape, self.dtype, self.ndim, self.size, self.nbytes = (
            a,
            a.shape,
            a.dtype,
            a.ndim,
            a.size,
            a.nbytes,
        )
        self.sharding = "one device"

    def devices(self) -> set[str]:
        return {"device"}


def _slicer(x: _Device, rows: int, flat: bool) -> Any:
    def take(array: _Device, start: Any) -> _Piece:
        a = array.a.reshape(-1) if flat else array.a
        assert start >= 0 and start + rows <= a.shape[0], (start, rows, a.shape)
        return _Piece(a[int(start) : int(start) + rows])

    return take


_fetched: list[int] = []  # the bytes of each piece fetched, in order


@pytest.fixture(autouse=True, scope="module")
def _stand_ins() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slicing, "slicer", _slicer)
        mp.setattr(slicing, "compile_ahead", lambda wanted: None)
        mp.setattr(device_fetch, "whole", lambda x: _Piece(x.a))
        mp.setattr(device_fetch, "to_host", lambda p: _fetched.append(p.nbytes) or p.a)
        mp.setattr(device_fetch.Fetcher, "may_slice", lambda self, x: True)
        yield


shapes = st.one_of(
    st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    st.tuples(st.integers(1, 3000)),
    st.tuples(st.integers(1, 8), st.integers(100, 900)),  # rows bigger than small chunks
)


@settings(max_examples=400, deadline=None)
@given(
    shape=shapes,
    dtype=st.sampled_from([np.int8, np.int16, np.float32, np.float64]),
    chunk=st.sampled_from([16, 40, 64, 100, 1000]),
    target=st.sampled_from([16, 50, 99, 200, 1000, 3000]),
    exact=st.booleans(),
)
def test_a_leaf_s_slices_hand_over_its_chunks_within_their_bounds(
    shape: tuple[int, ...], dtype: Any, chunk: int, target: int, exact: bool
) -> None:
    a = np.arange(int(np.prod(shape)), dtype=np.int64).astype(dtype).reshape(shape)
    fetched = _fetched
    fetched.clear()
    window = Window(target + 2 * chunk)
    fetcher = Fetcher(window, chunk, target, exact=exact)
    step = chunk_step(a.dtype.itemsize, chunk)

    def stored(raw: np.ndarray[Any, Any]) -> cf.Future[bytes]:
        done: cf.Future[bytes] = cf.Future()
        done.set_result(bytes(raw))
        return done

    futures = fetcher.add(_Device(a), step, stored)
    fetcher.run()
    raw = a.tobytes()
    assert [f.result() for f in futures] == [raw[i : i + step] for i in range(0, len(raw), step)]
    assert window.held == 0 and window.peak <= window.limit
    if a.nbytes <= target:
        assert fetched == ([a.nbytes] if a.nbytes else [])
        return
    row = a.nbytes // a.shape[0] if a.ndim and a.shape[0] else a.nbytes
    if row > target:  # a flat view
        row = a.dtype.itemsize
    assert max(fetched) <= max(target, row) + 2 * row
    assert len(set(fetched[:-1])) <= 1  # one height, and the last's
    twice = 0 if exact else step
    assert a.nbytes <= sum(fetched) <= a.nbytes + 2 * row * len(fetched) + twice
