"""What the machine's components alone allow for a tree: the LIMIT row of the benchmark tables.

Each component treestore's pipeline is made of is timed on the tree's own bytes, cut into chunks
as a save cuts them (``SaveOptions().chunk_size``), with the functions treestore itself calls:

* save: BLAKE3 of every chunk, the byte-plane transform of float chunks, zstd of each plane as
  the codec compresses it (planes a sample says do not pay are not compressed), and one file
  write + fsync of the stored bytes;
* load: one read of that file, zstd decompression of the compressed planes, the inverse
  transform into a fresh result (one array per leaf, all kept until the end, as a load returns
  them: faulting their pages in is part of the time), and BLAKE3 of the result (the digest
  check);
* one leaf: the load side for that leaf's bytes only.

The limit is the sum of a side's component times split over the cores (``os.cpu_count()``):
what a pipeline that keeps every core busy with nothing but these components would take.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from treestore._engine.reading.memory import allocate
from treestore._engine.write import SaveOptions
from treestore._format import codecs as C
from treestore._kernels import planes as P
from treestore._kernels.digest import digest
from treestore._kernels.scratch import scratch

from . import trees as T


def _chunks(a: np.ndarray, chunk_size: int) -> list[tuple[np.ndarray, int]]:
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    item = a.dtype.itemsize
    step = max(item, chunk_size // item * item)
    width = C.plane_width(a.dtype)
    return [(raw[i : i + step], width) for i in range(0, raw.nbytes, step)]


def _timed(acc: dict[str, float], key: str, fn: Any, *args: Any) -> Any:
    t0 = time.perf_counter()
    out = fn(*args)
    acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
    return out


def encode(leaves: list[np.ndarray], t: dict[str, float]) -> list[list[Any]]:
    """The save side's CPU components, timed into ``t``: what each chunk stores. One entry per
    leaf (``[None, nbytes]``: its result is allocated there on load), then per chunk
    ``[width, size, stored parts, which parts are compressed]``."""
    codec = C.Codec()
    chunk_size = SaveOptions().chunk_size
    stored: list[list[Any]] = []
    for leaf in leaves:
        stored.append([None, leaf.nbytes])
        for raw, width in _chunks(leaf, chunk_size):
            _timed(t, "hash", digest, raw)
            if width >= 2 and raw.nbytes % width == 0:
                planes = scratch(raw.nbytes).reshape(width, -1)  # reused, as a save reuses it
                _timed(t, "transform", P.split_planes, raw, planes, width)
                parts = [_timed(t, "compress", C._maybe_compress, p, codec.level) for p in planes]
                kept = [p if p is not None else planes[j].tobytes() for j, p in enumerate(parts)]
                stored.append([width, raw.nbytes, kept, [p is not None for p in parts]])
            else:
                packed = _timed(t, "compress", C._maybe_compress, raw, codec.level)
                kept = [packed if packed is not None else raw.tobytes()]
                stored.append([0, raw.nbytes, kept, [packed is not None]])
    return stored


def stored_bytes(stored: list[list[Any]]) -> list[bytes]:
    """The bytes ``encode`` stores, in order: what the write and read components move."""
    return [b for s in stored if s[0] is not None for b in s[2]]


def components(leaves: list[np.ndarray], tmp_dir: str) -> dict[str, float]:
    """Seconds each component takes, on one core, for the bytes of ``leaves``."""
    t: dict[str, float] = {}
    stored = encode(leaves, t)
    path = os.path.join(tmp_dir, "limit-probe")
    body = stored_bytes(stored)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for b in body:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    t["write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        at = 0
        for b in body:
            os.pread(fd, len(b), at)
            at += len(b)
    finally:
        os.close(fd)
    t["read"] = time.perf_counter() - t0
    os.unlink(path)
    results: list[np.ndarray] = []  # kept, as a load returns every leaf
    for chunk in stored:
        if chunk[0] is None:
            results.append(allocate(chunk[1], "", "limit"))  # a fresh result, as a load allocates it
            at = 0
            continue
        width, size, parts, packed = chunk
        out = results[-1][at : at + size]
        at += size
        if width:
            planes = scratch(size, "planes").reshape(width, -1)
            for j, part in enumerate(parts):
                if packed[j]:
                    _timed(t, "decompress", C._unzstd_into, part, planes[j])
                else:
                    planes[j] = np.frombuffer(part, np.uint8)
            _timed(t, "untransform", P.join_planes, planes.reshape(-1), out, width)
        elif packed[0]:
            _timed(t, "decompress", C._unzstd_into, parts[0], out)
        else:
            _timed(t, "untransform", np.copyto, out, np.frombuffer(parts[0], np.uint8))
        _timed(t, "verify", digest, out)
    return t


SAVE = ("hash", "transform", "compress", "write")
LOAD = ("read", "decompress", "untransform", "verify")


def limits(
    tree: T.Tree, key: str, tmp_dir: str, cores: int | None = None, median: str | None = None
) -> dict[str, float]:
    """The LIMIT row for ``tree``: ``save_s``, ``load_s``, ``one_s`` (the leaf ``key``),
    ``median_s`` (the leaf ``median``, when given), and each component's seconds
    (``save.hash`` ...)."""
    cores = cores or os.cpu_count() or 1
    whole = components(list(T.flatten(tree).values()), tmp_dir)
    one = components([T.get_leaf(tree, key)], tmp_dir)
    out = {
        "save_s": sum(whole.get(k, 0.0) for k in SAVE) / cores,
        "load_s": sum(whole.get(k, 0.0) for k in LOAD) / cores,
        "one_s": sum(one.get(k, 0.0) for k in LOAD) / cores,
    }
    if median is not None:
        small = components([T.get_leaf(tree, median)], tmp_dir)
        out["median_s"] = sum(small.get(k, 0.0) for k in LOAD) / cores
    out.update({f"c.{k}": v for k, v in whole.items()})
    return out
