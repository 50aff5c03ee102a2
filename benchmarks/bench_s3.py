"""treestore on S3 (a local moto server) against raw s3fs, side by side.

    python -m benchmarks.bench_s3 [--tree gpt2|gpt2-half|gpt2-quarter] [--runs 3] [--no-orbax]

Starts its own moto server on a free 127.0.0.1 port (tests/support/servers.py), builds the GPT-2-small-shaped
fp32 tree (``benchmarks.trees.gpt2_small``, about 498 MB) and measures, median of ``--runs``:

* raw s3fs: ``pipe_file`` of all leaves' bytes concatenated as one object, and ``cat_file`` of it
  back (s3fs's own multipart upload and concurrent ranged download, its defaults);
* treestore ``save`` and ``load`` of the tree to ``s3://`` (default options: 4 MiB chunks, zstd byte
  planes, a bounded thread pool of requests), and the ratio to raw s3fs (target: at least 0.8x);
* a one-leaf partial load, ``np.asarray(treestore.open(url)["wte"])``: every read request is
  counted, and the bytes requested are compared with the stored bytes of that leaf's chunks;
* an incremental save (first run only): the tree with one leaf changed (``h/0/mlp/c_fc/w``), saved
  trusting the previous checkpoint's chunks (the default) and with ``trust_previous=False``; the
  chunk requests each sent (``SaveResult``: existence checks, reuse reads, writes) and its time;
* orbax ``StandardCheckpointer`` to the same ``s3://`` bucket, if it can target it (tried in a
  subprocess with a time limit; the table says why not otherwise).

Prints one markdown table on stdout (progress on stderr). The server and every request stay on
127.0.0.1. moto keeps objects in memory: each run's objects are deleted before the next.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

import numpy as np

import treestore
from treestore._format import paths as _paths
from treestore._storage.base import Storage

from . import trees as T

MB = 1e6
TARGET = 0.8
LEAF = "wte"
CHANGED = ("h", "0", "mlp", "c_fc", "w")  # the leaf an incremental save changes


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def build_tree(name: str) -> dict[str, Any]:
    tree = T.gpt2_small()
    if name == "gpt2":
        return tree
    keep = {"gpt2-half": 6, "gpt2-quarter": 2}[name]  # transformer blocks kept (wte, wpe stay)
    tree["h"] = {k: v for k, v in tree["h"].items() if int(k) < keep}
    return tree


def with_changed_leaf(tree: dict[str, Any], delta: float) -> dict[str, Any]:
    """``tree`` with the leaf at ``CHANGED`` shifted by ``delta`` (the dicts on its path copied)."""

    def replaced(node: Any, path: tuple[str, ...]) -> Any:
        if not path:
            return node + np.float32(delta)
        return {**node, path[0]: replaced(node[path[0]], path[1:])}

    out: dict[str, Any] = replaced(tree, CHANGED)
    return out


def requests_text(r: treestore.types.SaveResult) -> str:
    total = r.chunks_written + r.chunks_reused
    return (
        f"{r.chunk_requests} chunk requests ({r.existence_checks} HEAD, {r.reuse_reads} GET, "
        f"{r.chunks_written} PUT; {r.chunks_trusted} of {total} chunks trusted)"
    )


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class RequestCounter:
    """Counts treestore's read requests (each ``Storage.read_range`` is one ranged GET)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int, int]] = []  # (path, bytes asked for, bytes returned)
        self._lock = threading.Lock()
        self._original = Storage.read_range

    def __enter__(self) -> RequestCounter:
        original = self._original
        counter = self

        def counting(storage: Storage, path: str, start: int, end: int) -> bytes | None:
            data = original(storage, path, start, end)
            with counter._lock:
                counter.requests.append((path, end - start, len(data or b"")))
            return data

        Storage.read_range = counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Storage.read_range = self._original  # type: ignore[method-assign]


