"""Two tiers: fast local saves, replicated in the background to a remote store.

The manager saves to ``local`` as always and copies committed steps to ``remote`` on its own thread
(only the chunks the remote lacks; one copy at a time, the newest waiting step wins); upload errors
surface at the next save/wait/close; each tier has its own retention; restore takes the newest step
of either tier, so a job resumes bit-exactly from the remote after its local folder is gone.

Run as ``python -m tests.api.test_two_tier LOCAL REMOTE OPTIONS_JSON TOTAL`` this module is a training
program (tests/system/test_manager_process.py's MLP) with two tiers, saving every 20 steps locally and
replicating every 100th step. It prints ``step N``, ``replicated N``, ``resumed N`` and ``done``.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import treestore
from tests.api.test_health_retention import NAN, UNKNOWN
from tests.support.helpers import assert_tree_equal
from tests.system.test_cloud_faults import FAIL_FAST, Proxy
from tests.system.test_manager_process import ENV, ROOT
from treestore._api.manager import replication as _replication
from treestore._format.paths import step_name

TOTAL = 300
EVERY = 20
REPLICATE = 100


def tree(step: int, layers: int = 4) -> dict[str, Any]:
    """Layers of 80 KB of random floats (one chunk each); only layer0 changes with the step."""
    seeds = [1000 + step, *range(1, layers)]
    return {
        f"layer{i}": np.random.default_rng(seed).standard_normal(20_000).astype(np.float32)
        for i, seed in enumerate(seeds)
    }


def remote_steps(url: str, **options: Any) -> list[int]:
    return treestore.CheckpointManager(url, storage_options=options or None).steps()


def test_replicates_only_missing_chunks_and_restores_from_either_tier(tmp_path):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    with treestore.CheckpointManager(local=local, remote=remote) as m:
        m.save(0, tree(0))
        m.wait()
        assert remote_steps(remote) == [0] and m.last_replicated == 0
        first = m.last_replication
        assert first is not None and first.chunks_copied == 4
        m.save(1, tree(1))
        m.wait()
        report = m.last_replication
        assert report is not None and report.copied == ("step-000000001",)
        assert report.chunks_copied == 1 and report.chunks_present == 3  # one layer changed
        assert report.bytes_copied < first.bytes_copied / 2
    shutil.rmtree(local)  # the machine is lost
    with treestore.CheckpointManager(local=local, remote=remote) as m:
        assert m.steps() == [0, 1] and m.latest_step() == 1
        assert_tree_equal(m.restore(), tree(1))
        m.save(2, tree(2))  # training goes on, locally
        m.wait()
        assert m.steps() == [0, 1, 2] and remote_steps(remote) == [0, 1, 2]


def test_restore_picks_the_newest_of_either_tier(tmp_path):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    with treestore.CheckpointManager(
        local=local, remote=remote, retention=treestore.Retention(keep_last=1)
    ) as m:
        for step in range(3):
            m.save(step, tree(step))
        m.wait()
    treestore.Store(local).delete("step-000000002")  # only the remote has the newest now
    treestore.save(remote, {"x": 1}, "unrelated")  # other checkpoints are ignored
    with treestore.CheckpointManager(local=local, remote=remote) as m:
        assert m.latest_step() == 2 and m.info().name == "step-000000002"
        assert_tree_equal(m.restore(), tree(2))
        assert_tree_equal(m.restore(step=0), tree(0))


def test_each_tier_has_its_own_retention(tmp_path):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    with treestore.CheckpointManager(
        local=local,
        remote=treestore.RemoteTier(remote, keep_every=4, keep_last=1),
        retention=treestore.Retention(keep_last=2),
    ) as m:
        for step in range(10):
            m.save(step, tree(step))
            m.wait()
    assert treestore.CheckpointManager(local).steps() == [8, 9]
    assert remote_steps(remote) == [0, 4, 8, 9]
    for step in (0, 4, 8, 9):  # remote gc freed nothing a kept step uses
        assert_tree_equal(treestore.Store(remote).load(step_name(step)), tree(step))


@pytest.mark.parametrize("how", UNKNOWN)
def test_each_tier_keeps_its_newest_step_not_known_unhealthy_when_none_is_known_healthy(tmp_path, how):
    """Step 1 is replicated, then its health becomes unknown in both tiers; steps 2 and 3 hold
    NaN. With keep_last=1 in each tier and no step known healthy, each keeps step 1."""
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    options, make_unknown = UNKNOWN[how]

    def manager(options: treestore.SaveOptions | None = None) -> treestore.CheckpointManager:
        tier = treestore.RemoteTier(remote, keep_last=1)
        return treestore.CheckpointManager(
            local=local, remote=tier, retention=treestore.Retention(keep_last=1), options=options
        )

    with manager(options) as m:
        m.save(1, {"w": np.ones(3)})
        m.wait()
    for url in (local, remote):
        make_unknown(url, step_name(1))
    with manager() as m:
        for step in (2, 3):
            m.save(step, NAN)
            m.wait()
        assert m.steps() == [1, 3] and m.latest_step(healthy=True) is None
        with pytest.raises(treestore.errors.CheckpointNotFoundError, match=r"restore\(step=1\) loads it"):
            m.restore(healthy=True)
    assert treestore.CheckpointManager(local).steps() == [1, 3]
    assert remote_steps(remote) == [1, 3]


def test_replicate_every_steps(tmp_path):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    with treestore.CheckpointManager(
        local=local, remote=treestore.RemoteTier(remote, replicate_every_steps=5)
    ) as m:
        for step in range(12):
            m.save(step, tree(step))
    assert remote_steps(remote) == [0, 5, 10]


class Gate:
    """Replace the manager's copy: each replication waits until ``release()``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.started: list[str] = []
        real = _replication._copy

        def copy(src: str, dst: str, **kwargs: Any) -> Any:
            self.started.append(src.rpartition("#")[2])
            assert self.open.wait(30)
            return real(src, dst, **kwargs)

        monkeypatch.setattr(_replication, "_copy", copy)

    def release(self) -> None:
        self.open.set()


