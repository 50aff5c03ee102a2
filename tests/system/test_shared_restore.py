"""Real jax.distributed processes restore from a real S3 server (moto) that counts the bytes it
serves: every replicated byte is read from the store once and shared over the devices, bit for
bit; a failure or a killed process makes every process raise, none hangs.

Each job runs tests/scripts/restore_worker.py in 2 to 4 processes (gloo collectives on CPU). The
job saves the checkpoint first, with the shardings it restores onto (a multi-process save: each
shard a piece of its own, as a training job's checkpoint is), then restores it with and without
sharing; process 0 reports what the server served for each restore.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import treestore
from tests.scripts.restore_worker import expected
from tests.support import servers
from tests.support.process_jobs import run_processes

WORKER = Path(__file__).parent.parent / "scripts" / "restore_worker.py"
BARRIER_TIMEOUT = 4  # seconds, for the jobs whose process dies
BOUNDED = {"TREESTORE_BARRIER_TIMEOUT": "20"}  # a job that hangs fails in seconds, not in 600
KILLED_JOB = 30  # seconds for a job whose process dies: about 11 s on two cores


@pytest.fixture(scope="module")
def counting_s3() -> Iterator[servers.Backend]:
    with servers.moto_s3_server(counting=True) as backend:
        yield backend


def run_job(
    backend: servers.Backend,
    url: str,
    tree: str,
    steps: str,
    processes: int,
    devices: int,
    env: dict[str, str] | None = None,
    timeout: float = 150,
) -> list[tuple[int, str]]:
    """Each process's exit status and output."""
    port = servers.free_port()
    endpoint = backend.storage_options["endpoint_url"]

    def argv(i: int) -> list[str]:
        return [str(WORKER), str(port), str(i), str(processes), str(devices), endpoint, url, tree, steps]

    return run_processes(argv, processes, timeout=timeout, env=env)


def total(outputs: list[tuple[int, str]]) -> int:
    found = re.search(r"^STORED (\d+)", outputs[0][1], re.M)
    assert found, outputs[0][1][-3000:]
    return int(found.group(1))


def served(outputs: list[tuple[int, str]], step: str) -> int:
    found = re.search(rf"^SERVED {re.escape(step)} .*\"get_bytes\": (\d+)", outputs[0][1], re.M)
    assert found, outputs[0][1][-3000:]
    return int(found.group(1))


def check_ok(outputs: list[tuple[int, str]]) -> None:
    for i, (code, out) in enumerate(outputs):
        assert code == 0 and f"OK {i}" in out, f"process {i} failed:\n{out[-3000:]}"


def damaged(backend: servers.Backend, url: str, split: bool = False) -> None:
    """Checkpoint ``bad`` of the mixed tree at ``url``-bad, one chunk of leaf ``full`` damaged:
    its only chunk, or (``split``: saved in the split tree's chunks of 64 KiB, which a shared
    restore reads in parts) its eleventh of sixteen, inside the part of a reader other than
    process 0."""
    options = treestore.SaveOptions(chunk_size=2**16, small_leaf=4096) if split else None
    treestore.save(
        f"{url}-bad", expected("mixed"), "bad", options=options, storage_options=backend.storage_options
    )
    manifest = treestore.Store(f"{url}-bad", storage_options=backend.storage_options).manifest("bad")
    chunks = next(e for e in manifest.leaves if e.address == "full").chunks
    assert len(chunks) == (16 if split else 1), len(chunks)
    chunk = chunks[10 if split else 0]
    fs = backend.filesystem()
    path = next(p for p in fs.find(f"{url}-bad/chunks") if p.endswith(chunk.digest.hex()))
    data = bytearray(fs.cat_file(path))
    data[-100:] = bytes(100)  # its frame no longer decodes to its digest
    fs.pipe_file(path, bytes(data))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cut", ["host", "device"])
def test_two_processes_read_each_replicated_byte_once(counting_s3, cut):
    """2 processes of 2 devices, a (data, model) mesh: leaves replicated everywhere, replicated
    along data (across processes), sharded, bfloat16 with -0.0 and NaN payloads, bool, a 0-d
    array, int4 (not shareable: read by each holder). Each process reads about half the
    checkpoint; without sharing both read the replicated leaves. A chunk damaged in the leaf one
    process reads makes both raise ChunkDamagedError. The leaves are cut from the gathered bytes
    on the host (CPU devices), or by the accelerators' compiled cut, forced on."""
    counting_s3.reset()
    url = counting_s3.url(f"two-{cut}")
    damaged(counting_s3, url)
    steps = "save:c,share:c,old:c,fails:bad"
    env = {**BOUNDED, "RESTORE_WORKER_CUT": cut}
    outputs = run_job(counting_s3, url, "mixed", steps, processes=2, devices=2, env=env)
    check_ok(outputs)
    once, each, checkpoint = served(outputs, "share:c"), served(outputs, "old:c"), total(outputs)
    assert once <= 1.05 * checkpoint, (once, checkpoint)
    assert each >= 1.8 * checkpoint, (each, checkpoint)  # today's figure: the replicated leaves twice
    raised = [re.search(r"^RAISED (\w+) .*", out, re.M) for _, out in outputs]
    assert all(r and r.group(1) == "ChunkDamagedError" for r in raised), [out[-2000:] for _, out in outputs]
    # one process read the damaged chunk; the other learnt of it from the vote, naming it
    assert sum("multi-process restore of checkpoint 'bad' failed: process" in r.group(0) for r in raised) == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cut", ["host", "device"])