def orbax_attempt(endpoint: str, bucket: str, timeout: float) -> str:
    """Try orbax StandardCheckpointer to s3://bucket in a subprocess; a line saying what happened."""
    code = textwrap.dedent(
        f"""
        import os, sys, time, logging
        import numpy as np
        logging.disable(logging.WARNING)
        import orbax.checkpoint as ocp
        tree = {{"w": np.arange(1 << 20, dtype=np.float32)}}
        ck = ocp.StandardCheckpointer()
        t = time.perf_counter()
        ck.save("s3://{bucket}/orbax/ckpt", tree)
        ck.wait_until_finished()
        print("saved", time.perf_counter() - t)
        """
    )
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",
        "JAX_PLATFORMS": "cpu",
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return f"orbax did not finish a 4 MB save to s3:// within {timeout:.0f} s"
    if proc.returncode == 0 and "saved" in proc.stdout:
        return "orbax saved to s3:// (see --orbax-full)"
    lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit status {proc.returncode}"
    return f"cannot target s3:// here (its path layer, etils.epath, takes it for a local path): {last[:120]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_s3", description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default="gpt2", choices=["gpt2", "gpt2-half", "gpt2-quarter"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-orbax", action="store_true", help="skip the orbax attempt")
    args = ap.parse_args(argv)

    from tests.support import servers  # the moto server context manager the tests use

    log(f"building the {args.tree} tree ...")
    tree = build_tree(args.tree)
    flat = T.flatten(tree)
    nbytes = sum(a.nbytes for a in flat.values())
    blob = b"".join(np.ascontiguousarray(a).tobytes() for a in flat.values())
    assert len(blob) == nbytes
    log(f"{len(flat)} leaves, {nbytes / MB:.1f} MB")

    samples: dict[str, list[float]] = {k: [] for k in ("raw_save", "raw_load", "ts_save", "ts_load", "one")}
    partial: dict[str, Any] = {}
    incremental: dict[str, Any] = {}
    stored_total = 0
    with servers.moto_s3_server() as backend:
        opts = backend.storage_options
        import fsspec

        fs = fsspec.filesystem("s3", **opts)
        for run in range(args.runs):
            backend.reset()
            fs.invalidate_cache()
            raw = backend.url("raw", "blob.bin")
            dt, _ = timed(lambda: fs.pipe_file(raw, blob))  # noqa: B023
            samples["raw_save"].append(dt)
            dt, back = timed(lambda: fs.cat_file(raw))  # noqa: B023
            samples["raw_load"].append(dt)
            assert len(back) == nbytes
            del back
            fs.rm(raw)

            url = backend.url(f"store-{run}")
            store = treestore.Store(url, storage_options=opts)
            dt, result = timed(lambda: store.save(tree, "ckpt"))  # noqa: B023
            samples["ts_save"].append(dt)
            stored_total = sum(o.size for o in store._storage.list(_paths.CHUNKS))
            dt, loaded = timed(lambda: treestore.Store(url, storage_options=opts).load("ckpt"))  # noqa: B023
            samples["ts_load"].append(dt)
            if run == 0:
                got = T.flatten(loaded)
                assert got.keys() == flat.keys()
                assert all(np.array_equal(got[k], flat[k]) for k in flat), "loaded tree differs"
            del loaded

            with RequestCounter() as counter:
                ckpt = treestore.open(url, "ckpt", storage_options=opts)
                before = len(counter.requests)
                dt, leaf = timed(lambda: np.asarray(ckpt[LEAF]))  # noqa: B023
            samples["one"].append(dt)
            assert np.array_equal(leaf, flat[LEAF])
            entry = ckpt[LEAF].entry
            chunk_reqs = counter.requests[before:]
            own = {_paths.chunk_path(c.digest) for c in entry.chunks}
            partial = {
                "leaf_mb": leaf.nbytes / MB,
                "chunks": len(entry.chunks),
                "stored": sum(c.stored_size for c in entry.chunks),
                "requests": len(chunk_reqs),
                "returned": sum(n for _, _, n in chunk_reqs),
                "asked": sum(n for _, n, _ in chunk_reqs),
                "other_paths": sorted({q for q, _, _ in chunk_reqs} - own),
                "setup_requests": before,
            }
            log(
                f"run {run + 1}/{args.runs}: raw {samples['raw_save'][-1]:.2f}/"
                f"{samples['raw_load'][-1]:.2f} s, "
                f"treestore {samples['ts_save'][-1]:.2f}/{samples['ts_load'][-1]:.2f} s "
                f"({result.chunks_written} chunks), one leaf {samples['one'][-1]:.2f} s"
            )
            if run == 0:
                incremental["first"] = result
                step = with_changed_leaf(tree, 1.0)
                incremental["trusted"] = timed(lambda: store.save(step, "step-trusted"))  # noqa: B023
                step = with_changed_leaf(tree, 2.0)
                incremental["checked"] = timed(
                    lambda: store.save(step, "step-checked", trust_previous=False)  # noqa: B023
                )
                del step
                log(f"incremental saves: {incremental['trusted'][0]:.2f} / {incremental['checked'][0]:.2f} s")
            fs.rm(url, recursive=True)
        orbax_line = "skipped (--no-orbax)"
        if not args.no_orbax:
            log("trying orbax against the same server ...")
            orbax_line = orbax_attempt(opts["endpoint_url"], backend.url_root.split("://", 1)[1], 90)

    med = {k: statistics.median(v) for k, v in samples.items()}
    rate = {k: nbytes / MB / med[k] for k in ("raw_save", "raw_load", "ts_save", "ts_load")}
    save_ratio = rate["ts_save"] / rate["raw_save"]
    load_ratio = rate["ts_load"] / rate["raw_load"]

    def met(ok: bool) -> str:
        return "met" if ok else "**not met**"

    p = partial
    only_leaf = not p["other_paths"] and p["returned"] == p["stored"]
    print(
        f"\n### treestore vs raw s3fs on moto S3 — {args.tree} tree: {len(flat)} leaves, "
        f"{nbytes / MB:.0f} MB fp32; median of {args.runs} runs; 127.0.0.1, {os.cpu_count()} CPUs\n"
    )
    print("| measure | raw s3fs (one object) | treestore | treestore / raw | target | result |")
    print("|---|---|---|---|---|---|")
    print(
        f"| save | {rate['raw_save']:.0f} MB/s ({med['raw_save']:.2f} s) | {rate['ts_save']:.0f} MB/s "
        f"({med['ts_save']:.2f} s; {stored_total / MB:.0f} MB stored) | {save_ratio:.2f}x | ≥ {TARGET}x | "
        f"{met(save_ratio >= TARGET)} |"
    )
    print(
        f"| load | {rate['raw_load']:.0f} MB/s ({med['raw_load']:.2f} s) | {rate['ts_load']:.0f} MB/s "
        f"({med['ts_load']:.2f} s) | {load_ratio:.2f}x | ≥ {TARGET}x | {met(load_ratio >= TARGET)} |"
    )
    print(
        f"| one-leaf load `{LEAF}` ({p['leaf_mb']:.0f} MB, {p['chunks']} chunks) | — | {med['one']:.2f} s; "
        f"{p['requests']} ranged GETs returning {p['returned'] / MB:.1f} MB = its chunks' stored "
        f"{p['stored'] / MB:.1f} MB (+{p['setup_requests']} GETs to open: commit record, manifest) | "
        f"{p['returned'] / nbytes:.0%} of the tree read | reads only that leaf's chunks | "
        f"{met(only_leaf)} |"
    )
    (dt_t, trusted), (dt_c, checked) = incremental["trusted"], incremental["checked"]
    proportional = trusted.reuse_reads == 0 and trusted.existence_checks == trusted.chunks_written
    print(
        f"| first save: requests | — | {requests_text(incremental['first'])} | — | "
        "a HEAD and a PUT per chunk | — |"
    )
    print(
        f"| incremental save, `{'/'.join(CHANGED)}` changed (default: previous checkpoint trusted) | — | "
        f"{dt_t:.2f} s; {requests_text(trusted)} | — | requests only for changed chunks | "
        f"{met(proportional)} |"
    )
    print(
        f"| incremental save, `trust_previous=False` | — | {dt_c:.2f} s; {requests_text(checked)} | — | "
        "— | — |"
    )
    print(f"| orbax StandardCheckpointer to s3:// | — | {orbax_line} | — | — | — |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