def test_saves_never_wait_for_uploads_newest_wins_and_local_retention_keeps_the_upload(tmp_path, monkeypatch):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    gate = Gate(monkeypatch)
    m = treestore.CheckpointManager(
        local=local, remote=remote, retention=treestore.Retention(keep_last=1), async_save=False
    )
    m.save(0, tree(0))
    deadline = time.monotonic() + 10
    while not gate.started and time.monotonic() < deadline:
        time.sleep(0.01)
    for step in range(1, 5):  # the upload of step 0 hangs; saves go on
        m.save(step, tree(step))
    # step 0 is being copied and step 4 waits: local retention keeps both
    assert treestore.CheckpointManager(local).steps() == [0, 4]
    gate.release()
    m.wait()
    assert gate.started == ["step-000000000", "step-000000004"]  # 1, 2 and 3 were overtaken
    assert remote_steps(remote) == [0, 4]
    m.save(5, tree(5))
    m.close()
    assert treestore.CheckpointManager(local).steps() == [5]  # retention caught up
    assert remote_steps(remote) == [0, 4, 5]


def test_upload_errors_surface_at_the_next_save_wait_and_close(tmp_path, monkeypatch):
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    real = _replication._copy
    failing = [True]

    def copy(src: str, dst: str, **kwargs: Any) -> Any:
        if failing[0]:
            raise treestore.StorageError(f"writing {dst} failed: remote down")
        return real(src, dst, **kwargs)

    monkeypatch.setattr(_replication, "_copy", copy)
    m = treestore.CheckpointManager(local=local, remote=remote, async_save=False)
    m.save(0, tree(0))
    with pytest.raises(treestore.StorageError, match="remote down") as e:
        m.wait()
    assert any("step-000000000" in note and "saved locally" in note for note in e.value.__notes__)
    m.save(1, tree(1))
    m._replicator.drain()  # type: ignore[union-attr]
    with pytest.raises(treestore.StorageError, match="remote down"):
        m.save(2, tree(2))  # raised before saving: step 2 is not saved
    assert treestore.CheckpointManager(local).steps() == [0, 1]
    m.save(2, tree(2))  # training continues
    m._replicator.drain()  # type: ignore[union-attr]
    failing[0] = False  # the remote is back
    with pytest.raises(treestore.StorageError):  # step 2's upload failed: reported here
        m.save(3, tree(3))
    m.save(3, tree(3))
    m._replicator.drain()  # type: ignore[union-attr]
    with pytest.raises(treestore.StorageError, match="remote down"):
        failing[0] = True
        m.save(4, tree(4))
        m.close()  # the upload error is raised by close
    assert remote_steps(remote) == [3]


