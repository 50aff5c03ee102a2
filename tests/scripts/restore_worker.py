"""One process of a jax.distributed job that restores a checkpoint from S3 (tests only).

usage: restore_worker.py PORT PROCESS_ID PROCESSES DEVICES ENDPOINT URL TREE STEPS

Each process has DEVICES CPU devices (gloo collectives between processes); the mesh is
(data, model): ``data`` across processes, ``model`` across each process's devices, or with one
device per process, a (2, PROCESSES / 2) mesh of the processes. TREE names the tree
(:func:`expected`) and its partition specs (:func:`specs`); ``split`` is the ``mixed`` tree saved
in chunks of 64 KiB, so that a shared restore reads its big leaves in parts (process 0 prints
``SPLIT <address> <rows of each part>`` for each). STEPS is a comma-separated list of
``how:checkpoint``, run in order by every process; checkpoint ``c`` is in the store at URL, any
other ``NAME`` in the store at ``URL-NAME``. ``how`` is one of:

- ``save``: every process saves the tree as arrays on the mesh (a multi-process save, each
  shard written once), and process 0 prints ``STORED <bytes of every object of the store>``.
- ``share``: ``treestore.load(..., share=True)`` (the default); ``old``: ``share=False``. Every
  shard of every leaf is checked bit for bit. Process 0 zeroes the server's count before the
  load and prints ``SERVED <step> <json>`` after every process has loaded.
- ``fails``: the load must raise a TreestoreError on every process; each prints
  ``RAISED <class> <message>``.
- ``dies-reading``: the last process kills itself (SIGKILL) as it reads its shards; the others
  must raise a TreestoreError (they print ``RAISED <class> <seconds> <message>``).
- ``dies-sharing``: the last process kills itself as the collective starts, after the vote.
- ``dies0-reading``: process 0, which holds the job's coordination service, kills itself as it
  reads its shards.

Prints ``OK <process id>`` at the end; the process exits with os._exit (a job whose process died
cannot shut jax.distributed down cleanly), process 0 last.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def expected(tree: str) -> dict[str, np.ndarray]:
    """The tree the test saves."""
    import ml_dtypes

    rng = np.random.default_rng(7)
    half = rng.integers(0, 2**16, (64, 128), dtype=np.uint16)
    half[0, :4] = [0x8000, 0x7FC1, 0xFFFF, 0x7F81]  # -0.0 and NaNs with payloads, kept bit for bit
    values = {
        "full": rng.standard_normal((512, 512)).astype(np.float32),  # replicated everywhere
        "rows": rng.standard_normal((512, 512)).astype(np.float32),  # replicated along data
        "sharded": rng.standard_normal((1024, 64)).astype(np.float32),  # no replication
        "half": half.view(ml_dtypes.bfloat16),
        "mask": rng.integers(0, 2, 300).astype(bool),
        "step": np.array(1234, np.int32),
        "nibbles": rng.integers(-8, 8, 64).astype(ml_dtypes.int4),  # sub-byte: read by each holder
    }
    values["full"][0, :2] = [-0.0, np.float32("nan")]
    if tree == "replicated":
        return {k: values[k] for k in ("full", "step")}
    return values


def specs(tree: str) -> dict[str, tuple]:
    """Each leaf's partition spec over the (data, model) mesh."""
    return {
        "full": (),
        "rows": ("model",),
        "sharded": (("data", "model"),),
        "half": (None, "model"),
        "mask": (),
        "step": (),
        "nibbles": (),
    }


def counted(endpoint: str, reset: bool) -> dict[str, int]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    url = f"{endpoint}/treestore-count" + ("/reset" if reset else "")
    with opener.open(urllib.request.Request(url, data=b"" if reset else None), timeout=30) as r:
        return json.loads(r.read())


