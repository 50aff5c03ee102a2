"""Restores by the processes of a real jax.distributed job, each replicated byte read once or not.

    python -m benchmarks.bench_multihost --restores [--processes 1 2 4 8] [--runs 3] [--leaves 8]
        [--leaf-mib 4]

Each job size N starts N processes on this machine, one CPU device each (gloo collectives), a
(N, 1) mesh (data, model) and a data-parallel tree: ``--leaves`` float32 leaves of
``--leaf-mib`` MiB and as many small ones (4 KiB: biases), every leaf replicated on every
process (``P()``). Each process restores the tree ``--runs`` + 1 times per method:

- treestore from S3 (a moto server on 127.0.0.1 counting the bytes it serves,
  tests/support/counting_moto.py), ``share=False`` (every process reads what it holds: the
  restore before issue 62) and ``share=True`` (each byte read by one process and shared);
- treestore from a local folder, the same two ways;
- orbax (``StandardCheckpointer``, OCDBT) from a local folder, and orbax's single-replica
  restore (``SingleReplicaArrayHandler``: replica 0 reads, then broadcasts). orbax is measured
  on local files only: orbax 0.12.8 did not save to moto's S3 (docs/benchmarks.md, "Restores by
  many processes", says how it failed).

Bytes read per restore, as a multiple of the checkpoint's stored bytes: from S3, what the
server served (every process's reads); from local files, the sum over processes of
``rchar`` of ``/proc/self/io`` across the restore (bytes read by read calls, page cache
included: what the store served). Times: the slowest process's, the first restore (a shared
one compiles its collective and connects gloo; an untimed load from each store comes before
every method, so that no method pays for the process's first S3 client) and the median of the
others. For treestore's
shared restore, the collective's share of the restore: the time process 0 spent in the
collective (``share._bounded``) and in the votes (waiting for the slowest process too), over
its restore time; and the seconds process 0's first shared restore spent compiling its
programs (``share._compiled``, on a thread of its own while the regions are read). The
checkpoints are saved before each job: treestore's by this process, orbax's by the job.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
METHODS = ["treestore-s3-each", "treestore-s3-shared", "treestore-local-each", "treestore-local-shared"]
ORBAX = ["orbax-local", "orbax-local-single-replica"]


def tree(leaves: int, leaf_mib: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    rows = leaf_mib * 2**20 // 4 // 1024
    out = {f"w{i:02d}": rng.standard_normal((rows, 1024)).astype(np.float32) for i in range(leaves)}
    out.update({f"b{i:02d}": rng.standard_normal(1024).astype(np.float32) for i in range(leaves)})
    return out


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _count(endpoint: str, reset: bool) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    url = f"{endpoint}/treestore-count" + ("/reset" if reset else "")
    with opener.open(urllib.request.Request(url, data=b"" if reset else None), timeout=60) as r:
        return int(json.loads(r.read())["get_bytes"])


def worker(argv: list[str]) -> None:
    """One process of the job: every method's restores, a RESULT line per restore."""
    port, pid, count, endpoint, s3_url, local_url, orbax_dir, runs, leaves, leaf_mib = argv
    index, n = int(pid), int(count)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if n > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=index)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import treestore
    from treestore._engine.group import restore_vote
    from treestore._engine.reading import share

    client = jax._src.distributed.global_state.client if n > 1 else None

    def barrier(name: str) -> None:
        if client is not None:
            client.wait_at_barrier(name, 600_000)

    spent = {"collective": 0.0, "votes": 0.0, "compile": 0.0}

    def timed(key: str, run: Any) -> Any:
        """``run`` (a function, or a method once set on its class), its time added to spent[key]."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - started

        return wrapper

    share._bounded = timed("collective", share._bounded)  # type: ignore[assignment]
    share._compiled = timed("compile", share._compiled)  # type: ignore[assignment]
    restore_vote.Vote.agree = timed("votes", restore_vote.Vote.agree)  # type: ignore[method-assign]
    values = tree(int(leaves), int(leaf_mib))
    mesh = Mesh(np.array(jax.devices()).reshape(n, 1), ("data", "model"))
    sharding = NamedSharding(mesh, P())
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in values.items()}
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    options["client_kwargs"] = {"region_name": "us-east-1"}  # type: ignore[assignment]
    restorers = {
        "treestore-s3-each": lambda: treestore.load(
            s3_url, "c", like=like, share=False, storage_options=options
        ),
        "treestore-s3-shared": lambda: treestore.load(
            s3_url, "c", like=like, share=True, storage_options=options
        ),
        "treestore-local-each": lambda: treestore.load(local_url, "c", like=like, share=False),
        "treestore-local-shared": lambda: treestore.load(local_url, "c", like=like, share=True),
    }
    try:
        restorers.update(_orbax(jax, values, sharding, mesh, orbax_dir, barrier))
    except Exception as exc:  # orbax missing or not running on this jax: its rows say so
        print(f"ORBAX {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    # Untimed: the imports and connections every first load in a process makes (an S3 client),
    # whichever method comes first. A shared restore's first run still compiles its collective.
    jax.block_until_ready(restorers["treestore-s3-each"]())
    jax.block_until_ready(restorers["treestore-local-each"]())
    for method, restore in restorers.items():
        for run in range(int(runs) + 1):
            barrier(f"{method}-{run}-ready")
            if index == 0 and "-s3-" in method:
                _count(endpoint, reset=True)
            barrier(f"{method}-{run}-go")
            spent.update(collective=0.0, votes=0.0, compile=0.0)
            before, started = _rchar(), time.perf_counter()
            out = restore()
            jax.block_until_ready(out)
            took, read = time.perf_counter() - started, _rchar() - before
            assert all(
                np.asarray(out[k].addressable_data(0)).tobytes() == values[k].tobytes()
                for k in ("w00", "b00")
            )
            del out
            barrier(f"{method}-{run}-done")
            result = {"method": method, "run": run, "process": index, "seconds": took, "rchar": read, **spent}
            if index == 0 and "-s3-" in method:
                result["served"] = _count(endpoint, reset=False)
            print("RESULT " + json.dumps(result), flush=True)
    barrier("end")
    print(f"OK {index}", flush=True)
    if client is not None:
        client.key_value_set(f"bench-bye/{index}", "1")
        if index == 0:
            for i in range(1, n):
                client.blocking_key_value_get(f"bench-bye/{i}", 60_000)
            time.sleep(0.5)
    os._exit(0)


def _orbax(
    jax: Any, values: dict[str, np.ndarray], sharding: Any, mesh: Any, where: str, barrier: Any
) -> dict:
    """orbax's two restores, after the job saves the tree with orbax at ``where``."""
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from orbax.checkpoint import type_handlers

    arrays = {
        k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i]) for k, v in values.items()
    }
    saver = ocp.StandardCheckpointer()
    saver.save(where, arrays)
    saver.wait_until_finished()
    barrier("orbax-saved")
    if jax.process_index() == 0:
        print(
            f"ORBAX_BYTES {sum(p.stat().st_size for p in Path(where).rglob('*') if p.is_file())}", flush=True
        )
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in values.items()}
    single = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    replica = NamedSharding(Mesh(mesh.devices[:1], mesh.axis_names), P())
    args = {
        k: type_handlers.SingleReplicaArrayRestoreArgs(
            sharding=sharding, single_replica_sharding=replica, global_shape=v.shape, dtype=v.dtype
        )
        for k, v in values.items()
    }

    def single_replica() -> Any:
        handler = type_handlers.SingleReplicaArrayHandler(
            replica_axis_index=0, broadcast_memory_limit_bytes=2**30
        )
        type_handlers.register_type_handler(jax.Array, handler, override=True)
        try:
            return single.restore(where, args=ocp.args.PyTreeRestore(item=like, restore_args=args))
        finally:
            type_handlers.register_type_handler(jax.Array, type_handlers.ArrayHandler(), override=True)

    found = {"orbax-local": lambda: saver.restore(where, like)}
    if jax.process_count() > 1:  # one replica: orbax refuses (nothing to broadcast to)
        found["orbax-local-single-replica"] = single_replica
    return found


