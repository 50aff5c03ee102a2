"""treestore.watch and `treestore watch`: each checkpoint once it is committed, once, in order."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import treestore
from treestore._format import paths as _paths
from treestore.errors import CheckpointNotFoundError, InvalidInputError
from treestore_cli.main import cli

ROOT = Path(__file__).resolve().parent.parent.parent

# A training run: saves N checkpoints with pauses; each has a 2 MiB leaf, so chunks are still
# being written while the watcher polls.
WRITER = r"""
import json, sys, time
import numpy as np
import treestore
url, n, pause, options = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), json.loads(sys.argv[4])
store = treestore.Store(url, storage_options=options or None)
for i in range(n):
    w = np.random.default_rng(i).standard_normal(512 * 1024).astype(np.float32)
    store.save({"w": w, "step": i}, f"step-{i:02d}", metadata={"step": i})
    time.sleep(pause)
"""


def expected(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(512 * 1024).astype(np.float32)


def follow(url: str, n: int, options: dict | None = None) -> list[str]:
    """Start the writer, watch until it has committed ``n`` checkpoints; check each one."""
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, url, str(n), "0.2", json.dumps(options or {})], cwd=ROOT
    )
    seen = []
    try:
        for ckpt in treestore.watch(url, timeout=60, min_poll=0.05, max_poll=0.5, storage_options=options):
            seen.append(ckpt.name)
            step = int(ckpt.name.split("-")[1])
            assert ckpt.metadata == {"step": step}
            tree = treestore.load((url, ckpt.name), storage_options=options)
            assert tree["step"] == step and np.array_equal(tree["w"], expected(step))
            if len(seen) == n:
                break
    finally:
        assert writer.wait(timeout=60) == 0
    return seen


def test_follows_a_writer_process_from_before_the_store_exists(tmp_path):
    url = str(tmp_path / "run" / "store")  # nothing there yet
    assert follow(url, 5) == [f"step-{i:02d}" for i in range(5)]


def test_follows_a_writer_on_s3(s3_backend):
    url = s3_backend.url("watched")
    assert follow(url, 3, s3_backend.storage_options) == ["step-00", "step-01", "step-02"]


def save(url: str, name: str, value: float) -> None:
    treestore.save(url, {"w": np.full(4, value)}, name)


def test_existing_checkpoints_first_in_commit_order_then_timeout(tmp_path):
    url = str(tmp_path / "s")
    for name in ("b", "a", "c"):  # commit order, not name order
        save(url, name, 1.0)
    start = time.monotonic()
    names = [c.name for c in treestore.watch(url, timeout=0.4, min_poll=0.05)]
    elapsed = time.monotonic() - start
    assert names == ["b", "a", "c"]
    assert 0.4 <= elapsed < 3
    assert [c.name for c in treestore.watch(url, since="a", timeout=0)] == ["c"]
    with pytest.raises(CheckpointNotFoundError):
        treestore.watch(url, since="zzz")
    with pytest.raises(InvalidInputError):
        treestore.watch(url, min_poll=0)
    with pytest.raises(InvalidInputError, match="not checkpoint 'a'"):
        treestore.watch(f"{url}#a")


def test_stop_event_and_close(tmp_path):
    url = str(tmp_path / "s")
    save(url, "one", 1.0)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    start = time.monotonic()
    assert [c.name for c in treestore.watch(url, stop=stop, max_poll=60)] == ["one"]
    assert time.monotonic() - start < 3  # woken by the event, not by the next poll
    gen = treestore.watch(url)
    assert next(gen).name == "one"
    gen.close()
    with pytest.raises(StopIteration):
        next(gen)


def test_polls_back_off(monkeypatch):
    url = "memory://treestore-tests/watch-backoff"
    save(url, "one", 1.0)
    store = treestore.Store(url)
    listings = []
    original = type(store._storage).list

    def counted(self, prefix):
        listings.append(time.monotonic())
        return original(self, prefix)

    monkeypatch.setattr(type(store._storage), "list", counted)
    list(treestore.watch(url, timeout=1.5, min_poll=0.05, max_poll=0.4))
    # 0, .05, .15, .35, .75, 1.15, 1.5: a busy loop would list hundreds of times
    assert 5 <= len(listings) <= 9


def test_a_damaged_commit_record_is_skipped_with_a_warning(tmp_path, caplog):
    url = str(tmp_path / "s")
    save(url, "bad", 1.0)
    save(url, "good", 2.0)
    record = tmp_path / "s" / "checkpoints" / "bad"
    record.write_bytes(b"\x93garbage")
    caplog.set_level(logging.WARNING, logger="treestore.watch")
    gen = treestore.watch(url, timeout=5, min_poll=0.05)
    assert next(gen).name == "good"
    assert "skipping checkpoint 'bad'" in caplog.text and str(tmp_path) in caplog.text
    save(url, "later", 3.0)
    assert next(gen).name == "later"
    assert caplog.text.count("skipping checkpoint 'bad'") == 1  # warned once, not at every poll
    treestore.save(url, {"w": np.full(4, 9.0)}, "bad", overwrite=True)  # repaired: now seen
    ckpt = next(gen)
    assert ckpt.name == "bad" and np.array_equal(np.asarray(ckpt["w"]), np.full(4, 9.0))
    gen.close()


def test_a_damaged_manifest_repaired_in_place_is_yielded_once(tmp_path, caplog):
    """The damaged manifest used to be remembered by its commit record's listed size and mtime,
    which a repair of the manifest does not change: the checkpoint was never yielded."""
    from tests.support import hostile

    url = str(tmp_path / "s")
    save(url, "bad", 1.0)
    save(url, "good", 2.0)
    path = treestore.Store(url)._storage
    manifest = _paths.manifest_path(hostile.commit_record(url, "bad")["manifest"])
    original = path.read(manifest)
    hostile.damage_manifest(url, "bad")
    caplog.set_level(logging.WARNING, logger="treestore.watch")
    gen = treestore.watch(url, timeout=2, min_poll=0.05, max_poll=0.1)
    assert next(gen).name == "good"
    save(url, "later", 3.0)
    assert next(gen).name == "later"
    assert caplog.text.count("skipping checkpoint 'bad'") == 1  # warned once, not at every poll
    path.write(manifest, [original])  # repaired: the same bytes back at their content address
    ckpt = next(gen)
    assert ckpt.name == "bad" and np.array_equal(np.asarray(ckpt["w"]), np.full(4, 1.0))
    assert list(gen) == []  # once
    assert caplog.text.count("skipping checkpoint 'bad'") == 1


def test_cli_watch(tmp_path):
    url = str(tmp_path / "s")
    save(url, "step-1", 1.0)
    save(url, "step-2", 2.0)
    result = CliRunner().invoke(cli, ["watch", url, "--timeout", "0.2", "--json"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["name"] for r in lines] == ["step-1", "step-2"] and lines[0]["leaves"] == 1
    result = CliRunner().invoke(cli, ["watch", url, "--timeout", "0", "--since", "step-1"])
    assert result.exit_code == 0 and result.stdout.startswith("step-2  ") and "1 leaves" in result.stdout