def test_four_processes_read_each_replicated_byte_once(counting_s3, cut):
    """4 processes of 1 device on a (2, 2) mesh of processes: leaves replicated over all four,
    along one axis (two processes each), and sharded; cut on the host, and by the compiled cut.
    Saved in small chunks, the big replicated leaves are each read in parts by several
    processes, every chunk once. A chunk damaged inside one reader's part makes all four raise
    ChunkDamagedError: the reader names it, the three others learn of it from the vote."""
    counting_s3.reset()
    url = counting_s3.url(f"four-{cut}")
    steps = "save:c,share:c,old:c"
    if cut == "host":  # the damage is found by the read, before any cut
        damaged(counting_s3, url, split=True)
        steps += ",fails:bad"
    env = {**BOUNDED, "RESTORE_WORKER_CUT": cut}
    outputs = run_job(counting_s3, url, "split", steps, processes=4, devices=1, env=env)
    check_ok(outputs)
    split = dict(re.findall(r"^SPLIT (\w+) (.*)$", outputs[0][1], re.M))
    assert {"full", "rows"} <= set(split), outputs[0][1][-3000:]
    once, each, checkpoint = served(outputs, "share:c"), served(outputs, "old:c"), total(outputs)
    assert once <= 1.05 * checkpoint, (once, checkpoint)
    assert each >= 2.5 * checkpoint, (each, checkpoint)
    if cut == "host":
        raised = [re.search(r"^RAISED (\w+) .*", out, re.M) for _, out in outputs]
        assert all(r and r.group(1) == "ChunkDamagedError" for r in raised), [o[-2000:] for _, o in outputs]
        learnt = [i for i, r in enumerate(raised) if r and "checkpoint 'bad' failed: process" in r.group(0)]
        assert len(learnt) == 3 and 0 in learnt, raised  # process 0's part holds no damage


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["reading", "sharing"])
def test_a_process_killed_mid_restore_makes_every_survivor_raise(counting_s3, where):
    """3 processes; the last kills itself as it reads its shards, or as the collective starts:
    the other two raise (BarrierTimeoutError at the vote; from the collective, DeviceError when
    gloo sees the connection close, BarrierTimeoutError when it waits for a peer that never
    came) within the barrier timeout, and exit."""
    counting_s3.reset()
    url = counting_s3.url("killed")
    treestore.save(url, expected("replicated"), "c", storage_options=counting_s3.storage_options)
    env = {"TREESTORE_BARRIER_TIMEOUT": str(BARRIER_TIMEOUT)}
    started = time.monotonic()
    outputs = run_job(counting_s3, url, "replicated", f"dies-{where}:c", 3, 1, env, timeout=KILLED_JOB)
    assert outputs[2][0] == -9, outputs[2]  # SIGKILL
    wanted = "(BarrierTimeoutError)" if where == "reading" else "(DeviceError|BarrierTimeoutError)"
    for i, (code, out) in enumerate(outputs[:2]):
        assert code == 0 and f"OK {i}" in out, f"process {i}:\n{out[-3000:]}"
        found = re.search(rf"^RAISED {wanted} ([\d.]+) ", out, re.M)
        assert found, out[-3000:]
        assert float(found.group(2)) <= BARRIER_TIMEOUT + 10, found.group(0)
    assert time.monotonic() - started < KILLED_JOB


@pytest.mark.timeout(300)
def test_process_0_killed_mid_restore_ends_every_survivor_with_no_tree(counting_s3):
    """Process 0 holds the job's coordination service: when it dies, jax's runtime ends the
    other processes itself (it aborts them, a fatal error in its coordination agent), before any
    vote of treestore's can raise. What treestore owes them still holds: none hangs, and none
    returns a tree."""
    counting_s3.reset()
    url = counting_s3.url("killed-0")
    treestore.save(url, expected("replicated"), "c", storage_options=counting_s3.storage_options)
    env = {"TREESTORE_BARRIER_TIMEOUT": str(BARRIER_TIMEOUT)}
    outputs = run_job(counting_s3, url, "replicated", "dies0-reading:c", 3, 1, env, timeout=KILLED_JOB)
    assert outputs[0][0] == -9, outputs[0]  # SIGKILL
    for i, (code, out) in enumerate(outputs[1:], start=1):
        raised = re.search(r"^RAISED \w+Error ", out, re.M) is not None
        ended_by_jax = code == -6 and "JAX distributed service detected fatal errors" in out  # SIGABRT
        assert raised or ended_by_jax, f"process {i}:\n{out[-3000:]}"
        assert "the load returned" not in out, out[-3000:]
