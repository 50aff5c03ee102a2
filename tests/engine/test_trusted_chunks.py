"""Known chunks: a save references the chunks of the store's newest checkpoint (the manager: its
last step) without a request for each, and never trusts one gc may have deleted."""

from __future__ import annotations

import collections
import dataclasses
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pytest

import treestore
from tests.support import servers
from tests.support.helpers import assert_tree_equal, in_use
from treestore._engine import gc as _gc
from treestore._engine import locks as _locks
from treestore._engine.reading.committed import read_commit_record
from treestore._engine.saving import trusted as _trusted
from treestore._engine.write import SaveOptions
from treestore._format import paths as _paths
from treestore._format.commit_record import encode_commit_record

# 64 KiB layers cut into 16 KiB chunks: 4 chunks a layer; the step (a numpy scalar) is packed.
OPTIONS = SaveOptions(chunk_size=16384, small_leaf=4096, pack_size=4096)
LAYERS = 12
PER_LAYER = 4
CHUNKS = LAYERS * PER_LAYER + 1  # and the pack


def model(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "layers": [rng.standard_normal(16384).astype(np.float32) for _ in range(LAYERS)],
        "step": np.int32(seed),
    }


def changed(tree: dict[str, Any], layer: int, step: int) -> dict[str, Any]:
    """``tree`` with one layer replaced and a new step (so its pack changes too)."""
    layers = list(tree["layers"])
    layers[layer] = layers[layer] + np.float32(1)
    return {"layers": layers, "step": np.int32(step)}


