"""Who reads what when processes share replicated leaves (treestore._engine.reading.share_plan).
The devices of other processes are stand-ins here: tests/system/test_shared_restore.py runs real
ones."""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import treestore
from treestore._engine.reading.committed import read_columns, read_commit_record
from treestore._engine.reading.share_plan import Layout, _assign, _units, key_of, wire_dtype
from treestore._format.manifest.record_views import stored
from treestore._storage.registry import open_storage
from treestore._tree.template import Slot


@dataclass(frozen=True)
class Device:
    id: int
    process_index: int


def layout(regions: list[tuple[slice, ...]], holders: list[tuple[Device, ...]]) -> Layout:
    return Layout(("data",), tuple(regions), tuple(holders), {key_of(r): k for k, r in enumerate(regions)})


def test_the_readers_are_spread_evenly_over_the_processes():
    devices = [Device(i, i) for i in range(4)]
    layouts = [layout([(slice(0, 16),)], [tuple(devices)]) for _ in range(8)]
    readers = _assign([[(j, 0)] for j in range(8)], layouts, [4] * 8)
    assert Counter(r[0].process_index for r in readers) == {0: 2, 1: 2, 2: 2, 3: 2}
    # bigger regions first, each to the least loaded: 3 + 1 against 2 + 2, not 3 + 2 against 1 + 1
    sizes = [(slice(0, n),) for n in (2, 3, 1, 2)]
    layouts = [layout([r], [tuple(devices[:2])]) for r in sizes]
    readers = _assign([[(j, 0)] for j in range(4)], layouts, [1] * 4)
    load = Counter()
    for region, (reader,) in zip(sizes, readers, strict=True):
        load[reader.process_index] += region[0].stop
    assert sorted(load.values()) == [4, 4]


def test_a_region_is_read_by_a_device_that_holds_it():
    a, b, c = Device(0, 0), Device(1, 1), Device(2, 1)
    regions = [(slice(0, 4),), (slice(4, 8),)]
    readers = _assign([[(0, 0)], [(0, 1)]], [layout(regions, [(a, b), (c,)])], [4])
    assert readers[0][1] is c and readers[0][0] is a  # process 1 is busy with region 1


def _columns(tree: dict, options: treestore.SaveOptions | None = None):
    url = f"memory://share-plan/{uuid.uuid4().hex}"
    treestore.save(url, tree, "c", options=options)
    storage = open_storage(url)
    return read_columns(storage, read_commit_record(storage, "c"))


def _found(columns, address: str, lay: Layout) -> tuple:
    index = columns.addresses.index(address)
    entry = stored(columns, index)
    slot = Slot(address, None, entry)
    dtype = np.dtype(entry.dtype)
    return (0, slot, None, tuple(entry.shape), dtype, wire_dtype(dtype), lay)


def test_regions_that_need_one_chunk_go_to_one_reader_when_a_process_holds_both():
    columns = _columns({"w": np.arange(1024.0, dtype=np.float32).reshape(32, 32)})  # one chunk
    top, bottom = (slice(0, 16), slice(0, 32)), (slice(16, 32), slice(0, 32))
    across = layout([top, bottom], [(Device(0, 0), Device(1, 1)), (Device(2, 0), Device(3, 1))])
    (unit,) = _units([_found(columns, "w", across)], columns)
    assert unit == [(0, 0), (0, 1)]
    readers = _assign([unit], [across], [4])
    assert readers[0][0].process_index == readers[0][1].process_index
    apart = layout([top, bottom], [(Device(0, 0),), (Device(3, 1),)])  # no process holds both
    assert len(_units([_found(columns, "w", apart)], columns)) == 2


def test_small_leaves_in_one_pack_go_to_one_reader():
    columns = _columns({"a": np.arange(4.0), "b": np.arange(5.0), "big": np.zeros(2**17)})
    everywhere = (Device(0, 0), Device(1, 1))
    whole = [layout([(slice(0, n),)], [everywhere]) for n in (4, 5, 2**17)]
    found = [_found(columns, a, lay) for a, lay in zip(("a", "b", "big"), whole, strict=True)]
    assert _units(found, columns) == [[(0, 0), (1, 0)], [(2, 0)]]


def test_what_travels_bit_for_bit():
    assert wire_dtype(np.float32) == np.uint32
    assert wire_dtype(ml_dtypes.bfloat16) == np.uint16
    assert wire_dtype(ml_dtypes.float8_e4m3fn) == np.uint8
    assert wire_dtype(np.bool_) == np.uint8
    assert wire_dtype(np.int16) == np.uint16
    for refused in (ml_dtypes.int4, ml_dtypes.float4_e2m1fn, np.complex64):
        assert wire_dtype(refused) is None, refused
    assert wire_dtype(jax.random.key(0).dtype) is None
    assert wire_dtype(np.float64) == (np.uint64 if jax.config.read("jax_enable_x64") else None)


@pytest.mark.parametrize("share", [True, False])
def test_one_process_loads_as_before(share):
    """One process: nothing is shared and nothing voted on, whatever ``share`` says."""
    from treestore._engine.group import restore_vote

    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    like = {"x": jax.ShapeDtypeStruct((4,), np.float32, sharding=NamedSharding(mesh, P()))}
    assert restore_vote.begin(like, share) is None