def test_constructor_arguments(tmp_path):
    with pytest.raises(treestore.InvalidInputError, match="once"):
        treestore.CheckpointManager(str(tmp_path / "a"), local=str(tmp_path / "b"))
    with pytest.raises(treestore.InvalidInputError, match="once"):
        treestore.CheckpointManager()
    with pytest.raises(treestore.InvalidInputError, match="only with remote="):
        treestore.CheckpointManager(str(tmp_path / "a"), remote_keep_last=2)
    with pytest.raises(treestore.InvalidInputError, match="one store"):
        treestore.CheckpointManager(str(tmp_path / "a"), remote=str(tmp_path / "a"))
    with pytest.raises(treestore.InvalidInputError, match="replicate_every_steps"):
        treestore.CheckpointManager(
            str(tmp_path / "a"), remote=treestore.RemoteTier(str(tmp_path / "b"), replicate_every_steps=0)
        )
    m = treestore.CheckpointManager(str(tmp_path / "a"), remote=str(tmp_path / "b"))
    assert "remote=" in repr(m)
    m.close()


def _spellings(tmp_path):
    """Pairs of URLs that name one store, or a store and one inside it."""
    x = tmp_path / "x"
    x.mkdir()
    (tmp_path / "link").symlink_to(x)
    return [
        (str(x), f"file://{x}"),
        (str(x), str(tmp_path / "x" / ".." / "x")),
        (str(x), str(tmp_path / "link")),
        (f"file://{tmp_path}/link/", str(x)),
        (str(x), str(x / "remote")),
        (str(x / "inner"), str(x)),
        ("memory://tiers/a", "memory://tiers/a/b"),
        ("memory://tiers/a", "memory:///tiers/a/./"),
    ]


def test_one_store_as_both_tiers_is_refused_however_it_is_spelt(tmp_path):
    """Retention of one tier would delete the other's steps: the tiers must be two stores, neither
    inside the other, compared by where they resolve to (not as strings)."""
    for local, remote in _spellings(tmp_path):
        with pytest.raises(treestore.InvalidInputError, match="one store") as info:
            treestore.CheckpointManager(local=local, remote=remote)
        assert "remote" in str(info.value), (local, remote)
    for local, remote in [
        (str(tmp_path / "x"), str(tmp_path / "xy")),
        ("memory://tiers/a", "memory://tiers/ab"),
    ]:
        treestore.CheckpointManager(local=local, remote=remote).close()  # neighbours, not nested


# -- against S3 (moto) --------------------------------------------------------------------------
@pytest.fixture
def fail_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setenv("TREESTORE_UPLOAD_TIMEOUT", "3")


def test_one_bucket_folder_as_both_tiers_is_refused(s3_backend):
    """On an object store the location is the service (endpoint) and the key prefix."""
    opts = s3_backend.storage_options
    url = s3_backend.url("tiers")
    for remote in (url, url + "/./", url + "/inner"):
        with pytest.raises(treestore.InvalidInputError, match="one store"):
            treestore.CheckpointManager(
                url, storage_options=opts, remote=treestore.RemoteTier(remote, storage_options=opts)
            )
    neighbour = s3_backend.url("tiers-2")
    m = treestore.CheckpointManager(
        url, storage_options=opts, remote=treestore.RemoteTier(neighbour, storage_options=opts)
    )
    m.close()


@pytest.mark.timeout(120)
def test_remote_down_mid_replication_then_back(tmp_path, s3_backend, fail_fast):
    host, port = s3_backend.storage_options["endpoint_url"].rsplit("//", 1)[1].split(":")
    proxy = Proxy((host, int(port)))
    try:
        opts = {**s3_backend.storage_options, **FAIL_FAST, "endpoint_url": proxy.url}
        remote = s3_backend.url("run")
        m = treestore.CheckpointManager(
            local=str(tmp_path / "local"),
            remote=treestore.RemoteTier(remote, storage_options=opts),
            retention=treestore.Retention(keep_last=2),
        )
        m.save(0, tree(0))
        m.wait()
        assert remote_steps(remote, **opts) == [0]
        proxy.cut()
        m.save(1, tree(1))  # returns at once: the upload fails in the background
        with pytest.raises(treestore.StorageError):
            m.wait()  # the save is committed locally; wait() reports the upload's failure
        m.save(2, tree(2))  # training continues
        m._collect(block=True)
        m._replicator.drain()  # type: ignore[union-attr]
        with pytest.raises(treestore.StorageError):
            m.save(3, tree(3))  # step 2's upload failed too: reported here, step 3 not saved
        assert treestore.CheckpointManager(str(tmp_path / "local")).steps() == [1, 2]
        proxy.restore()
        m.save(3, tree(3))
        m.close()  # waits for step 3's upload, which succeeds
        assert remote_steps(remote, **opts) == [0, 3]
        assert_tree_equal(treestore.Store(remote, storage_options=opts).load("step-000000003"), tree(3))
    finally:
        proxy.close()