def main() -> None:
    port, pid, nproc, devices, endpoint, url, tree, steps = sys.argv[1:]
    index, count = int(pid), int(nproc)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=count, process_id=index)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import treestore

    kind = tree
    saving = treestore.SaveOptions(chunk_size=2**16, small_leaf=4096) if kind == "split" else None
    if index == 0:  # each leaf a shared restore reads in parts, as the plan splits it
        from treestore._engine.reading import share_plan

        parts_of = share_plan._parts

        def reported(s, columns, share):  # type: ignore[no-untyped-def]
            found = parts_of(s, columns, share)
            if len(found) > 1:
                print(f"SPLIT {s.slot.address} {[p.rows for p in found]}", flush=True)
            return found

        share_plan._parts = reported

    if os.environ.get("RESTORE_WORKER_CUT") == "device":  # the accelerators' cut, on CPU devices
        from treestore._engine.reading import share

        share.cuts_on_device = lambda mesh: True

    client = jax._src.distributed.global_state.client
    options = {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    grid = np.array(jax.devices()).reshape(count, -1)
    if grid.shape[1] == 1 and count % 2 == 0:
        grid = grid.reshape(2, count // 2)
    mesh = Mesh(grid, ("data", "model"))
    values = expected(tree)
    shardings = {k: NamedSharding(mesh, P(*specs(tree)[k])) for k in values}
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in values.items()}
    for n, step in enumerate(steps.split(",")):
        how, name = step.split(":")
        store = url if name == "c" else f"{url}-{name}"
        client.wait_at_barrier(f"test-{n}-ready", 120_000)
        if how == "save":
            tree = {
                k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i])
                for k, v in values.items()
            }
            treestore.save(store, tree, name, options=saving, storage_options=options)
            if index == 0:
                import fsspec

                found = fsspec.filesystem("s3", **options).du(store, total=False)
                print(f"STORED {sum(found.values())}", flush=True)
            continue
        if index == 0 and how in ("share", "old"):
            counted(endpoint, reset=True)
        client.wait_at_barrier(f"test-{n}-go", 120_000)
        if how.startswith("dies") and index == (0 if how.startswith("dies0") else count - 1):
            _die_in(how)
        started = time.monotonic()
        try:
            out = treestore.load(store, name, like=like, share=how != "old", storage_options=options)
        except treestore.TreestoreError as exc:
            took = time.monotonic() - started
            print(f"RAISED {type(exc).__name__} {took:.1f} {str(exc)[:600]!r}", flush=True)
            if how == "share" or how == "old":
                raise
            continue
        if how not in ("share", "old"):
            raise SystemExit(f"step {step}: the load returned")
        for k, v in values.items():
            assert out[k].sharding == shardings[k], k
            for shard in out[k].addressable_shards:
                got = np.asarray(shard.data)
                assert got.dtype == v.dtype and got.tobytes() == v[shard.index].tobytes(), (k, shard.index)
        print(f"LOADED {step} {time.monotonic() - started:.2f}", flush=True)
        client.wait_at_barrier(f"test-{n}-done", 120_000)
        if index == 0:
            print(f"SERVED {step} {json.dumps(counted(endpoint, reset=False))}", flush=True)
    print(f"OK {index}", flush=True)
    # Process 0 holds the job's coordination service: it leaves last, or the others' jax aborts
    # them. A process killed by a step is not waited for.
    client.key_value_set(f"test-bye/{index}", "1")
    if index == 0:
        killed = any(step.startswith("dies") for step in steps.split(","))
        for i in range(1, count - killed):
            client.blocking_key_value_get(f"test-bye/{i}", 60_000)
        time.sleep(0.5)
    os._exit(0)


def _die_in(how: str) -> None:
    """Kill this process as it reads its shards, or as the collective starts."""
    from treestore._engine.reading import region as _region
    from treestore._engine.reading import share as _share

    def die(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if how.endswith("-reading"):
        _region.read_many = die  # type: ignore[assignment]
    else:
        _share._bounded = die  # type: ignore[assignment]


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