class ChunkCalls:
    """The chunk requests a store's storage sends: size checks, reads and writes, by kind."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: treestore.Store) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        storage = store._storage
        # A save writes a chunk with one stage (which on object stores is the write itself).
        for method, kind in (
            ("object_size", "object_size"),
            ("read_range", "read_range"),
            ("stage", "write"),
        ):
            original = getattr(storage, method)
            monkeypatch.setattr(storage, method, self._counting(kind, original))

    def _counting(self, kind: str, original: Any) -> Any:
        def call(path: str, *args: Any, **kwargs: Any) -> Any:
            if path.startswith(_paths.CHUNKS + "/"):
                with self._lock:
                    self.counts[kind] += 1
            return original(path, *args, **kwargs)

        return call

    def take(self) -> collections.Counter[str]:
        with self._lock:
            out, self.counts = self.counts, collections.Counter()
        return out


def test_second_save_sends_no_request_for_known_chunks(store_url, monkeypatch):
    store = treestore.Store(in_use(store_url))
    calls = ChunkCalls(monkeypatch, store)
    tree = model()
    first = store.save(tree, "step-1", options=OPTIONS)
    assert (first.chunks_written, first.chunks_trusted, first.trusted_from) == (CHUNKS, 0, None)
    assert first.existence_checks == CHUNKS and first.reuse_reads == 0
    assert calls.take() == {"object_size": CHUNKS, "write": CHUNKS}
    tree2 = changed(tree, 3, 2)
    second = store.save(tree2, "step-2", options=OPTIONS)
    new = PER_LAYER + 1  # the changed layer's chunks and the pack
    assert second.trusted_from == "step-1"
    assert second.chunks_trusted == CHUNKS - new == second.chunks_reused
    assert (second.chunks_written, second.existence_checks, second.reuse_reads) == (new, new, 0)
    assert second.chunk_requests == 2 * new
    # The storage saw exactly what the result reports: nothing at all for the known chunks.
    assert calls.take() == {"object_size": second.existence_checks, "write": second.chunks_written}
    assert_tree_equal(store.load("step-2"), tree2)
    assert treestore.verify(f"{store_url}#step-2").ok


def test_a_save_learns_the_manifest_this_process_committed_without_decoding_it(tmp_path, monkeypatch):
    # The record and the manifest's bytes are read (and checked) under the lock each time; the
    # chunk table of a manifest this process committed is not decoded again (at 100k leaves most
    # of what learning costs).
    decoded: list[str] = []
    read: list[str] = []
    real_columns, real_bytes = _trusted.read_columns, _trusted.read_manifest_bytes
    monkeypatch.setattr(
        _trusted, "read_columns", lambda s, r, *a: decoded.append(r.name) or real_columns(s, r, *a)
    )
    monkeypatch.setattr(_trusted, "read_manifest_bytes", lambda s, r: read.append(r.name) or real_bytes(s, r))
    store = treestore.Store(tmp_path / "store")
    tree = model()
    store.save(tree, "step-1", options=OPTIONS, metadata={"step": [1, (2, 3)], "lr": 0.5})
    r = store.save(changed(tree, 3, 2), "step-2", options=OPTIONS)
    assert (r.trusted_from, r.chunks_trusted) == ("step-1", CHUNKS - PER_LAYER - 1)
    assert (read, decoded) == (["step-1"], [])
    # In a process that kept nothing (a checkpoint another process committed): decoded once.
    monkeypatch.setattr(_trusted, "_tables", _trusted._Tables())
    for step in (3, 4):
        r = store.save(changed(tree, 6, step), f"step-{step}", options=OPTIONS)
        assert r.trusted_from == f"step-{step - 1}" and r.chunks_trusted >= CHUNKS - 2 * PER_LAYER - 1
    assert read == ["step-1", "step-2", "step-3"] and decoded == ["step-2"]


def test_a_chunk_table_over_the_bound_is_not_kept(tmp_path, monkeypatch):
    # The memo's memory is bounded: a table of more chunk objects is decoded each time.
    decoded: list[str] = []
    real = _trusted.read_columns
    monkeypatch.setattr(_trusted, "read_columns", lambda s, r, *a: decoded.append(r.name) or real(s, r, *a))
    monkeypatch.setattr(_trusted, "_tables", _trusted._Tables())
    monkeypatch.setattr(_trusted._Tables, "MAX_CHUNKS", CHUNKS - 1)
    store = treestore.Store(tmp_path / "store")
    store.save(model(), "step-1", options=OPTIONS)
    for step in (2, 3):
        r = store.save(model(), f"step-{step}", options=OPTIONS)
        assert r.chunks_trusted == CHUNKS
    assert decoded == ["step-1", "step-2"] and not _trusted._tables._found


def test_the_memo_keeps_the_tables_used_last():
    from treestore._format.commit_record import CommitRecord

    tables = _trusted._Tables()
    records = [CommitRecord(f"c{i}", bytes([i]) * 32, 10, 1.0) for i in range(3)]
    for i, record in enumerate(records[:2]):
        tables.put(record, {bytes([i]) * 32: i})
    assert tables.get(records[0]) == {bytes(32): 0}  # now the one used last
    tables.put(records[2], {bytes([2]) * 32: 2})  # the least recently used (c1) leaves
    assert tables.get(records[1]) is None and tables.get(records[0]) is not None
    assert tables.get(records[2]) is not None


def test_a_kept_table_serves_only_the_record_it_was_checked_with(tmp_path):
    # A record naming a kept manifest that does not describe it (another name) is refused as the
    # decoded manifest would refuse it: its chunks are not trusted through that record.
    store = treestore.Store(tmp_path / "store")
    store.save(model(), "step-1", options=OPTIONS)
    storage = store._storage
    record = read_commit_record(storage, "step-1")
    assert _trusted.learn(storage, "step-1") is not None
    storage.write(
        _paths.record_path("forged"), [encode_commit_record(dataclasses.replace(record, name="forged"))]
    )
    assert _trusted.learn(storage, "forged") is None


def test_trust_previous_false_checks_every_chunk(store_url, monkeypatch):
    store = treestore.Store(in_use(store_url))
    tree = model()
    store.save(tree, "step-1", options=OPTIONS)
    calls = ChunkCalls(monkeypatch, store)
    r = store.save(changed(tree, 0, 2), "step-2", options=OPTIONS, trust_previous=False)
    new = PER_LAYER + 1
    assert (r.chunks_trusted, r.trusted_from) == (0, None)
    assert (r.existence_checks, r.reuse_reads, r.chunks_written) == (CHUNKS, CHUNKS - new, new)
    assert calls.take() == {"object_size": CHUNKS, "read_range": CHUNKS - new, "write": new}
    # the top-level save passes it on
    again = treestore.save(store_url, changed(tree, 1, 3), "step-3", options=OPTIONS, trust_previous=False)
    assert again.chunks_trusted == 0 and again.existence_checks == CHUNKS


def test_default_hint_is_the_newest_commit_record(tmp_path):
    store = treestore.Store(tmp_path / "store")
    tree = model()
    store.save(tree, "b-old", options=OPTIONS)
    later = changed(tree, 5, 2)
    time.sleep(0.05)  # mtimes in order
    store.save(later, "a-new", options=OPTIONS)
    r = store.save(changed(later, 6, 3), "c", options=OPTIONS)
    assert r.trusted_from == "a-new" and r.chunks_trusted == CHUNKS - PER_LAYER - 1


@pytest.mark.parametrize("damage", ["manifest", "record"])
def test_an_unusable_previous_checkpoint_falls_back_to_checking_every_chunk(tmp_path, damage):
    store = treestore.Store(tmp_path / "store")
    tree = model()
    store.save(tree, "step-1", options=OPTIONS)
    record = _paths.record_path("step-1")
    if damage == "manifest":
        (manifest,) = store._storage.list(_paths.MANIFESTS)
        store._storage.write(manifest.path, [b"\x81\xa1x\x01"])  # valid msgpack, not a manifest
    else:
        store._storage.write(record, [b"not a commit record"])
    r = store.save(tree, "step-2", options=OPTIONS)  # the save succeeds, checking every chunk
    assert (r.chunks_trusted, r.trusted_from, r.existence_checks) == (0, None, CHUNKS)
    assert r.reuse_reads == CHUNKS and r.chunks_written == 0
    assert_tree_equal(store.load("step-2"), tree)


def _chunk_file(root: Path, digest: bytes) -> Path:
    return root / _paths.chunk_path(digest)


def test_a_poisoned_object_no_checkpoint_references_is_still_checked(tmp_path):
    """Only the previous checkpoint's chunks are trusted: a bad object planted under the name of
    a chunk no checkpoint references yet fails the reuse check and is written again."""
    root = tmp_path / "store"
    store = treestore.Store(root)
    tree = model()
    store.save(tree, "step-1", options=OPTIONS)
    tree2 = changed(tree, 3, 2)
    store.save(tree2, "probe", options=OPTIONS)  # learn the new chunks' names ...
    new = store.manifest("probe").leaves[3].chunks
    store.delete("probe")
    treestore.Store(root).gc(grace=0)  # ... and remove them again
    for c in new:
        _chunk_file(root, c.digest).parent.mkdir(parents=True, exist_ok=True)
        _chunk_file(root, c.digest).write_bytes(b"TSC1" + bytes(40))  # poisoned
    r = store.save(tree2, "step-2", options=OPTIONS)
    assert r.trusted_from == "step-1" and r.reuse_reads == len(new)
    assert r.chunks_written == len(new) + 1  # the poisoned ones rewritten, and the new pack
    assert_tree_equal(store.load("step-2"), tree2)
    assert treestore.verify(str(root)).ok


def test_a_known_chunk_skips_the_reuse_check_and_verify_finds_its_damage(tmp_path):
    """Damage to a committed checkpoint's chunk (after the save that wrote it) is not noticed by
    a save that trusts that checkpoint; verify names it, and a save with trust_previous=False
    writes it again, repairing both checkpoints."""
    root = tmp_path / "store"
    store = treestore.Store(root)
    tree = model()
    store.save(tree, "step-1", options=OPTIONS)
    (c, *_) = store.manifest("step-1").leaves[0].chunks
    good = _chunk_file(root, c.digest).read_bytes()
    _chunk_file(root, c.digest).write_bytes(good[:-1])
    trusted = store.save(tree, "step-2", options=OPTIONS)
    assert trusted.chunks_trusted == CHUNKS and trusted.chunks_written == 0
    report = treestore.verify(str(root))
    assert not report.ok and {p.checkpoint for p in report.problems} == {"step-1", "step-2"}
    repaired = store.save(tree, "step-3", options=OPTIONS, trust_previous=False)
    assert repaired.chunks_written == 1 and _chunk_file(root, c.digest).read_bytes() == good
    assert treestore.verify(str(root)).ok


def test_a_save_never_trusts_chunks_gc_deleted_while_it_waited(tmp_path):
    """The hint is read under the save's lock, after the save has waited for gc: a checkpoint
    deleted and collected before that is not trusted (reading it before the lock would commit a
    manifest naming deleted chunks)."""
    store = treestore.Store(tmp_path / "store")
    tree = model()
    store.save(tree, "step-1", options=OPTIONS)
    storage = store._storage
    gc_lock = _locks.gc_lock(storage, stale_after=_locks.STALE_AFTER, wait=0)
    outcome: dict[str, Any] = {}

    def save() -> None:
        try:
            outcome["result"] = store.save(tree, "step-2", options=OPTIONS)
        except BaseException as exc:  # reported below
            outcome["error"] = exc

    saver = threading.Thread(target=save)
    saver.start()
    try:
        deadline = time.monotonic() + 30
        while not _locks.live_locks(storage, "save", _locks.STALE_AFTER):  # it waits for gc now
            assert time.monotonic() < deadline, "the save never took its lock"
            time.sleep(0.01)
        store.delete("step-1")
        report = _gc.collect(
            storage,
            set(),
            set(),
            grace=0,
            stale_after=_locks.STALE_AFTER,
            dry_run=False,
            own_lock=gc_lock.path,
        )
        assert report.chunks_removed == CHUNKS
    finally:
        gc_lock.release()
        saver.join(60)
    assert "error" not in outcome, outcome.get("error")
    r = outcome["result"]
    assert (r.chunks_trusted, r.chunks_written) == (0, CHUNKS)
    assert_tree_equal(store.load("step-2"), tree)
    assert treestore.verify(f"{tmp_path / 'store'}#step-2").ok


def test_manager_trusts_its_last_step(tmp_path):
    url = in_use(str(tmp_path / "store"))
    tree = model()
    with treestore.CheckpointManager(url, async_save=False) as m:
        m.save(1, tree)
        # Someone else commits a checkpoint later: the manager still trusts its own last step.
        treestore.save(url, {"other": np.zeros(5000, np.float32)}, "other")
        m.save(2, changed(tree, 7, 2))
        r = m.last_result
        assert r is not None and r.trusted_from == "step-000000001"
        assert r.chunks_trusted == LAYERS + 1 - 2  # default options: one chunk a layer, and the pack
        assert r.existence_checks == 2 and r.reuse_reads == 0
        assert_tree_equal(m.restore(), changed(tree, 7, 2))
    with treestore.CheckpointManager(url, async_save=False) as m:  # a new manager: the newest step
        m.save(3, changed(tree, 8, 3))
        assert m.last_result is not None and m.last_result.trusted_from == "step-000000002"
    with treestore.CheckpointManager(url, async_save=False, trust_previous=False) as m:
        m.save(4, changed(tree, 9, 4))
        r = m.last_result
        assert r is not None and r.chunks_trusted == 0 and r.existence_checks == LAYERS + 1


def test_manager_does_not_trust_a_step_deleted_and_collected_behind_its_back(tmp_path):
    url = str(tmp_path / "store")
    tree = model()
    with treestore.CheckpointManager(url, async_save=False) as m:
        m.save(1, tree)
        store = treestore.Store(url)
        store.delete("step-000000001")
        assert store.gc(grace=0).chunks_removed == LAYERS + 1
        m.save(2, tree)  # the manager still believes step 1 is there
        r = m.last_result
        assert r is not None and (r.chunks_trusted, r.chunks_written) == (0, LAYERS + 1)
        assert_tree_equal(m.restore(), tree)


def test_copy_trusts_the_destinations_newest_checkpoint(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    tree = model()
    treestore.save(src, tree, "step-1", options=OPTIONS)
    treestore.save(src, changed(tree, 2, 2), "step-2", options=OPTIONS)
    first = treestore.copy(f"{src}#step-1", dst)
    assert (first.chunks_copied, first.chunks_trusted) == (CHUNKS, 0)
    second = treestore.copy(f"{src}#step-2", dst)
    assert (second.chunks_copied, second.chunks_trusted) == (PER_LAYER + 1, CHUNKS - PER_LAYER - 1)
    assert second.chunks_present == second.chunks_trusted
    assert_tree_equal(treestore.load(f"{dst}#step-2"), changed(tree, 2, 2))
    off = treestore.copy(f"{src}#step-2", f"{dst}#again", trust_previous=False)
    assert off.chunks_trusted == 0 and off.chunks_present == CHUNKS


def test_a_copy_into_a_new_local_store_asks_nothing_about_its_chunks(tmp_path, monkeypatch):
    """As a save does, a copy writes the chunks that go into folders it made with no request for
    each (none can be there yet); into folders that were there, every chunk is checked."""
    from treestore._storage.local import LocalStorage

    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    tree = model()
    treestore.save(src, tree, "step-1", options=OPTIONS)
    asked: list[str] = []
    real = LocalStorage.object_size

    def object_size(self, path):
        if self.root.startswith(dst) and path.startswith("chunks/"):
            asked.append(path)
        return real(self, path)

    monkeypatch.setattr(LocalStorage, "object_size", object_size)
    first = treestore.copy(f"{src}#step-1", dst)
    assert first.chunks_copied == CHUNKS and asked == []
    again = treestore.copy(f"{src}#step-1", f"{dst}#again", trust_previous=False)
    assert again.chunks_present == CHUNKS and len(asked) == CHUNKS
    assert_tree_equal(treestore.load(f"{dst}#again"), tree)


# -- on S3: what the real server received -------------------------------------------------------

_REQUEST = re.compile(r'"(?:\x1b\[[0-9;]*m)*(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP')


class ServerLog:
    """The requests the moto server logged for one store prefix (its access log, read through
    /proc), by method and store folder."""

    def __init__(self, backend: servers.Backend, prefix: str) -> None:
        port = urlparse(backend.storage_options["endpoint_url"]).port
        procs = [p for p in servers._LIVE.values() if p.poll() is None and str(port) in p.args]
        self.path = Path(f"/proc/{procs[0].pid}/fd/1") if procs else None
        self.prefix = prefix
        self.seen = self._lines()

    @property
    def available(self) -> bool:
        return self.path is not None and self.path.exists()

    def _lines(self) -> int:
        return len(self.path.read_bytes().splitlines()) if self.available else 0  # type: ignore[union-attr]

    def take(self) -> collections.Counter[tuple[str, str]]:
        """The requests logged since the last call, once the log has stopped growing."""
        if not self.available:
            return collections.Counter()
        n, stable = self._lines(), time.monotonic()
        while time.monotonic() - stable < 0.3:  # the server logs each request after answering it
            time.sleep(0.05)
            if (m := self._lines()) != n:
                n, stable = m, time.monotonic()
        lines = self.path.read_bytes().decode(errors="replace").splitlines()[self.seen : n]  # type: ignore[union-attr]
        self.seen = n
        out: collections.Counter[tuple[str, str]] = collections.Counter()
        for line in lines:
            found = _REQUEST.search(line)
            if found is None or self.prefix not in found.group(2):
                continue
            method, target = found.groups()
            if "list-type=2" in target:
                out[(method, "list")] += 1
            else:
                folder = target.split("?")[0].split(f"/{self.prefix}/", 1)[-1].split("/")[0]
                out[(method, folder)] += 1
        return out


def test_s3_second_save_sends_requests_for_changed_chunks_only(s3_backend):
    prefix = f"known-{uuid.uuid4().hex[:12]}"
    store = treestore.Store(s3_backend.url(prefix), storage_options=s3_backend.storage_options)
    log = ServerLog(s3_backend, prefix)
    tree = model()
    first = store.save(tree, "step-1", options=OPTIONS)
    full = log.take()
    tree2 = changed(tree, 4, 2)
    second = store.save(tree2, "step-2", options=OPTIONS)
    incremental = log.take()
    unchecked = store.save(changed(tree2, 5, 3), "step-3", options=OPTIONS, trust_previous=False)
    untrusted = log.take()

    new = PER_LAYER + 1
    assert (first.chunks_written, first.existence_checks) == (CHUNKS, CHUNKS)
    assert (second.chunks_trusted, second.trusted_from) == (CHUNKS - new, "step-1")
    assert (second.existence_checks, second.reuse_reads, second.chunks_written) == (new, 0, new)
    assert (unchecked.chunks_trusted, unchecked.existence_checks) == (0, CHUNKS)
    assert (unchecked.reuse_reads, unchecked.chunks_written) == (CHUNKS - new, new)
    assert_tree_equal(store.load("step-2"), tree2)
    if not log.available:
        pytest.skip("the S3 server's access log cannot be read here (Linux /proc): SaveResult checked")
    # The server received exactly the chunk requests each result reports ...
    for result, seen in ((first, full), (second, incremental), (unchecked, untrusted)):
        chunk_requests = {k[0]: v for k, v in seen.items() if k[1] == _paths.CHUNKS}
        expected = {"HEAD": result.existence_checks, "GET": result.reuse_reads, "PUT": result.chunks_written}
        assert chunk_requests == {k: v for k, v in expected.items() if v}, seen
    # ... and the incremental save's requests grow with the changed chunks, not with all chunks:
    # beyond two per changed chunk only a fixed few (the lock, listings, the previous checkpoint's
    # commit record and manifest, the new manifest and commit record).
    assert sum(incremental.values()) - 2 * new <= 14, incremental  # 11 when this was written
    assert sum(incremental.values()) * 3 < sum(untrusted.values()), (incremental, untrusted)
