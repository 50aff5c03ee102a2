"""One conformance suite, run on every backend: local folders, ``memory://``, S3 (moto), GCS (the
emulator), Azure Blob (azurite) and HTTP (read-only).

:class:`StoreConformance` holds the tests; each ``Test<Backend>`` subclass runs them on one backend
through the ``target`` fixture. The servers are real, started once per session on free 127.0.0.1
ports (tests/support/servers.py, registered in tests/conftest.py), and emptied before each test. Without a
server's package or binary its class is skipped locally and fails under ``CI=true``.

The HTTP variant writes its store into the served folder with a local path and then reads it only
through the ``http://`` URL; every write through that URL must fail with a read-only StorageError.
On the GCS emulator the commit race is an expected failure (xfail, strict): the emulator ignores
``ifGenerationMatch=0``, so two racing writers both commit there (SPEC.md §2.2, §5.2).
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import fsspec
import ml_dtypes
import numpy as np
import pytest

import treestore
from tests.support.helpers import assert_tree_equal
from treestore._format import paths as _paths
from treestore._storage.base import Storage
from treestore._storage.registry import local_root

OPTIONS = treestore.SaveOptions(chunk_size=64 * 1024)
CHUNK = 64 * 1024
GCS_RACE = (
    "the GCS emulator ignores ifGenerationMatch=0, so two writers that both passed the existence "
    "check both commit (the later record wins); real GCS enforces the precondition (SPEC.md §2.2, §5.2)"
)


# -- the stores under test ---------------------------------------------------------------------------
@dataclass
class Target:
    """A fresh, empty store on one backend.

    ``url``/``options`` is where writes go; ``read_url``/``read_options`` where reads go. They are
    the same except for HTTP, whose store is written to the served folder by a local path.
    """

    backend: str
    url: str
    options: dict[str, Any]
    read_url: str
    read_options: dict[str, Any]
    writable: bool = True  # whether read_url takes writes
    # An extra, harmless storage option per backend, to prove options reach the filesystem.
    probe_option: dict[str, Any] = field(default_factory=dict)

    def store(self) -> treestore.Store:
        return treestore.Store(self.url, storage_options=self.options)

    def reader(self) -> treestore.Store:
        return treestore.Store(self.read_url, storage_options=self.read_options)

    def spec(self, name: str) -> str:
        return f"{self.read_url}#{name}"


def make_target(backend: str, request: pytest.FixtureRequest, tmp_path: Any) -> Target:
    unique = f"store-{uuid.uuid4().hex[:8]}"
    if backend == "local":
        path = str(tmp_path / unique)
        return Target(backend, path, {}, path, {}, probe_option={"auto_mkdir": True})
    if backend == "memory":
        url = f"memory://treestore-conformance/{unique}"
        return Target(backend, url, {}, url, {}, probe_option={"skip_instance_cache": True})
    server = request.getfixturevalue(f"{backend}_backend")
    if backend == "http":
        local = f"{server.local_dir}/{unique}"
        return Target(
            backend,
            local,
            {},
            server.url(unique),
            dict(server.storage_options),
            writable=False,
            probe_option={"headers": {"User-Agent": "treestore-conformance"}},
        )
    probe: dict[str, Any] = {
        "s3": {"config_kwargs": {"connect_timeout": 5}},
        "gcs": {"timeout": 30},
        "azure": {"max_concurrency": 2},
    }[backend]
    url = server.url(unique)
    return Target(backend, url, dict(server.storage_options), url, dict(server.storage_options), True, probe)


# -- trees -------------------------------------------------------------------------------------------
def mixed_tree(seed: int = 0) -> dict[str, Any]:
    """A big leaf cut into 4 chunks (64 KiB each), 100 small leaves packed together, scalars."""
    rng = np.random.default_rng(seed)
    return {
        "big": rng.standard_normal((1024, 64)).astype(np.float32),  # 256 KiB: 4 chunks
        "layers": [{"w": np.full(8, i, np.float32), "b": np.int32(i), "step": i} for i in range(100)],
        "bf16": np.arange(16, dtype=np.float32).astype(ml_dtypes.bfloat16),
        "empty": np.zeros((0, 3), np.float64),
        "meta": ("run", 1.5, None, True),
    }


def changed_tree(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` with one chunk of ``big`` changed, ``bf16`` removed and ``extra`` added."""
    big = base["big"].copy()
    big[300] += 1.0  # row 300 lies in chunk 1 (rows 256..511)
    out = {k: v for k, v in base.items() if k != "bf16"}
    out["big"] = big
    out["extra"] = np.ones(3, np.int64)
    return out


