"""Hostile stores served by the object-store backends (S3, GCS, Azure Blob).

Each case damages the local hostile copy (the ``store`` fixture) exactly as the local attack
tests do, uploads every object of the damaged store to a real local server (moto, the GCS
emulator, azurite; tests/support/servers.py) and runs every reader operation against the cloud URL with
its storage options. The local guards of _harness.check_readers (an audit hook on files, which
would also block the sockets a cloud client needs) do not apply to a remote store, so the
checks here are the remote counterparts:

- each operation either succeeds or raises a TreestoreError; never anything else, never a
  StorageError for what is damage, and a corruption error names the damaged checkpoint ``bad``
  (and, for a chunk, the leaf's address);
- ``treestore.verify`` reports the damage, and only the damage;
- readers change nothing in the bucket, and nothing outside the store's prefix is ever touched;
- ``Store.gc()`` never deletes what ``good`` needs: ``good`` loads bit-exact afterwards;
- with a memory bound where the attack is about size.

Each test uploads under a fresh prefix of the (per-test emptied) bucket: the GCS emulator can
serve an earlier test's bytes for an object re-created at the same path after a wipe.
"""

from __future__ import annotations

import base64
import hashlib
import os
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
import pytest

import treestore

from ..support import hostile
from ._harness import MiB, _clear, _read_lazily, memory_peak

BACKENDS = ["s3", "gcs", "azure"]
ERR = treestore.errors
DAMAGE = (treestore.DamagedError, treestore.UnsupportedFormatError)
CHUNK_OPS = ("load", "load newest", "load select", "open", "diff")  # every op that reads bad's chunks
OUTSIDE = {"outside/secret.txt": b"secret", "store-evil/secret.txt": b"secret"}


@dataclass
class Expect:
    """What the readers must find in the damaged store."""

    error: type[treestore.TreestoreError] | tuple[type[treestore.TreestoreError], ...]
    address: str | None = None  # the leaf a chunk error (and each verify problem) names
    kind: str | None = None  # the VerifyProblem.kind of every problem verify reports
    listed: list[str] = field(default_factory=lambda: ["good", "bad"])
    message: str | None = None  # a word the load error must contain
    memory: int | None = None  # a bound on traced allocations of each reader op


# --- the attacks: each damages the local copy as the local test does ---------------------------------
def _rel(store: Any, path: os.PathLike[str]) -> str:
    return os.path.relpath(path, store.root).replace(os.sep, "/")


def flipped_byte(store: Any) -> Expect:  # hostile.flip_byte, as test_damage_fuzz does
    hostile.flip_byte(store.url, _rel(store, store.chunk_file("w", 0)), 100)
    return Expect(ERR.ChunkDamagedError, "w", "chunk_damaged")


