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
from treestore._engine.reading import share_plan
from treestore._engine.reading.committed import read_columns, read_commit_record
from treestore._engine.reading.region import leaf_pieces, objects_met
from treestore._engine.reading.share_plan import Layout, Shared, _placed, _units, key_of, wire_dtype
from treestore._format.manifest.record_views import stored
from treestore._storage.registry import open_storage
from treestore._tree.template import Slot


@dataclass(frozen=True)
class Device:
    id: int
    process_index: int


def _columns(tree: dict, options: treestore.SaveOptions | None = None):
    url = f"memory://share-plan/{uuid.uuid4().hex}"
    treestore.save(url, tree, "c", options=options)
    storage = open_storage(url)
    return read_columns(storage, read_commit_record(storage, "c"))


def replicated(columns, addresses: list[str], processes: int) -> list[Shared]:
    """The leaves at ``addresses`` as shared leaves replicated on ``processes`` processes of
    one device each (stand-ins: one replica group, replica index = process)."""
    devices = tuple(Device(i, i) for i in range(processes))
    out = []
    for address in addresses:
        entry = stored(columns, columns.addresses.index(address))
        region = tuple(slice(0, n) for n in entry.shape)
        place = {d: (0, d.process_index) for d in devices}
        lay = Layout(("data",), processes, (region,), (devices,), {key_of(region): 0}, place)
        slot = Slot(address, None, entry)
        out.append(Shared(len(out), slot, None, entry.shape, np.dtype(entry.dtype), lay))
    return out


def placed(leaves: list[Shared], columns) -> share_plan.Batch:
    """One batch of ``leaves`` over a mesh of one ``data`` axis, as :func:`share_plan.plan`
    places a run, with the objects each leaf needs."""
    return _placed(None, ("data",), leaves, columns, [share_plan._objects(columns, s) for s in leaves])


def test_the_readers_are_spread_evenly_over_the_replicas():
    values = {f"w{i}": np.full(2**15, i, np.float32) for i in range(8)}  # 128 KiB: a chunk each
    columns = _columns(values)
    batch = placed(replicated(columns, sorted(values), 4), columns)
    assert Counter(s.reader for s in batch.leaves) == {0: 2, 1: 2, 2: 2, 3: 2}
    assert batch.size == 2 * 2**17
    for r in range(4):  # each reader's regions one after the other in its segment
        mine = sorted((s.offset, s.region_bytes) for s in batch.leaves if s.reader == r)
        assert [o for o, _ in mine] == [0, 2**17]


def test_bigger_leaves_go_first_each_to_the_least_loaded():
    rows = {"a": 2, "b": 3, "c": 1, "d": 2}  # 3 + 1 against 2 + 2, not 3 + 2 against 1 + 1
    values = {k: np.zeros((n, 2**14), np.float32) for k, n in rows.items()}
    columns = _columns(values)
    batch = placed(replicated(columns, list(rows), 2), columns)
    load = Counter()
    for s in batch.leaves:
        load[s.reader] += s.region_bytes
    assert sorted(load.values()) == [4 * 2**16, 4 * 2**16]


def test_small_leaves_in_one_pack_get_one_reader():
    columns = _columns({"a": np.arange(4.0), "b": np.arange(5.0), "big": np.zeros(2**17)})
    leaves = replicated(columns, ["a", "b", "big"], 2)
    assert _units(leaves, [share_plan._objects(columns, s) for s in leaves], columns, 2**20) == [[0, 1], [2]]
    batch = placed(leaves, columns)
    assert batch.leaves[0].reader == batch.leaves[1].reader != batch.leaves[2].reader


def test_batches_are_filled_largest_first(monkeypatch):
    """Batches of at most BATCH_BYTES are filled largest first: in plan order, the biases before
    four big leaves that fill a batch would have left the last big leaf a batch of its own, its
    bytes on one replica index and zeros on the other, moved by the all-gather all the same."""
    values = {f"b{i}": np.full(8, i, np.float32) for i in range(2)}
    values.update({f"w{i}": np.full(2**15, i, np.float32) for i in range(4)})  # 128 KiB each
    columns = _columns(values)
    monkeypatch.setattr(share_plan, "BATCH_BYTES", 4 * 2**17)
    leaves = replicated(columns, list(values), 2)
    runs = share_plan._runs(leaves, columns)
    assert [[s.slot.address for s in run] for run, _ in runs] == [["w0", "w1", "w2", "w3"], ["b0", "b1"]]
    sizes = [_placed(None, ("data",), run, columns, objects).size for run, objects in runs]
    assert sizes == [2 * 2**17, 128]  # no segment of zeros beside a big leaf; the biases, packed, one reader