def _local_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def run_job(n: int, endpoint: str, s3_url: str, local_url: str, orbax_dir: str, args: Any) -> str:
    """The output of a job of ``n`` worker processes (all of it, every process's)."""
    from tests.support import servers
    from tests.support.process_jobs import run_processes

    port = servers.free_port()
    rest = [endpoint, s3_url, local_url, orbax_dir, str(args.runs), str(args.leaves), str(args.leaf_mib)]
    outputs = run_processes(
        lambda i: ["-m", "benchmarks.multihost_restore", "worker", str(port), str(i), str(n), *rest],
        n,
        timeout=1800,
    )
    for i, (code, out) in enumerate(outputs):
        if code != 0 or f"OK {i}" not in out:
            raise SystemExit(f"process {i} of {n} failed:\n{out[-4000:]}")
    return "\n".join(out for _, out in outputs)


def rows_of(n: int, output: str, stored: dict[str, int]) -> list[tuple[Any, ...]]:
    """The table's rows for a job of ``n`` processes."""
    results = [json.loads(line[7:]) for line in output.splitlines() if line.startswith("RESULT ")]
    orbax = [line for line in output.splitlines() if line.startswith(("ORBAX ", "ORBAX_BYTES "))]
    for line in orbax:
        if line.startswith("ORBAX_BYTES "):
            stored["orbax"] = int(line.split()[1])
    rows = []
    for method in METHODS + ORBAX:
        found = [r for r in results if r["method"] == method]
        if not found:
            why = next((line[6:] for line in orbax if line.startswith("ORBAX ")), "did not run")
            if method == "orbax-local-single-replica" and n == 1:
                why = "one replica: nothing to broadcast (orbax refuses)"
            rows.append((n, method, None, None, None, None, why))
            continue
        runs = sorted({r["run"] for r in found})
        slowest = {run: max(r["seconds"] for r in found if r["run"] == run) for run in runs}
        base = (
            stored["orbax"]
            if method.startswith("orbax")
            else stored["local" if "-local-" in method else "s3"]
        )
        later = runs[1:] or runs
        if "-s3-" in method:
            read = [
                next(r["served"] for r in found if r["run"] == run and r["process"] == 0) for run in later
            ]
        else:
            read = [sum(r["rchar"] for r in found if r["run"] == run) for run in later]
        share = None
        if method.endswith("-shared") and n > 1:
            own = [r for r in found if r["process"] == 0 and r["run"] in later]
            share = statistics.median((r["collective"] + r["votes"]) / r["seconds"] for r in own)
            first = next(r for r in found if r["process"] == 0 and r["run"] == runs[0])
            share = (share, statistics.median(r["collective"] / r["seconds"] for r in own), first["compile"])
        rows.append(
            (
                n,
                method,
                statistics.median(read) / base,
                slowest[runs[0]],
                statistics.median(slowest[r] for r in later),
                share,
                "",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_multihost --restores")
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--leaves", type=int, default=8)
    ap.add_argument("--leaf-mib", type=int, default=4)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import treestore
    from tests.support import servers

    print(
        f"load average before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores", file=sys.stderr, flush=True
    )
    values = tree(args.leaves, args.leaf_mib)
    rows = []
    with servers.moto_s3_server(counting=True) as backend, tempfile.TemporaryDirectory() as tmp:
        s3_url, local_url = backend.url("bench"), f"{tmp}/treestore"
        treestore.save(s3_url, values, "c", storage_options=backend.storage_options)
        treestore.save(local_url, values, "c")
        stored = {
            "s3": sum(backend.filesystem().du(s3_url, total=False).values()),
            "local": _local_bytes(local_url),
        }
        endpoint = backend.storage_options["endpoint_url"]
        for n in args.processes:
            print(f"{n} processes", file=sys.stderr, flush=True)
            output = run_job(n, endpoint, s3_url, local_url, f"{tmp}/orbax-{n}", args)
            rows += rows_of(n, output, stored)
    mib = sum(v.nbytes for v in values.values()) / 2**20
    print(
        f"\nrestores by N processes of one CPU device each, a {mib:.0f} MiB data-parallel tree "
        f"({2 * args.leaves} leaves, every one replicated on every process); bytes read from the "
        f"store per restore as a multiple of the checkpoint's; the slowest process's time, first "
        f"restore and median of the {args.runs} after it\n"
    )
    print(
        "| processes | restore | bytes read × checkpoint | first s | later s "
        "| collective + votes (collective) | first: compiling s |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n, method, ratio, first, later, share, why in rows:
        if ratio is None:
            print(f"| {n} | {method} | – | – | – | {why} | |")
            continue
        shown = "" if share is None else f"{share[0]:.0%} ({share[1]:.0%})"
        compiling = "" if share is None else f"{share[2]:.2f}"
        print(f"| {n} | {method} | {ratio:.2f} | {first:.2f} | {later:.2f} | {shown} | {compiling} |")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
    raise SystemExit(main(sys.argv[1:]))