# -- the training program and the kill test ----------------------------------------------------
def train(local: str, remote: str, options: dict[str, Any], total: int, delay: float) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    from tests.support.templates import blank
    from tests.system.test_manager_process import forward, init_mlp_params

    xs = jnp.asarray(np.random.default_rng(0).normal(size=(256, 1)), jnp.float32)
    ys = xs**2
    tx = optax.adam(1e-3)

    def loss_fn(params: Any, x: Any, y: Any) -> Any:
        return jnp.mean((forward(params, x) - y) ** 2)

    @jax.jit
    def train_step(state: dict[str, Any]) -> dict[str, Any]:
        key, sub = jax.random.split(state["key"])
        idx = jax.random.choice(sub, xs.shape[0], (32,), replace=False)
        grads = jax.grad(loss_fn)(state["params"], xs[idx], ys[idx])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state, "key": key}

    init_key, key = jax.random.split(jax.random.key(0))
    params = init_mlp_params([1, 32, 32, 1], init_key)
    state = {"params": params, "opt_state": tx.init(params), "key": key}
    with treestore.CheckpointManager(
        local=local,
        remote=treestore.RemoteTier(remote, storage_options=options, replicate_every_steps=REPLICATE),
        save_every_steps=EVERY,
        retention=treestore.Retention(keep_last=2),
    ) as m:
        start = m.latest_step()
        if start is None:
            start = 0
            m.save(0, state)
        else:
            state = m.restore(like=blank(state))
            print("resumed", start, flush=True)
        replicated = None
        for step in range(start + 1, total + 1):
            state = train_step(state)
            m.save(step, state)
            if m.last_replicated != replicated:
                replicated = m.last_replicated
                print("replicated", replicated, flush=True)
            print("step", step, flush=True)
            time.sleep(delay)
    print("done", flush=True)


def command(local: str, remote: str, options: dict[str, Any], *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tests.api.test_two_tier",
        local,
        remote,
        json.dumps(options),
        str(TOTAL),
        *extra,
    ]


def run(*args: Any) -> str:
    done = subprocess.run(command(*args), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout
    return done.stdout


@pytest.mark.timeout(400)
def test_sigkill_wipe_local_resume_from_s3_is_bit_identical(tmp_path, s3_backend):
    opts = s3_backend.storage_options
    run(str(tmp_path / "a"), s3_backend.url("a"), opts)
    uninterrupted = treestore.CheckpointManager(str(tmp_path / "a")).restore()

    local, remote = str(tmp_path / "b"), s3_backend.url("b")
    proc = subprocess.Popen(
        command(local, remote, opts, "--delay", "0.01"),
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if re.fullmatch(r"replicated [1-9]\d*", line.strip()):
                proc.send_signal(signal.SIGKILL)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines) + out + err
    assert proc.returncode == -signal.SIGKILL, output
    assert "done" not in output
    shutil.rmtree(local)  # the machine is lost with its local tier
    resumed = run(local, remote, opts)
    start = int(re.search(r"resumed (\d+)", resumed).group(1))
    assert start >= REPLICATE and start % REPLICATE == 0
    m = treestore.CheckpointManager(local, storage_options=None)
    assert m.latest_step() == TOTAL
    assert_tree_equal(m.restore(), uninterrupted)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("local")
    parser.add_argument("remote")
    parser.add_argument("options")
    parser.add_argument("total", type=int)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    train(args.local, args.remote, json.loads(args.options), args.total, args.delay)


if __name__ == "__main__":
    main()