def test_a_leaf_bigger_than_a_readers_share_is_split_at_chunk_boundaries():
    """A leaf more than a reader's share of its batch is read in parts, row ranges of its region
    that begin and end where its chunks do, one per reader: alone in a batch, whole, its reader
    would read everything and the others gather zeros beside it (four times the leaf)."""
    values = {"big": np.arange(1000 * 64, dtype=np.float32).reshape(1000, 64)}  # 250 KiB
    columns = _columns(values, treestore.SaveOptions(chunk_size=2**15, small_leaf=1024))  # 32 KiB: 128 rows
    (leaf,) = replicated(columns, ["big"], 4)
    batch = placed([leaf], columns)
    assert sorted(s.rows for s in batch.leaves) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert sorted(s.reader for s in batch.leaves) == [0, 1, 2, 3]
    assert batch.size == 256 * 256  # the biggest part, not the leaf
    starts = {s.rows: s.start for s in batch.leaves}
    assert starts[(256, 512)] == 256 * 64 * 4 and starts[(0, 256)] == 0
    pieces = leaf_pieces(columns, leaf.index)
    met = [objects_met(pieces, s.region(0)) for s in batch.leaves]
    assert sum(len(m) for m in met) == len(set().union(*met))  # no chunk read for two parts


def test_a_leaf_is_not_split_where_no_chunk_boundary_falls_between_its_rows():
    values = {"big": np.zeros((10, 3000), np.float32), "small": np.zeros(8, np.float32)}  # 12000-byte rows
    columns = _columns(values, treestore.SaveOptions(chunk_size=2**15, small_leaf=1024))  # chunk ends mid-row
    leaves = replicated(columns, ["big", "small"], 4)
    batch = placed(leaves, columns)
    assert [s.rows for s in batch.leaves] == [None, None]


def test_a_leaf_whose_pieces_share_a_pack_is_read_whole():
    """A leaf saved in small pieces, packed together: a part of it would need the whole pack,
    so the pack would be read once per part's reader; the leaf is read whole instead."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    value = np.arange(1024 * 16, dtype=np.float32).reshape(1024, 16)  # two pieces of 32 KiB
    leaf = jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("x")), lambda i: value[i])
    columns = _columns({"w": leaf})
    pieces = leaf_pieces(columns, 0)
    assert len(pieces.first) == 2 and set(columns.chunks["pack"][pieces.first].tolist()) == {0}
    batch = placed(replicated(columns, ["w"], 4), columns)
    assert [s.rows for s in batch.leaves] == [None]


def test_the_leaves_of_one_pack_stay_one_unit_past_a_readers_share(monkeypatch):
    """Big leaves filling the batches first, the biases are a batch of their own, whose share
    per reader is less than their pack: still one reader reads the pack, not each of four."""
    values = {f"w{i}": np.full(2**15, i, np.float32) for i in range(4)}  # 128 KiB each
    values.update({f"b{i}": np.full(256, i, np.float32) for i in range(8)})  # 1 KiB each, packed
    columns = _columns(values)
    monkeypatch.setattr(share_plan, "BATCH_BYTES", 4 * 2**17)
    runs = share_plan._runs(replicated(columns, list(values), 4), columns)
    (small, objects) = runs[1]
    assert [s.slot.address for s in small] == [f"b{i}" for i in range(8)]
    batch = _placed(None, ("data",), small, columns, objects)
    assert {s.reader for s in batch.leaves} == {0}


def test_leaves_of_alike_chunks_are_spread_over_the_readers():
    """Zero leaves share their chunks (deduplicated): as one unit they would give one reader
    the whole batch; each reader reads the chunk once instead, and the leaves are spread."""
    values = {f"z{i}": np.zeros(2**15, np.float32) for i in range(16)}  # 128 KiB each, alike
    columns = _columns(values)
    ((run, objects),) = share_plan._runs(replicated(columns, list(values), 4), columns)
    batch = _placed(None, ("data",), run, columns, objects)
    assert Counter(s.reader for s in batch.leaves) == {0: 4, 1: 4, 2: 4, 3: 4}


def test_a_leaf_in_several_packs_is_cut_where_one_pack_ends():
    """A leaf saved in eight small pieces, packed three, three and two to a pack: its parts end
    where a pack does, so each pack has one reader."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    value = np.arange(1024 * 64, dtype=np.float32).reshape(1024, 64)  # pieces of 32 KiB
    leaf = jax.make_array_from_callback(value.shape, NamedSharding(mesh, P("x")), lambda i: value[i])
    columns = _columns({"w": leaf}, treestore.SaveOptions(pack_size=3 * 2**15))
    pieces = leaf_pieces(columns, 0)
    assert columns.chunks["pack"][pieces.first].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    batch = placed(replicated(columns, ["w"], 4), columns)
    assert sorted(s.rows for s in batch.leaves) == [(0, 384), (384, 768), (768, 1024)]


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


def test_a_collective_that_fails_or_outlives_the_timeout_raises():
    """The collective runs on a thread of its own, waited for at most the barrier timeout: one
    that fails raises DeviceError, one that hangs BarrierTimeoutError (and the caller goes on)."""
    import time

    from treestore._engine.reading import share
    from treestore.errors import BarrierTimeoutError, DeviceError

    def failing() -> None:
        raise ValueError("Gloo all-reduce failed: Connection closed by peer")

    with pytest.raises(DeviceError, match="Connection closed by peer") as caught:
        share._bounded(failing, 5.0, "c")
    assert caught.value.checkpoint == "c"
    started = time.monotonic()
    with pytest.raises(BarrierTimeoutError, match=r"did not finish within 0\.2 s"):
        share._bounded(lambda: time.sleep(3), 0.2, "c")
    assert time.monotonic() - started < 2
    assert share._bounded(lambda: np.arange(3), 5.0, "c").tolist() == [0, 1, 2]