def truncated_chunk(store: Any) -> Expect:
    path = store.chunk_file("ids", 0)
    hostile.truncate(store.url, _rel(store, path), path.stat().st_size // 2)
    return Expect(ERR.ChunkDamagedError, "ids", "chunk_damaged")


def missing_chunk(store: Any) -> Expect:  # a 404 from the server is a missing chunk, not a StorageError
    store.chunk_file("w", 1).unlink()
    return Expect(ERR.ChunkMissingError, "w", "chunk_missing")


def swapped_chunk(store: Any) -> Expect:  # test_foreign_chunks: test_object_swapped_for_another_chunk
    a, b = store.chunk_file("w", 0), store.chunk_file("ids", 0)
    a.write_bytes(b.read_bytes())
    return Expect(ERR.ChunkDamagedError, "w", "chunk_damaged")


def unknown_codec(store: Any) -> Expect:  # test_formats: test_unknown_chunk_codec
    path = store.chunk_file("w")
    data = bytearray(path.read_bytes())
    data[4] = 127
    path.write_bytes(bytes(data))
    return Expect((ERR.ChunkDamagedError, treestore.UnsupportedFormatError), "w", message="codec id 127")


def oversized_chunk(store: Any) -> Expect:  # test_sizes: test_chunk_object_larger_than_its_raw_size_allows
    from treestore._format.limits import CHUNK_SLACK

    path = store.chunk_file("ids")
    obj = path.read_bytes()
    size = int.from_bytes(obj[8:16], "little")
    path.write_bytes(obj + b"\xff" * (size + CHUNK_SLACK + 6 * MiB - len(obj)))  # 6 MiB over
    return Expect(ERR.ChunkDamagedError, "ids", "chunk_damaged", memory=4 * MiB)


def manifest_field(store: Any) -> Expect:  # test_sizes: test_absurd_shape (a sealed, consistent record)
    store.mutate_manifest(hostile.set_leaf("w", shape=[2**49]))
    return Expect(ERR.ManifestDamagedError, kind="manifest", memory=64 * MiB)


def hostile_address(store: Any) -> Expect:  # test_addresses: test_leaf_address_that_is_not_its_tree_position
    store.mutate_manifest(
        lambda m: next(x for x in m["leaves"] if x["address"] == "py/n").update(address="../../outside")
    )
    return Expect(ERR.ManifestDamagedError, kind="manifest")


def truncated_record(store: Any) -> Expect:  # test_msgpack: test_every_truncation_of_a_commit_record...
    data = store.ref_bytes()
    store.write_ref(raw=data[: len(data) // 2])
    return Expect(ERR.ManifestDamagedError, kind="commit_record", listed=["good"])


def record_over_the_bound(store: Any) -> Expect:  # test_sizes: ..._declaring_a_manifest_over_the_bound
    store.write_ref({**store.ref_record(), "manifest_size": 2**40})
    return Expect(ERR.ManifestDamagedError, listed=["good"], message="manifest_size", memory=64 * MiB)


ATTACKS: dict[str, Callable[[Any], Expect]] = {
    f.__name__.replace("_", " "): f
    for f in (
        flipped_byte,
        truncated_chunk,
        missing_chunk,
        swapped_chunk,
        unknown_codec,
        oversized_chunk,
        manifest_field,
        hostile_address,
        truncated_record,
        record_over_the_bound,
    )
}


# --- the remote store -----------------------------------------------------------------------------------
def _upload(fs: Any, base: str, store: Any) -> dict[str, bytes]:
    """Every object of the local store under ``base``/store (relative paths kept), and the decoys
    next to it under ``base``; what was uploaded, by URL."""
    objects: dict[str, bytes] = {}
    for d, _, files in os.walk(store.root):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), store.root).replace(os.sep, "/")
            with open(os.path.join(d, f), "rb") as fh:
                objects[f"{base}/store/{rel}"] = fh.read()
    objects.update({f"{base}/{k}": v for k, v in OUTSIDE.items()})
    # The GCS emulator drops the last byte of a one-request upload that ends in CR (the reason
    # GCSStorage._upload sends those as a resumable upload): upload them the same way.
    ending_in_cr = {u: d for u, d in objects.items() if u.startswith("gs://") and d.endswith(b"\r")}
    with warnings.catch_warnings():  # aiohttp warns of bodies over 1 MiB sent as bytes
        warnings.simplefilter("ignore", ResourceWarning)
        fs.pipe({u: d for u, d in objects.items() if u not in ending_in_cr})
        for u, d in ending_in_cr.items():
            fs.pipe_file(u, d, chunksize=len(d))
    fs.invalidate_cache()
    return objects


def _digest_of(entry: dict[str, Any]) -> str | None:
    """The MD5 a listing entry gives (S3's ETag of a single-part upload, GCS's md5Hash), as hex."""
    if "md5Hash" in entry:
        return base64.b64decode(entry["md5Hash"]).hex()
    etag = str(entry.get("ETag", "")).strip('"')
    return etag if len(etag) == 32 else None


def _check_upload(fs: Any, uploaded: dict[str, bytes]) -> None:
    """The server holds exactly what was uploaded (so a failure below is the reader's)."""
    fs.invalidate_cache()
    root = next(iter(uploaded)).split("://", 1)[0] + "://"
    listed = {
        root + p: e for p, e in fs.find(next(iter(uploaded)).rsplit("/store/", 1)[0], detail=True).items()
    }
    assert sorted(listed) == sorted(uploaded), sorted(set(listed) ^ set(uploaded))
    for u, data in uploaded.items():
        assert int(listed[u]["size"]) == len(data), u
        md5 = _digest_of(listed[u])
        assert md5 is None or md5 == hashlib.md5(data).hexdigest(), u


# what changes when an object is rewritten: S3's ETag and LastModified, GCS's generation and
# md5Hash, Azure's etag and last_modified
_STAMPS = ("size", "ETag", "LastModified", "generation", "md5Hash", "etag", "last_modified")


def _objects(fs: Any, bucket: str) -> dict[str, tuple[Any, ...]]:
    """Every object in the bucket and its stamps (one listing, no reads: the GCS emulator is slow)."""
    fs.invalidate_cache()
    return {p: tuple(str(e.get(k)) for k in _STAMPS) for p, e in fs.find(bucket, detail=True).items()}


def reader_ops(url: str, opts: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    store = treestore.Store(url, storage_options=opts)
    return {
        "list": lambda: [c.name for c in store.list()],
        "latest": store.latest,
        "manifest": lambda: store.manifest("bad"),
        "load": lambda: store.load("bad"),
        "load newest": lambda: treestore.load(url, storage_options=opts),
        "load select": lambda: store.load("bad", select="**"),
        "open": lambda: _read_lazily(store.open("bad")),
        "verify": lambda: treestore.verify(f"{url}#bad", storage_options=opts),
        "verify all": lambda: treestore.verify(url, storage_options=opts),
        "diff": lambda: treestore.diff(
            f"{url}#good", f"{url}#bad", values=True, storage_options=opts
        ).to_json(),
    }


def _same(a: Any, b: Any) -> bool:
    """Bit-exact equality of two loaded trees (structure, types, dtypes, shapes, bytes)."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if type(x) is not type(y):
            return False
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            if str(jax.random.key_impl(x)) != str(jax.random.key_impl(y)):
                return False
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if hasattr(x, "dtype"):
            x, y = np.asarray(x), np.asarray(y)
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return False
        elif x != y:
            return False
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attack", list(ATTACKS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_hostile_store_on_a_cloud_backend(request, store, backend, attack):
    good = treestore.load(store.url, "good")  # from the undamaged local copy
    expect = ATTACKS[attack](store)
    server = request.getfixturevalue(f"{backend}_backend")
    opts = dict(server.storage_options)
    fs = server.filesystem()
    base = server.url(f"t-{uuid.uuid4().hex[:8]}")  # fresh prefix: never an earlier test's object
    url = f"{base}/store"
    _check_upload(fs, _upload(fs, base, store))
    treestore.Store(url, storage_options=opts).list()  # warm up the client outside the memory bound
    before = _objects(fs, server.url_root)

    problems: list[str] = []
    outcomes: dict[str, Any] = {}
    for op, fn in reader_ops(url, opts).items():
        with memory_peak(expect.memory is not None) as peak:
            try:
                outcomes[op] = fn()
            except treestore.TreestoreError as exc:
                outcomes[op] = exc
            except Exception as exc:
                problems.append(f"{op}: {type(exc).__name__} escaped: {str(exc)[:300]}")
                continue
        if expect.memory is not None and peak[0] > expect.memory:
            problems.append(
                f"{op}: allocated {peak[0] / MiB:.0f} MiB at the peak (bound {expect.memory / MiB:.0f})"
            )
        out = outcomes[op]
        if not isinstance(out, treestore.TreestoreError):
            continue
        if _clear(out):
            problems.append(f"{op}: {type(out).__name__} {_clear(out)}: {out}")
        if not isinstance(out, DAMAGE):
            problems.append(f"{op}: damage raised {type(out).__name__}, not a corruption error: {out}")
        elif out.checkpoint != "bad":
            problems.append(
                f"{op}: {type(out).__name__} names checkpoint {out.checkpoint!r}, not 'bad': {out}"
            )
    assert not problems, f"{backend}, {attack}:\n" + "\n".join(problems)

    # what each operation found
    load = outcomes["load"]
    assert isinstance(load, expect.error), f"load: {load!r}"
    if expect.address is not None:
        assert load.address == expect.address, load
    if expect.message is not None:
        assert expect.message in str(load), load
    chunk_ops = list(CHUNK_OPS)
    if "bad" not in expect.listed:  # left out: the newest readable checkpoint is good
        chunk_ops.remove("load newest")
        assert _same(outcomes["load newest"], good), outcomes["load newest"]
    assert outcomes["latest"] == expect.listed[-1], outcomes["latest"]
    for op in (*chunk_ops, "manifest" if expect.address is None else "load"):
        assert isinstance(outcomes[op], treestore.TreestoreError), (
            f"{op} read the damaged checkpoint: {outcomes[op]!r}"
        )
    if expect.address is not None:  # the manifest is sound; every chunk read names the leaf
        assert not isinstance(outcomes["manifest"], treestore.TreestoreError), outcomes["manifest"]
        assert {op: outcomes[op].address for op in chunk_ops} == dict.fromkeys(chunk_ops, expect.address)
    assert outcomes["list"] == expect.listed, outcomes["list"]

    reports = [outcomes[op] for op in ("verify", "verify all") if not isinstance(outcomes[op], Exception)]
    assert outcomes["verify all"] in reports, f"verify all raised: {outcomes['verify all']!r}"
    for report in reports:
        assert report.problems, f"verify found nothing wrong: {report}"
        for p in report.problems:
            assert p.checkpoint == "bad" and p.message, p
            if expect.kind is not None:
                assert p.kind == expect.kind, p
        if expect.address is not None:  # exactly the damaged leaf, nothing else
            assert {(p.checkpoint, p.address, p.kind) for p in report.problems} == {
                ("bad", expect.address, expect.kind or report.problems[0].kind)
            }, report.problems

    # readers changed nothing, anywhere in the bucket
    assert _objects(fs, server.url_root) == before, "a reader changed the bucket"

    # gc keeps what good needs, and nothing outside the store
    treestore.Store(url, storage_options=opts).gc(grace=0)
    after = _objects(fs, server.url_root)
    prefix = base.split("://", 1)[1]
    outside = {k: v for k, v in after.items() if not k.startswith(f"{prefix}/store/")}
    assert outside == {k: before[k] for k in outside} and len(outside) == len(OUTSIDE), outside
    decoys = {f"{prefix}/{k}": v for k, v in OUTSIDE.items()}
    assert {k.split("://", 1)[-1]: v for k, v in fs.cat(list(decoys)).items()} == decoys
    assert _same(treestore.load(url, "good", storage_options=opts), good), "good changed after gc"
    report = treestore.verify(f"{url}#good", storage_options=opts)
    assert report.ok, report.problems
    # bad is damaged, not gone: gc keeps its objects too (here every object is referenced, or
    # bad cannot be read and gc must not guess what it references)
    assert after == before, sorted(set(before) - set(after))
