"""Saves and loads of trees that live on the accelerator, on whatever backend JAX has.

    python -m benchmarks.bench_device [--quick] [--rounds 3] [--tmp-root DIR] [--no-memory]

Two trees, generated on the device (normal × 0.02; Adam's mu × 0.01, nu = squares × 1e-4):

* a decoder in bfloat16 — 24 layers of d=2048, ffn 8192, embedding [50304, 2048], 1.3B params;
* GPT-2 small in float32 with Adam's ``mu`` and ``nu`` and a step count.

(``--quick``: 2 layers of d=512 and a vocabulary of 8192 in both, for a CPU run in CI.)

In one process, round-robin over the methods, ``--rounds`` rounds: every save gets *fresh*
device arrays (no host copy cached by jax), its timing includes ``os.sync()``, and each load
reads back what its save wrote, onto the default device, until every array is ready. Methods:
treestore (default options; ``stats=False``; ``device_path="never"``, the save that copies the
whole tree to the host first), orbax ``StandardCheckpointer``, ``safetensors.flax``; the bare
``jax.device_get`` / ``jax.device_put`` of the tree; and the time an async save blocks the
training loop, treestore's ``CheckpointManager`` vs orbax's. Each method's first save (the
warm-up round: its compilations and imports, each on a tree of its own) is reported apart; of
treestore's three, only the first is cold. LIMIT: the bare transfer.

Each method's peak resident host memory over its first two saves, above the process's baseline
(its library imported, the trees made), is measured in a process of its own (one at a time:
one process holds a TPU), as a multiple of the tree's bytes. Progress goes to stderr; one markdown
table per tree goes to stdout.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from benchmarks.async_managers import AsyncManager

SAVES = ["treestore", "treestore stats=False", "treestore device_path=never", "orbax", "safetensors"]
LOADS = ["treestore", "orbax", "safetensors"]


def _log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# -- trees, generated on the device ---------------------------------------------------------------
def decoder_shapes(quick: bool) -> dict[str, Any]:
    layers, d, ffn, vocab = (2, 512, 2048, 8192) if quick else (24, 2048, 8192, 50304)
    layer = {
        "qkv": (d, 3 * d),
        "o": (d, d),
        "up": (d, ffn),
        "down": (ffn, d),
        "norm1": (d,),
        "norm2": (d,),
    }
    return {"embed": (vocab, d), "layers": {str(i): dict(layer) for i in range(layers)}, "norm": (d,)}


def gpt2_shapes(quick: bool) -> dict[str, Any]:
    layers, d, vocab, ctx = (2, 256, 8192, 256) if quick else (12, 768, 50257, 1024)
    block = {
        "ln_1": {"g": (d,), "b": (d,)},
        "attn": {"c_attn": {"w": (d, 3 * d), "b": (3 * d,)}, "c_proj": {"w": (d, d), "b": (d,)}},
        "ln_2": {"g": (d,), "b": (d,)},
        "mlp": {"c_fc": {"w": (d, 4 * d), "b": (4 * d,)}, "c_proj": {"w": (4 * d, d), "b": (d,)}},
    }
    return {"wte": (vocab, d), "wpe": (ctx, d), "h": {str(i): block for i in range(layers)}, "ln_f": (d,)}


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def make_tree(kind: str, quick: bool, seed: int) -> Any:
    """A fresh tree of device arrays (new buffers every call), made by one compiled function."""
    import jax

    tree = _generator(kind, quick)(jax.numpy.asarray(seed, jax.numpy.int32))
    jax.block_until_ready(tree)
    return tree


@functools.cache
def _generator(kind: str, quick: bool) -> Any:
    import jax
    import jax.numpy as jnp

    shapes = decoder_shapes(quick) if kind == "decoder" else gpt2_shapes(quick)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    dtype = jnp.bfloat16 if kind == "decoder" else jnp.float32

    def generate(seed: Any) -> Any:
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        made = [
            (jax.random.normal(k, s, jnp.float32) * 0.02).astype(dtype)
            for k, s in zip(keys, leaves, strict=True)
        ]
        params = jax.tree.unflatten(treedef, made)
        if kind == "decoder":
            return params
        mu = jax.tree.map(lambda p: p * 0.5, params)  # normal × 0.01
        nu = jax.tree.map(lambda p: p * p * 1e-4, params)
        return {"params": params, "opt": {"mu": mu, "nu": nu, "count": seed}}

    return jax.jit(generate)


def tree_bytes(tree: Any) -> int:
    import jax

    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


# -- methods ------------------------------------------------------------------------------------
def save_with(method: str, tree: Any, path: str) -> None:
    import treestore

    if method.startswith("treestore"):
        options = treestore.SaveOptions()
        if method.endswith("stats=False"):
            options = treestore.SaveOptions(stats=False)
        elif method.endswith("device_path=never"):
            options = treestore.SaveOptions(device_path="never")
        treestore.save(path, tree, "c", options=options)
    elif method == "orbax":
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        ckptr.save(path, tree)
        ckptr.wait_until_finished()
        ckptr.close()
    elif method == "safetensors":
        from safetensors.flax import save_file

        save_file(_flat(tree), path)
    else:
        raise ValueError(method)
    os.sync()


def load_with(method: str, path: str, like: Any) -> Any:
    import jax

    if method == "treestore":
        import treestore

        out = treestore.load(path, "c", like=like)
    elif method == "orbax":
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        out = ckptr.restore(path, like)
        ckptr.close()
    elif method == "safetensors":
        from safetensors.flax import load_file

        out = load_file(path)
    else:
        raise ValueError(method)
    jax.block_until_ready(out)
    return out


def check_same(method: str, loaded: Any, saved: Any) -> None:
    """Exit naming the method unless ``loaded`` holds the arrays of ``saved``, bit for bit
    (compared on the device; safetensors' load is the flat dict its save wrote)."""
    import jax
    import jax.numpy as jnp

    want = _flat(saved) if method == "safetensors" else saved
    pairs = zip(jax.tree.leaves(loaded), jax.tree.leaves(want), strict=True)
    if isinstance(want, dict) and isinstance(loaded, dict) and sorted(loaded) != sorted(want):
        raise SystemExit(f"{method}: the load's keys differ from the save's")
    for got, expected in pairs:
        same = got.dtype == expected.dtype and got.shape == expected.shape
        if not same or not bool(jnp.array_equal(*(_bits(jnp.asarray(x)) for x in (got, expected)))):
            raise SystemExit(f"{method}: a load did not give back the bytes its save wrote")


def _bits(x: Any) -> Any:
    """``x``'s bits as unsigned integers of its own width, shape kept (a uint8 view of a
    whole leaf would make the TPU lay out a new array many times the leaf's size)."""
    import jax
    import jax.numpy as jnp

    width = x.dtype.itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[width]
    return x if x.dtype == jnp.bool_ else jax.lax.bitcast_convert_type(x, unsigned)


def _abstract(tree: Any) -> Any:
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def async_blocked(method: str, root: str, make: Callable[[int], Any], saves: int) -> list[float]:
    """Seconds each of ``saves`` async saves blocked the loop (every save waited for after)."""
    blocked = []
    manager = AsyncManager(method, root)
    try:
        for step in range(saves):
            tree = make(1000 + step)
            blocked.append(manager.save(step, tree))
            del tree
            manager.wait()
    finally:
        manager.close()
    return blocked


# -- the timed run ---------------------------------------------------------------------------------
def timed(kind: str, quick: bool, rounds: int, root: str) -> dict[str, Any]:
    import jax

    seed = [0]

    def fresh(s: int | None = None) -> Any:
        seed[0] += 1
        return make_tree(kind, quick, seed[0] if s is None else s)

    tree = fresh()
    nbytes = tree_bytes(tree)
    like = _abstract(tree)
    _log(f"{kind}: {len(jax.tree.leaves(tree))} leaves, {nbytes / 1e9:.2f} GB on {jax.devices()[0]}")
    # Warm-up: every method once (compiles, imports), on a tree of its own (no host copies jax
    # cached for another), timed apart as its first save. Only the first of treestore's three
    # is cold for treestore; orbax's and safetensors' are their libraries' first.
    first: dict[str, float] = {}
    for m in SAVES:
        warm = fresh()
        path = os.path.join(root, f"warm-{m}")
        t = time.perf_counter()
        save_with(m, warm, path)
        first[m] = time.perf_counter() - t
        if m in LOADS:
            load_with(m, path, like)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        del warm
    saves: dict[str, list[float]] = {m: [] for m in SAVES}
    loads: dict[str, list[float]] = {m: [] for m in LOADS}
    sizes: dict[str, int] = {}
    bare_get, bare_put = [], []
    for r in range(rounds):
        for m in SAVES:
            t0 = fresh()
            path = os.path.join(root, f"r{r}-{m}")
            t = time.perf_counter()
            save_with(m, t0, path)
            saves[m].append(time.perf_counter() - t)
            sizes[m] = _size(path)
            if m in LOADS:
                t = time.perf_counter()
                out = load_with(m, path, like)
                loads[m].append(time.perf_counter() - t)
                check_same(m, out, t0)  # untimed: each load gives back what its save wrote
                del out
            del t0
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        t0 = fresh()
        t = time.perf_counter()
        host = jax.device_get(t0)
        bare_get.append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(jax.device_put(host))
        bare_put.append(time.perf_counter() - t)
        del t0, host
        _log(f"  round {r + 1}/{rounds} done")
    blocked = {
        m: async_blocked(m, os.path.join(root, f"async-{m}"), fresh, rounds + 1)[1:]
        for m in ("treestore", "orbax")
    }
    return {
        "kind": kind,
        "leaves": len(jax.tree.leaves(tree)),
        "bytes": nbytes,
        "device": str(jax.devices()[0].device_kind),
        "first": first,
        "saves": saves,
        "loads": loads,
        "sizes": sizes,
        "bare_get": bare_get,
        "bare_put": bare_put,
        "blocked": blocked,
    }


def _stats_share(saves: dict[str, list[float]]) -> float:
    """How much longer the default save took than the save without statistics, as a fraction."""
    on, off = _med(saves["treestore"]), _med(saves["treestore stats=False"])
    return on / off - 1 if off else 0.0


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# -- peak host memory, a process per method ----------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory(kind: str, quick: bool, method: str, root: str) -> float:
    """Peak RSS above the baseline over a process's first two saves, as a multiple of the tree's
    bytes. The baseline is taken once the method's library is imported and the trees are on the
    device: memory a first save keeps for the next (buffers, pools, compiled programs) counts,
    as it does in a training job that saves again and again."""
    _import_method(method)
    tree = make_tree(kind, quick, 7)
    first = make_tree(kind, quick, 8)
    base = peak = _rss()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    save_with(method, first, os.path.join(root, "first"))
    del first
    save_with(method, tree, os.path.join(root, "m"))
    done.set()
    thread.join()
    peak = max(peak, _rss())
    return (peak - base) / tree_bytes(tree)


def _import_method(method: str) -> None:
    """Import what ``method`` saves with, so that the baseline holds the library itself."""
    if method.startswith("treestore"):
        import treestore  # noqa: F401
    elif method == "orbax":
        import orbax.checkpoint  # noqa: F401
    elif method == "safetensors":
        import safetensors.flax  # noqa: F401


# -- the table ------------------------------------------------------------------------------------------
def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def table(result: dict[str, Any], memory: dict[str, float]) -> str:
    saves, loads = result["saves"], result["loads"]
    orbax_s, st_s = _med(saves["orbax"]), _med(saves["safetensors"])
    orbax_l, st_l = _med(loads["orbax"]), _med(loads["safetensors"])
    lines = [
        f"**{result['kind']}**: {result['leaves']} leaves, {result['bytes'] / 1e9:.2f} GB, on "
        f"{result['device']}; medians of {len(saves['orbax'])} rounds",
        "",
        "| method | first save (s) | save (s) | × orbax | × safetensors | load (s) | × orbax | "
        "× safetensors | stored (GB) | peak host memory (× tree) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in SAVES:
        s = _med(saves[m])
        load = "— | — | —"
        if m in loads:
            x = _med(loads[m])
            load = f"{x:.3f} | {x / orbax_l:.2f} | {x / st_l:.2f}"
        mem = f"{memory[m]:.2f}" if m in memory else "—"
        cold = result.get("first", {}).get(m)
        lines.append(
            f"| {m} | {'—' if cold is None else f'{cold:.3f}'} | {s:.3f} | {s / orbax_s:.2f} | "
            f"{s / st_s:.2f} | " + load + f" | {result['sizes'][m] / 1e9:.2f} | {mem} |"
        )
    g, p = _med(result["bare_get"]), _med(result["bare_put"])
    lines.append(f"| LIMIT: bare device→host / host→device | | {g:.3f} | | | {p:.3f} | | | | |")
    bt, bo = result["blocked"]["treestore"], result["blocked"]["orbax"]
    lines += [
        "",
        f"Async save, time the loop is blocked: treestore {_med(bt) * 1e3:.1f} ms "
        f"(range {min(bt) * 1e3:.1f}–{max(bt) * 1e3:.1f}), orbax {_med(bo) * 1e3:.1f} ms "
        f"(range {min(bo) * 1e3:.1f}–{max(bo) * 1e3:.1f}).",
        f"Statistics (measured on the host as chunks are hashed): the default save takes "
        f"{_stats_share(saves) * 100:+.1f}% of its time more than `stats=False`.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small trees (a CPU run in CI)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trees", default="decoder,gpt2")
    ap.add_argument("--tmp-root", default=None)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    ap.add_argument("--memory-of", default=None, help="peak memory of these methods only (comma-separated)")
    ap.add_argument("--json", default=None, help="also write the raw figures here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # timed:KIND or memory:KIND:METHOD
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(dir=args.tmp_root, prefix="bench-device-")
    try:
        if args.child:
            what, kind, *rest = args.child.split(":")
            if what == "timed":
                out: Any = timed(kind, args.quick, args.rounds, root)
            else:
                out = peak_memory(kind, args.quick, rest[0], root)
            print(json.dumps(out), flush=True)
            shutil.rmtree(root, ignore_errors=True)
            # The figures are out: skip the accelerator runtime's teardown, which took over 20 s
            # on a TPU and held up the run (a run cut short there lost a finished tree's figures).
            os._exit(0)
        results: dict[str, Any] = {}

        def keep() -> None:  # every figure so far, so that a run cut short still reports
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)

        for kind in args.trees.split(","):
            results[kind] = {"timed": _child(args, f"timed:{kind}"), "memory": {}}
            keep()
            if not args.no_memory:
                for m in SAVES:
                    if m == "treestore stats=False" or (
                        args.memory_of and m not in args.memory_of.split(",")
                    ):
                        continue
                    results[kind]["memory"][m] = _child(args, f"memory:{kind}:{m}")
                    keep()
            print(table(results[kind]["timed"], results[kind]["memory"]), flush=True)
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _child(args: argparse.Namespace, what: str) -> Any:
    """Run one part in a process of its own (one process at a time holds a TPU)."""
    _log(f"[{what}]")
    cmd = [sys.executable, "-m", "benchmarks.bench_device", "--child", what, "--rounds", str(args.rounds)]
    if args.quick:
        cmd.append("--quick")
    if args.tmp_root:
        cmd += ["--tmp-root", args.tmp_root]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