def chunk_paths(manifest: treestore.types.Manifest, address: str) -> list[str]:
    entry = next(e for e in manifest.leaves if e.address == address)
    return [_paths.chunk_path(c.digest) for c in entry.chunks]


def chunk_digests_in(storage: Storage) -> set[bytes]:
    found = {_paths.parse_chunk(o.path) for o in storage.list(_paths.CHUNKS)}
    return {d for d in found if d is not None}


def read_only(exc: pytest.ExceptionInfo[BaseException]) -> bool:
    return isinstance(exc.value, treestore.StorageError) and "read-only" in str(exc.value)


# -- the suite ---------------------------------------------------------------------------------------
class StoreConformance:
    """Every store operation, the same way on every backend."""

    backend: ClassVar[str]

    @pytest.fixture
    def target(self, request: pytest.FixtureRequest, tmp_path: Any) -> Target:
        return make_target(self.backend, request, tmp_path)

    # -- save / load ------------------------------------------------------------------------------
    def test_roundtrip_mixed_tree(self, target: Target) -> None:
        tree = mixed_tree()
        result = target.store().save(tree, "step-1", options=OPTIONS, metadata={"step": 1})
        assert result.leaves == 1 + 300 + 1 + 1 + 3  # big, layers, bf16, empty, meta (None is a node)
        assert result.chunks_written == 4 + 1  # big's four chunks and one pack of the small leaves
        objects = target.store()._storage.list(_paths.CHUNKS)
        assert len(objects) == 5  # 301 small leaves never became one object each
        assert {o.path for o in objects} >= {*chunk_paths(target.store().manifest("step-1"), "big")}
        assert_tree_equal(target.reader().load("step-1"), tree)
        assert_tree_equal(treestore.load(target.read_url, storage_options=target.read_options), tree)

    def test_second_save_writes_no_new_chunk(self, target: Target) -> None:
        tree = mixed_tree()
        first = target.store().save(tree, "a", options=OPTIONS)
        again = target.store().save(tree, "b", options=OPTIONS)
        assert (again.chunks_written, again.bytes_written) == (0, 0)
        assert again.chunks_reused == first.chunks_written
        assert len(target.store()._storage.list(_paths.CHUNKS)) == first.chunks_written
        assert_tree_equal(target.reader().load("b"), tree)

    def test_list_metadata_latest(self, target: Target) -> None:
        store = target.store()
        store.save(mixed_tree(), "a", options=OPTIONS, metadata={"step": 1, "loss": 0.5})
        time.sleep(0.01)
        store.save({"x": np.arange(5)}, "b", metadata={"step": 2})
        reader = target.reader()
        infos = reader.list()
        assert [i.name for i in infos] == ["a", "b"]
        assert infos[0].metadata == {"step": 1, "loss": 0.5}
        assert infos[1].metadata == {"step": 2}
        assert (infos[1].leaves, infos[1].nbytes) == (1, 40)
        assert infos[0].created <= infos[1].created
        assert reader.latest() == "b"
        assert reader.exists("a") and not reader.exists("zzz")
        assert_tree_equal(reader.load(), {"x": np.arange(5)})  # newest by default
        assert reader.manifest().name == "b"

    def test_missing_checkpoint(self, target: Target) -> None:
        reader = target.reader()
        assert reader.list() == []
        with pytest.raises(
            treestore.errors.CheckpointNotFoundError, match=r"no checkpoints in store|no treestore store at"
        ):
            reader.latest()
        with pytest.raises(treestore.errors.CheckpointNotFoundError):
            treestore.load(target.read_url, storage_options=target.read_options)
        target.store().save({"x": 1}, "a")
        with pytest.raises(treestore.errors.CheckpointNotFoundError, match="'nope'") as exc:
            reader.load("nope")
        assert exc.value.checkpoint == "nope"
        with pytest.raises(treestore.errors.CheckpointNotFoundError, match="'nope'"):
            treestore.open(target.read_url, "nope", storage_options=target.read_options)
        with pytest.raises(treestore.errors.CheckpointNotFoundError):
            treestore.diff(target.spec("a"), target.spec("nope"), storage_options=target.read_options)

    def test_overwrite_refused_then_allowed(self, target: Target) -> None:
        store = target.store()
        store.save({"x": np.zeros(3)}, "a")
        if not target.writable:
            with pytest.raises(treestore.errors.CheckpointExistsError):
                target.reader().save({"x": np.ones(3)}, "a")
            with pytest.raises(treestore.StorageError) as exc:
                target.reader().save({"x": np.ones(3)}, "a", overwrite=True)
            assert read_only(exc)
            assert_tree_equal(target.reader().load("a"), {"x": np.zeros(3)})
            return
        with pytest.raises(treestore.errors.CheckpointExistsError, match="overwrite=True") as exc2:
            target.reader().save({"x": np.ones(3)}, "a")
        assert exc2.value.checkpoint == "a"
        assert_tree_equal(target.reader().load("a"), {"x": np.zeros(3)})
        target.reader().save({"x": np.ones(3)}, "a", overwrite=True)
        assert_tree_equal(target.reader().load("a"), {"x": np.ones(3)})
        assert [i.name for i in target.reader().list()] == ["a"]

    # -- delete / gc ------------------------------------------------------------------------------
    def test_delete_and_gc(self, target: Target) -> None:
        base = mixed_tree()
        store = target.store()
        store.save(base, "a", options=OPTIONS)
        store.save(changed_tree(base), "b", options=OPTIONS)
        reader = target.reader()
        if not target.writable:
            for op in (lambda: reader.delete("a"), lambda: reader.gc(grace=0)):
                with pytest.raises(treestore.StorageError) as exc:
                    op()
                assert read_only(exc)
            assert [i.name for i in reader.list()] == ["a", "b"]
            return
        before = chunk_digests_in(store._storage)
        reader.delete("a")
        assert [i.name for i in reader.list()] == ["b"]
        with pytest.raises(treestore.errors.CheckpointNotFoundError):
            reader.load("a")
        with pytest.raises(treestore.errors.CheckpointNotFoundError):
            reader.delete("a")
        young = reader.gc()  # default grace: everything was written just now
        assert (young.chunks_removed, young.manifests_removed) == (0, 0) and young.kept_young > 0
        report = reader.gc(grace=0)
        live = reader.manifest("b").chunk_digests()
        assert report.chunks_removed == len(before - live) > 0  # a's old chunk 1 and bf16's pack
        assert report.manifests_removed == 1
        assert chunk_digests_in(store._storage) == live
        assert store._storage.list(_paths.LOCKS) == []
        assert_tree_equal(reader.load("b"), changed_tree(base))

    # -- partial reads ----------------------------------------------------------------------------
    def test_select_reads_only_that_leaf(self, target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
        tree = mixed_tree()
        target.store().save(tree, "a", options=OPTIONS)
        reader = target.reader()
        manifest = reader.manifest("a")
        reads: list[tuple[str, int, int]] = []
        original = Storage.read_range

        def counting(self: Storage, path: str, start: int, end: int) -> bytes | None:
            reads.append((path, start, end))
            return original(self, path, start, end)

        monkeypatch.setattr(Storage, "read_range", counting)
        out = reader.load("a", select="big")
        assert list(out) == ["big"]
        assert_tree_equal(out["big"], tree["big"])
        chunk_reads = sorted(p for p, _, _ in reads if p.startswith(_paths.CHUNKS))
        assert chunk_reads == sorted(chunk_paths(manifest, "big"))  # each of its chunks, once
        reads.clear()
        part = reader.load("a", select=["layers/7/*"])
        assert_tree_equal(part, {"layers": [tree["layers"][7]]})  # pruned to what was selected
        assert len([p for p, _, _ in reads if p.startswith(_paths.CHUNKS)]) == 1  # the pack

    def test_lazy_slices(self, target: Target) -> None:
        tree = mixed_tree()
        target.store().save(tree, "a", options=OPTIONS)
        ckpt = treestore.open(target.read_url, storage_options=target.read_options)
        assert ckpt.name == "a" and ckpt.bytes_read == 0
        leaf = ckpt["big"]
        assert (leaf.shape, leaf.dtype) == ((1024, 64), np.float32)
        np.testing.assert_array_equal(leaf[10:20], tree["big"][10:20])
        first_chunk = leaf.entry.chunks[0]
        assert 0 < ckpt.bytes_read <= first_chunk.stored_size + 200  # one chunk, not the leaf
        np.testing.assert_array_equal(leaf[-1], tree["big"][-1])
        np.testing.assert_array_equal(leaf[250:260, 3], tree["big"][250:260, 3])  # two chunks
        np.testing.assert_array_equal(np.asarray(leaf), tree["big"])
        np.testing.assert_array_equal(ckpt["layers/42/w"][2:5], tree["layers"][42]["w"][2:5])
        assert ckpt["layers/42/step"] == 42
        with pytest.raises(treestore.errors.NoMatchError):
            ckpt["bigg"]
        named = treestore.open(target.read_url, "a", storage_options=target.read_options)
        np.testing.assert_array_equal(named["bf16"][3:5], tree["bf16"][3:5])

    # -- diff -------------------------------------------------------------------------------------
    def test_diff_two_checkpoints(self, target: Target) -> None:
        base = mixed_tree()
        store = target.store()
        store.save(base, "a", options=OPTIONS)
        store.save(changed_tree(base), "b", options=OPTIONS)
        d = treestore.diff(target.spec("a"), target.spec("b"), storage_options=target.read_options)
        assert (d.changed, d.added, d.removed) == (("big",), ("extra",), ("bf16",))
        (big,) = d.by_status("changed")
        assert big.chunks_changed == 0.25
        stats = treestore.diff(
            target.spec("a"), target.spec("b"), values=True, storage_options=target.read_options
        )
        (big_stats,) = stats.by_status("changed")
        assert big_stats.change is not None and big_stats.change.max_abs == pytest.approx(1.0)
        same = treestore.diff(target.spec("a"), target.spec("a"), storage_options=target.read_options)
        assert not same and same.to_json()["identical"]

    def test_diff_across_backends(self, target: Target, tmp_path: Any) -> None:
        base = mixed_tree()
        target.store().save(base, "a", options=OPTIONS)
        local = str(tmp_path / "other-store")
        treestore.save(local, base, "same")
        treestore.Store(local).save(changed_tree(base), "changed", options=OPTIONS)
        here = treestore.open(target.read_url, "a", storage_options=target.read_options)
        d = treestore.diff(here, treestore.open(local, "same"))  # default chunk size there: by data
        assert not d, d.table()
        d = treestore.diff(here, f"{local}#changed")
        assert (d.changed, d.added, d.removed) == (("big",), ("extra",), ("bf16",))
        assert d.a.startswith(target.read_url)

    # -- damage -----------------------------------------------------------------------------------
    def test_damaged_chunk_is_detected(self, target: Target) -> None:
        tree = mixed_tree()
        store = target.store()
        store.save(tree, "a", options=OPTIONS)
        paths = chunk_paths(store.manifest("a"), "big")
        # Swap in another valid chunk object of the same raw size: it decodes, but to other bytes.
        other = store._storage.read(paths[2])
        assert other is not None
        store._storage.write(paths[1], [other])
        with pytest.raises(treestore.errors.ChunkDamagedError, match="does not match its digest") as exc:
            target.reader().load("a")
        assert exc.value.address == "big" and "big" in str(exc.value)
        assert exc.value.checkpoint == "a"
        ckpt = treestore.open(target.read_url, "a", storage_options=target.read_options)
        np.testing.assert_array_equal(ckpt["big"][:256], tree["big"][:256])  # chunk 0 is fine
        with pytest.raises(treestore.errors.ChunkDamagedError, match="big"):
            ckpt["big"][300]
        store._storage.write(paths[1], [b"TSC1 garbage"])
        with pytest.raises(treestore.errors.ChunkDamagedError, match="big"):
            target.reader().load("a", select="big")
        store._storage.delete(paths[1])
        with pytest.raises(treestore.errors.ChunkMissingError, match="big"):
            target.reader().load("a")

    # -- commit races -----------------------------------------------------------------------------
    def test_put_if_absent_race(self, target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
        """Two writers commit the same new name at the same moment: exactly one wins."""
        stores = [target.store(), target.store()]
        commit = threading.Barrier(2, timeout=20)
        for s in stores:
            monkeypatch.setattr(s._storage, "write_new", _after(commit, s._storage.write_new))
        if target.backend in ("s3", "gcs", "azure"):
            # Both past any existence check before either PUT is sent.
            put = threading.Barrier(2, timeout=20)
            for fs in {id(s._storage.fs): s._storage.fs for s in stores}.values():
                pipe = fs.pipe_file
                monkeypatch.setattr(
                    fs, "pipe_file", _after(put, pipe, when=lambda p, *a, **k: "/checkpoints/" in p)
                )
        trees = [{"w": np.full(4, i, np.float32)} for i in range(2)]
        outcome: list[Any] = [None, None]

        def run(i: int) -> None:
            try:
                outcome[i] = stores[i].save(trees[i], "race")
            except Exception as exc:
                outcome[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        won = [i for i in range(2) if isinstance(outcome[i], treestore.types.SaveResult)]
        lost = [o for o in outcome if isinstance(o, treestore.errors.CheckpointExistsError)]
        assert len(won) == 1 and len(lost) == 1, outcome
        assert "another writer" in str(lost[0])
        assert_tree_equal(target.reader().load("race"), trees[won[0]])

    # -- options, copy, verify --------------------------------------------------------------------
    def test_storage_options_pass_through(self, target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
        seen: list[tuple[str, dict[str, Any]]] = []
        original = fsspec.core.url_to_fs

        def spy(url: str, **kwargs: Any) -> Any:
            seen.append((url, kwargs))
            return original(url, **kwargs)

        monkeypatch.setattr(fsspec.core, "url_to_fs", spy)
        wopts = {**target.options, **(target.probe_option if target.writable else {})}
        ropts = {**target.read_options, **target.probe_option}
        tree = {"w": np.arange(10.0), "n": 3}

        def used(url: str, opts: dict[str, Any]) -> bool:
            found = [kw for u, kw in seen if u == url]
            seen.clear()
            if not opts and local_root(url) is not None:
                return not found  # a plain path without options opens without fsspec
            return bool(found) and all(kw.get(k) == v for kw in found for k, v in opts.items())

        treestore.save(target.url, tree, "a", storage_options=wopts)
        assert used(target.url, wopts)
        assert_tree_equal(treestore.load(target.read_url, "a", storage_options=ropts), tree)
        assert used(target.read_url, ropts)
        assert [i.name for i in treestore.Store(target.read_url, storage_options=ropts).list()] == ["a"]
        assert used(target.read_url, ropts)
        np.testing.assert_array_equal(
            treestore.open(target.read_url, storage_options=ropts)["w"][2:4], [2.0, 3.0]
        )
        assert used(target.read_url, ropts)
        assert not treestore.diff(target.spec("a"), target.spec("a"), storage_options=ropts)
        assert used(target.read_url, ropts)
        assert treestore.verify(target.read_url, storage_options=ropts).ok
        assert used(target.read_url, ropts)
        if target.writable:
            treestore.copy(target.spec("a"), f"{target.url}#a2", storage_options=ropts)
            assert used(target.url, ropts)

    def test_cli_storage_options(self, target: Target, capsys: pytest.CaptureFixture[str]) -> None:
        import json

        from treestore_cli.main import main

        store = target.store()
        store.save({"w": np.zeros(4), "n": 1}, "a")
        store.save({"w": np.ones(4), "n": 1}, "b")
        flags: list[str] = []
        for key, value in target.read_options.items():
            flags += ["-o", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
        capsys.readouterr()
        assert main([*flags, "ls", target.read_url, "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        assert "a" in json.dumps(listed) and "b" in json.dumps(listed)
        assert main([*flags, "show", target.spec("a")]) == 0
        assert "w" in capsys.readouterr().out
        assert main([*flags, "diff", target.spec("a"), target.spec("b")]) == 1  # different
        assert "w" in capsys.readouterr().out

    def test_copy(self, target: Target, tmp_path: Any) -> None:
        tree = mixed_tree()
        target.store().save(tree, "a", options=OPTIONS)
        local = str(tmp_path / "copy")
        report = treestore.copy(
            target.spec("a"), local, storage_options=target.read_options, dst_storage_options={}
        )
        assert report.copied == ("a",) and report.chunks_copied == 5
        assert_tree_equal(treestore.load(local, "a"), tree)
        if not target.writable:
            with pytest.raises(treestore.StorageError) as exc:
                treestore.copy(f"{local}#a", f"{target.read_url}#back", dst_storage_options={})
            assert read_only(exc)
            return
        treestore.Store(local).save(changed_tree(tree), "b", options=OPTIONS)
        back = treestore.copy(
            f"{local}#b", target.url, storage_options={}, dst_storage_options=target.options
        )
        assert back.copied == ("b",) and back.chunks_copied == 2 and back.chunks_present == 3
        assert_tree_equal(target.reader().load("b"), changed_tree(tree))

    def test_verify(self, target: Target) -> None:
        store = target.store()
        store.save(mixed_tree(), "a", options=OPTIONS)
        report = treestore.verify(target.read_url, storage_options=target.read_options)
        assert report.ok and report.checkpoints == ("a",)
        path = chunk_paths(store.manifest("a"), "big")[3]
        store._storage.write(path, [b"not a chunk"])
        report = treestore.verify(target.read_url, storage_options=target.read_options)
        assert not report.ok and any(p.address == "big" for p in report.problems)

    # -- the object layer -------------------------------------------------------------------------
    def test_object_layer(self, target: Target) -> None:
        """The contract of ``Storage`` that the store relies on, on this backend."""
        w = target.store()._storage
        r = target.reader()._storage
        w.write("x/obj", [b"hel", memoryview(b"lo")])
        w.write("x/empty", [b""])
        assert r.read("x/obj") == b"hello" and r.read("x/missing") is None
        assert r.read("x/obj", limit=5) == b"hello"
        with pytest.raises(treestore.StorageError, match="limit"):
            r.read("x/obj", limit=4)
        assert r.read_range("x/obj", 1, 3) == b"el"
        assert r.read_range("x/obj", 3, 1000) == b"lo"  # the end past the object: fewer bytes
        assert r.read_range("x/obj", 5, 9) == b""  # wholly past the end: nothing, not an error
        assert r.read_range("x/obj", 10, 20) == b""
        assert r.read_range("x/empty", 0, 10) == b""
        assert r.read_range("x/missing", 0, 10) is None
        assert r.read_range("x/obj", 2, 2) == b"" and r.read_range("x/missing", 2, 2) is None  # empty ranges
        with pytest.raises(ValueError, match=r"^bad byte range \[3, 1\) of x/obj$"):
            r.read_range("x/obj", 3, 1)
        buf = bytearray(3)
        assert r.read_into("x/obj", memoryview(buf)) == 3 and buf == b"hel"  # the first bytes
        buf = bytearray(8)
        assert r.read_into("x/obj", memoryview(buf)) == 5 and buf[:5] == b"hello"  # fewer: the object's end
        assert r.read_into("x/missing", memoryview(buf)) is None
        assert repr(r) == f"{type(r).__name__}({r.url!r})"
        assert (r.object_size("x/obj"), r.object_size("x/empty"), r.object_size("x/missing")) == (5, 0, None)
        assert r.exists("x/obj") and not r.exists("x/missing")
        listed = r.list("x")
        assert [o.path for o in listed] == ["x/empty", "x/obj"]
        if target.writable:  # (an HTTP listing page tells neither sizes nor times)
            assert [o.size for o in listed] == [0, 5]
            now = time.time()
            assert all(o.mtime is not None and abs(now - o.mtime) < 120 for o in listed)
        assert r.list("nothing-here") == []
        if not target.writable:
            for op in (
                lambda: r.write("x/obj", [b"new"]),
                lambda: r.write_new("x/new", b"new"),
                lambda: r.delete("x/obj"),
                lambda: r.delete_many(["x/obj", "x/empty"]),
            ):
                with pytest.raises(treestore.StorageError) as exc:
                    op()
                assert read_only(exc)
            assert r.read("x/obj") == b"hello"
            return
        # Bytes that multipart framing can eat (the GCS emulator dropped a trailing CR) come back.
        for i, data in enumerate([b"ends in CR\r", b"\r", b"CRLF\r\n", b"\nLF first", bytes(range(256))]):
            w.write(f"z/{i}", [data])
            assert w.write_new(f"z/new-{i}", data) is True
            assert r.read(f"z/{i}") == data and r.read(f"z/new-{i}") == data, data
        assert w.write_new("y/new", b"one") is True
        assert w.write_new("y/new", b"two") is False  # present: refused, unchanged
        assert w.write_new("y/new", b"one") is True  # present with these very bytes: written
        assert r.read("y/new") == b"one"
        w.write("y/new", [b"replaced"])
        assert r.read("y/new") == b"replaced"
        w.delete_many(["x/obj", "x/empty", "x/never-there"])
        w.delete("y/never-there")
        assert r.list("x") == [] and r.read("x/obj") is None

    def test_listing_while_other_threads_write(self, target: Target) -> None:
        """A listing taken while other threads of this process write and delete objects (as the
        processes of a multi-process save do with their locks) succeeds and holds every object
        that stayed put; so does ``exists``."""
        if not target.writable:
            pytest.skip("a read-only backend is written by no thread")
        small = target.backend in ("local", "memory")
        list_while_churning(target.store()._storage, kept=100 if small else 10, writes=400 if small else 15)

    def test_threads_share_one_filesystem(self, target: Target) -> None:
        """Saves and loads run many requests at once through one filesystem instance."""
        rng = np.random.default_rng(5)
        tree = {f"t{i}": rng.standard_normal(40_000).astype(np.float32) for i in range(6)}
        opts = treestore.SaveOptions(chunk_size=16 * 1024, small_leaf=4096, threads=8)
        result = target.store().save(tree, "many", options=opts)
        assert result.chunks_written == 6 * 10
        assert_tree_equal(target.reader().load("many", threads=8), tree)


def _after(
    barrier: threading.Barrier,
    fn: Callable[..., Any],
    when: Callable[..., bool] = lambda *a, **k: True,
) -> Callable[..., Any]:
    """``fn``, but calls for which ``when`` holds first wait until every party has arrived."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if when(*args, **kwargs):
            barrier.wait()
        return fn(*args, **kwargs)

    return wrapper


def list_while_churning(storage: Storage, *, kept: int, writes: int) -> None:
    """Three threads write and delete objects under ``locks/`` while this one lists the folder and
    asks for one object that stays put; nothing may fail and every kept object is always listed."""
    paths = [f"locks/kept-{i:03d}" for i in range(kept)]
    for path in paths:
        storage.write(path, [b"k"])
    failures: list[BaseException] = []

    def churn(worker: int) -> None:
        try:
            for i in range(writes):
                storage.write(f"locks/w{worker}-{i}", [b"x"])
                storage.delete(f"locks/w{worker}-{i - 1}")
        except Exception as exc:  # reported by the assertion below
            failures.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to provoke any race
    writers = [threading.Thread(target=churn, args=(w,)) for w in range(3)]
    try:
        for t in writers:
            t.start()
        while any(t.is_alive() for t in writers):
            assert set(paths) <= {o.path for o in storage.list("locks")}
            assert storage.exists(paths[0])
    finally:
        sys.setswitchinterval(switch)
        for t in writers:
            t.join()
    assert failures == []


class _SlowlyIterated(dict):  # type: ignore[type-arg]
    """fsspec's memory store, but iterating it lets other threads run between items (as a
    garbage collection during fsspec's snapshot of the table can)."""

    def items(self) -> Any:
        for item in super().items():
            time.sleep(0)
            yield item


# -- the backends ------------------------------------------------------------------------------------
class TestLocal(StoreConformance):
    backend = "local"


class TestMemory(StoreConformance):
    backend = "memory"

    def test_listing_does_not_rely_on_fsspec_being_thread_safe(
        self, target: Target, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """fsspec's memory filesystem is one dict shared by every thread; treestore serialises its
        own calls on it, so a listing never meets a table changing under it."""
        from fsspec.implementations.memory import MemoryFileSystem

        monkeypatch.setattr(MemoryFileSystem, "store", _SlowlyIterated(MemoryFileSystem.store))
        list_while_churning(target.store()._storage, kept=50, writes=200)


class TestS3(StoreConformance):
    backend = "s3"


class TestGCS(StoreConformance):
    backend = "gcs"

    @pytest.mark.xfail(strict=True, reason=GCS_RACE)
    def test_put_if_absent_race(self, target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
        super().test_put_if_absent_race(target, monkeypatch)

    def test_sequential_put_if_absent_holds(self, target: Target) -> None:
        """Without a race the emulator still refuses a second commit: the existence check."""
        target.store().save({"x": 1}, "a")
        with pytest.raises(treestore.errors.CheckpointExistsError):
            target.store().save({"x": 2}, "a")
        assert target.store()._storage.write_new("checkpoints/a", b"other") is False


class TestAzure(StoreConformance):
    backend = "azure"

    def test_abfs_url(self, target: Target) -> None:
        """``abfs://`` names the same container as ``az://``."""
        tree = mixed_tree()
        target.store().save(tree, "a", options=OPTIONS)
        abfs = "abfs://" + target.url.split("://", 1)[1]
        assert_tree_equal(treestore.load(abfs, "a", storage_options=target.options), tree)


class TestHTTP(StoreConformance):
    backend = "http"

    def test_put_if_absent_race(self, target: Target, monkeypatch: pytest.MonkeyPatch) -> None:
        """Two writers committing through HTTP: both refused as read-only, nothing visible."""
        outcome: list[Any] = [None, None]

        def run(i: int) -> None:
            try:
                outcome[i] = target.reader().save({"w": np.full(4, i)}, "race")
            except Exception as exc:
                outcome[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(isinstance(o, treestore.StorageError) and "read-only" in str(o) for o in outcome)
        assert target.reader().list() == []

    def test_writes_through_http_fail_clearly(self, target: Target) -> None:
        target.store().save({"x": 1}, "a")
        for op in (
            lambda: treestore.save(target.read_url, {"x": 2}, "b"),
            lambda: treestore.Store(target.read_url).delete("a"),
            lambda: treestore.Store(target.read_url).gc(grace=0),
        ):
            with pytest.raises(treestore.StorageError, match="read-only") as exc:
                op()
            assert "http://" in str(exc.value)
        assert [i.name for i in treestore.Store(target.read_url).list()] == ["a"]


# -- missing optional packages -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "modules", "extra"),
    [
        ("s3://bucket/store", ["s3fs"], "s3"),
        ("gs://bucket/store", ["gcsfs"], "gcs"),
        ("az://container/store", ["adlfs"], "azure"),
        ("abfs://container/store", ["adlfs"], "azure"),
        ("http://127.0.0.1:9/store", ["aiohttp", "fsspec.implementations.http"], "http"),
    ],
)
def test_missing_optional_package_names_the_extra(
    url: str, modules: list[str], extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = importlib.import_module("fsspec.registry")._registry  # imported classes by protocol
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # "import s3fs" now raises ImportError
    protocol = url.split("://", 1)[0]
    cls = registry.get(protocol)
    if cls is not None:
        protos = cls.protocol if isinstance(cls.protocol, tuple) else (cls.protocol,)
        for p in {protocol, *protos}:
            monkeypatch.delitem(registry, p, raising=False)
    hint = f"pip install 'treestore-jax[{extra}]'"
    for op in (
        lambda: treestore.Store(url),
        lambda: treestore.load(url),
        lambda: treestore.open(url),
        lambda: treestore.save(url, {"x": 1}, "a"),
    ):
        with pytest.raises(treestore.InvalidInputError) as exc:
            op()
        assert hint in str(exc.value) and url in str(exc.value)
