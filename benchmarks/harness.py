"""Side-by-side checkpoint benchmark harness.

Timing mode (:func:`run_timings`): for every tree x adapter, ``runs`` times
(round-robin over adapters inside each run, to spread machine noise evenly):

* fresh directory ``<tmp_root>/<tree>-<fmt>-rN-XXXX``; checkpoint path is
  ``<that dir>/ckpt`` (adapter creates a file or a dir there);
* ``gc.collect(); os.sync()`` (untimed, so earlier dirty pages are not billed);
* **save** = ``adapter.save(tree, path); os.sync()``  (durability included);
* **load** = ``adapter.load(path, like)`` + convert leaves to ``np.ndarray``
  and touch one byte per 4 KiB page (so lazy/mmapped loads pay for their I/O);
* **one-leaf** = ``adapter.load_one(path, key, like)`` (+ same touch), for the largest leaf;
* **median-leaf** = the same for the median-size leaf (fixed costs show there);
* ``adapter.files_and_bytes(path)``; then the run directory is deleted.

Warm page cache: nothing is dropped, loads read what was just written.  Each
metric is the median over runs.  Correctness is verified once per adapter per
tree (first run): every loaded leaf and the one-leaf result must be
bit-identical (uint8 views) with identical shape and dtype, and the loaded
tree must have exactly the same leaf paths.

Memory mode (:func:`measure_memory`): in fresh subprocesses
(``python -m benchmarks.harness --child save|load ...``) reset the kernel's
RSS high-water mark (``/proc/self/clear_refs`` <- 5) right before the
operation and read ``VmHWM`` after it (fallback: ``ru_maxrss``).  Reported:
baseline RSS just before the op, peak RSS, and (peak - baseline) in MB and as
a ratio to the tree's raw size.  The save child holds the real tree (part of
its baseline); the load child only holds the ``ShapeDtypeStruct`` spec.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from . import limits as L
from . import peers as P
from . import trees as T

MB = 1e6
PAGE = 4096

# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def touch(x: Any) -> np.ndarray:
    """Host ``np.ndarray`` for ``x`` with every page faulted in."""
    a = np.asarray(x)
    if a.size:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        int(flat[::PAGE].sum(dtype=np.uint64))
        int(flat[-1])
    return a


def materialize(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: materialize(v) for k, v in tree.items()}
    return touch(tree)


def _bytes_view(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def leaf_mismatch(want: np.ndarray, got: Any, where: str) -> str | None:
    if not isinstance(got, np.ndarray):
        return f"{where}: got {type(got).__name__}, not np.ndarray"
    if got.dtype != want.dtype:
        return f"{where}: dtype {got.dtype} != {want.dtype}"
    if got.shape != want.shape:
        return f"{where}: shape {got.shape} != {want.shape}"
    if not np.array_equal(_bytes_view(want), _bytes_view(got)):
        return f"{where}: bytes differ"
    return None


def tree_mismatch(want: T.Tree, got: Any) -> str | None:
    if not isinstance(got, dict):
        return f"loaded object is {type(got).__name__}, not dict"
    fw, fg = T.flatten(want), T.flatten(got)
    if fw.keys() != fg.keys():
        missing = sorted(fw.keys() - fg.keys())[:3]
        extra = sorted(fg.keys() - fw.keys())[:3]
        return f"leaf paths differ (missing {missing}, extra {extra})"
    for k in fw:
        err = leaf_mismatch(fw[k], fg[k], k)
        if err:
            return err
    return None


def fs_type(path: str) -> str:
    """Filesystem type of the mount holding ``path`` (Linux; '?' otherwise)."""
    path = os.path.realpath(path)
    best, typ = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mnt, t = parts[1], parts[2]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, typ = mnt, t
    except OSError:
        pass
    return typ


def make_tmp_root(parent: str | None, allow_tmpfs: bool = False) -> str:
    parent = parent or os.environ.get("TREESTORE_BENCH_TMP") or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    typ = fs_type(parent)
    if (typ in ("tmpfs", "ramfs") or os.path.realpath(parent).startswith("/dev/shm")) and not allow_tmpfs:
        raise SystemExit(f"{parent} is on {typ}; pass a local-disk --tmp-root (or --allow-tmpfs)")
    return tempfile.mkdtemp(prefix="treestore-bench-", dir=parent)


def median_time(fn: Callable[[], Any], runs: int) -> float:
    """Median wall time of ``runs`` calls of ``fn``."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------
# timing mode
# --------------------------------------------------------------------------


def _time_one(adapter, path: str, tree, like, key: str, verify: bool) -> tuple[float, str | None]:
    """Seconds of ``adapter.load_one`` of leaf ``key`` (touched), and what it got wrong."""
    t0 = time.perf_counter()
    leaf = touch(adapter.load_one(path, key, like))
    seconds = time.perf_counter() - t0
    return seconds, leaf_mismatch(T.get_leaf(tree, key), leaf, f"load_one({key})") if verify else None


def _one_run(adapter, tree, like, key, median, tmp_root, tag, verify: bool) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(prefix=tag + "-", dir=tmp_root)
    path = os.path.join(run_dir, "ckpt")
    try:
        gc.collect()
        os.sync()
        t0 = time.perf_counter()
        adapter.save(tree, path)
        os.sync()
        save_s = time.perf_counter() - t0

        gc.collect()
        t0 = time.perf_counter()
        out = materialize(adapter.load(path, like))
        load_s = time.perf_counter() - t0
        err = tree_mismatch(tree, out) if verify else None
        del out
        gc.collect()

        one_s, one_err = _time_one(adapter, path, tree, like, key, verify)
        median_s, median_err = _time_one(adapter, path, tree, like, median, verify)
        err = err or one_err or median_err

        files, nbytes = adapter.files_and_bytes(path)
        return dict(
            save_s=save_s,
            load_s=load_s,
            one_s=one_s,
            median_s=median_s,
            files=files,
            bytes=nbytes,
            verify_error=err,
        )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def run_timings(
    adapters: list[P.Adapter],
    tree_names: list[str],
    runs: int = 5,
    tmp_root: str | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Returns ``{"trees": {name: {...raw info}}, "results": {tree: {fmt: {...}}}}``."""
    results: dict[str, dict[str, Any]] = {}
    tree_info: dict[str, Any] = {}
    for tname in tree_names:
        t0 = time.perf_counter()
        tree = T.build(tname)
        like = T.spec(tname)
        key = T.one_leaf_key(tname)
        median = T.median_leaf_key(tree)
        raw = T.nbytes(tree)
        tree_info[tname] = dict(
            raw_bytes=raw,
            leaves=T.num_leaves(tree),
            one_leaf_key=key,
            one_leaf_bytes=T.get_leaf(tree, key).nbytes,
            median_leaf_key=median,
            median_leaf_bytes=T.get_leaf(tree, median).nbytes,
            build_s=time.perf_counter() - t0,
        )
        assert T.nbytes(like) == raw and T.flatten(like).keys() == T.flatten(tree).keys()
        log(
            f"[{tname}] built in {tree_info[tname]['build_s']:.2f}s: {raw / MB:.1f} MB, "
            f"{tree_info[tname]['leaves']} leaves"
        )
        per = results.setdefault(tname, {})
        for a in adapters:
            per[a.name] = dict(samples=[], error=None, verify_error=None, verified=False)
        limit_samples: list[dict[str, float]] = []
        for r in range(runs):
            limit_samples.append(
                L.limits(tree, key, tmp_root, median=median)
            )  # in the same round as the formats
            log(
                f"[{tname}] run {r + 1}/{runs} {'LIMIT':>13}: save {limit_samples[-1]['save_s']:.3f}s "
                f"load {limit_samples[-1]['load_s']:.3f}s one {limit_samples[-1]['one_s']:.4f}s"
            )
            for a in adapters:
                st = per[a.name]
                if st["error"]:
                    continue
                try:
                    s = _one_run(
                        a,
                        tree,
                        like,
                        key,
                        median,
                        tmp_root,
                        f"{tname}-{a.name}-r{r}",
                        verify and not st["verified"],
                    )
                except Exception as e:  # keep going with the other formats
                    st["error"] = f"{type(e).__name__}: {e}"
                    log(f"[{tname}] {a.name}: ERROR {st['error']}")
                    log(traceback.format_exc())
                    continue
                if verify and not st["verified"]:
                    st["verified"] = True
                    st["verify_error"] = s["verify_error"]
                    log(
                        f"[{tname}] {a.name}: verify "
                        f"{'OK' if not s['verify_error'] else 'FAILED: ' + s['verify_error']}"
                    )
                st["samples"].append(s)
                log(
                    f"[{tname}] run {r + 1}/{runs} {a.name:>13}: save {s['save_s']:.3f}s "
                    f"load {s['load_s']:.3f}s "
                    f"one {s['one_s']:.4f}s {s['bytes'] / MB:.1f} MB {s['files']} files"
                )
        for a in adapters:
            st = per[a.name]
            sm = st["samples"]
            st.update(
                save_s=_median([s["save_s"] for s in sm]),
                load_s=_median([s["load_s"] for s in sm]),
                one_s=_median([s["one_s"] for s in sm]),
                median_s=_median([s["median_s"] for s in sm]),
                bytes=int(_median([s["bytes"] for s in sm])) if sm else 0,
                files=int(_median([s["files"] for s in sm])) if sm else 0,
            )
        tree_info[tname]["limit"] = {
            k: _median([s[k] for s in limit_samples]) for k in sorted({k for s in limit_samples for k in s})
        }
        del tree
        gc.collect()
    return dict(trees=tree_info, results=results, runs=runs)


def _fmt_s(x: float) -> str:
    if x != x:  # nan
        return "—"
    return f"{x:.3f}" if x >= 0.01 else f"{x:.4f}"


def _ratio(x: float, ref: float | None) -> str:
    if ref is None or ref != ref or x != x or ref == 0:
        return "—"
    return f"{x / ref:.2f}×"


def environment_header(
    runs: int, tmp_root: str, tree_info: dict[str, Any] | None = None, memory: bool = False
) -> str:
    import psutil

    vers = []
    for mod in ("numpy", "jax", "safetensors", "orbax.checkpoint", "flax"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            vers.append(f"{mod.split('.')[0]} {getattr(m, '__version__', '?')}")
        except Exception:
            pass
    machine = (
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM; python {platform.python_version()}; "
        + ", ".join(vers)
    )
    if memory:
        return "\n".join(
            [
                machine,
                f"- one save child + one load child per row, checkpoint in a fresh dir under `{tmp_root}` "
                f"({fs_type(tmp_root)}); warm page cache; save includes `os.sync()`",
            ]
        )
    lines = [
        machine,
        f"- median of {runs} runs; each run in a fresh dir under `{tmp_root}` "
        f"({fs_type(tmp_root)}, local disk); "
        "**warm page cache** (nothing dropped; loads read back what was just written)",
        "- save s includes `os.sync()` (durability) for every format; load / one-leaf s include "
        "converting to np.ndarray and touching every page; size = apparent bytes of all files; "
        "ratios = format time / safetensors time",
        "- **LIMIT** row: what the machine's components alone allow for that tree, timed in the same "
        "rounds on its bytes (benchmarks/limits.py: BLAKE3, byte-plane transform, zstd, one file "
        "write + fsync / read; summed, split over the cores); `vs limit` = format time / limit",
    ]
    if tree_info:
        lines.append(
            "- trees: "
            + "; ".join(
                f"{n} = {i['raw_bytes'] / MB:.1f} MB raw, {i['leaves']} leaves, "
                f"one-leaf `{i['one_leaf_key']}` "
                f"({i['one_leaf_bytes'] / MB:.3g} MB), median-leaf `{i['median_leaf_key']}` "
                f"({i['median_leaf_bytes'] / 1024:.3g} KiB)"
                for n, i in tree_info.items()
            )
        )
    return "\n".join(lines)


def timing_table(res: dict[str, Any], ref: str = "safetensors") -> str:
    hdr = [
        "tree",
        "format",
        "save s",
        "load s",
        "one-leaf s",
        "median-leaf s",
        "size MB",
        "size/raw",
        "files",
        f"save vs {ref}",
        f"load vs {ref}",
        "save vs limit",
        "load vs limit",
        f"median leaf vs {ref}",
        "median leaf vs limit",
    ]
    rows = ["| " + " | ".join(hdr) + " |", "|" + "|".join(["---", "---"] + ["---:"] * (len(hdr) - 2)) + "|"]
    for tname, per in res["results"].items():
        raw = res["trees"][tname]["raw_bytes"]
        r = per.get(ref)
        rs = r["save_s"] if r and r["samples"] else None
        rl = r["load_s"] if r and r["samples"] else None
        lim = res["trees"][tname].get("limit")
        ls, ll = (lim["save_s"], lim["load_s"]) if lim else (None, None)
        rm = r["median_s"] if r and r["samples"] else None
        lm = lim.get("median_s") if lim else None
        for fmt, st in per.items():
            note = ""
            if st["error"] and not st["samples"]:
                rows.append(f"| {tname} | {fmt} | ERROR: {st['error'][:80]} |" + " |" * (len(hdr) - 3))
                continue
            if st["verify_error"]:
                note = " ⚠ MISMATCH"
            rows.append(
                "| "
                + " | ".join(
                    [
                        tname,
                        fmt + note,
                        _fmt_s(st["save_s"]),
                        _fmt_s(st["load_s"]),
                        _fmt_s(st["one_s"]),
                        _fmt_s(st["median_s"]),
                        f"{st['bytes'] / MB:.1f}",
                        f"{st['bytes'] / raw:.2f}",
                        str(st["files"]),
                        _ratio(st["save_s"], rs),
                        _ratio(st["load_s"], rl),
                        _ratio(st["save_s"], ls),
                        _ratio(st["load_s"], ll),
                        _ratio(st["median_s"], rm),
                        _ratio(st["median_s"], lm),
                    ]
                )
                + " |"
            )
        if lim:
            rows.append(
                "| "
                + " | ".join(
                    [
                        tname,
                        "**LIMIT**",
                        _fmt_s(lim["save_s"]),
                        _fmt_s(lim["load_s"]),
                        _fmt_s(lim["one_s"]),
                        _fmt_s(lm) if lm is not None else "",
                        "",
                        "",
                        "",
                        _ratio(lim["save_s"], rs),
                        _ratio(lim["load_s"], rl),
                        "1.00×",
                        "1.00×",
                        _ratio(lm, rm) if lm is not None else "",
                        "1.00×" if lm is not None else "",
                    ]
                )
                + " |"
            )
    notes = [
        f"- LIMIT {t}: components on one core (s): "
        + ", ".join(f"{k[2:]} {v:.3f}" for k, v in i["limit"].items() if k.startswith("c."))
        + f"; save = ({' + '.join(L.SAVE)}) / {os.cpu_count()} cores, "
        f"load and one-leaf and median-leaf = ({' + '.join(L.LOAD)}) / {os.cpu_count()} cores"
        for t, i in res["trees"].items()
        if i.get("limit")
    ]
    notes += [
        f"- ⚠ {t} / {f}: {st['verify_error'] or st['error']}"
        for t, per in res["results"].items()
        for f, st in per.items()
        if st["verify_error"] or (st["error"] and st["samples"])
    ]
    return "\n".join(rows + (["", *notes] if notes else []))


# --------------------------------------------------------------------------
# memory mode
# --------------------------------------------------------------------------


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_bytes() -> int:
    kb = _status_kb("VmRSS")
    if kb is not None:
        return kb * 1024
    import psutil

    return psutil.Process().memory_info().rss


def _peak_bytes() -> int:
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb * 1024
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def child_main(op: str, fmt: str, tree_name: str, path: str) -> dict[str, Any]:
    adapter = P.resolve(fmt)()
    like = T.spec(tree_name)
    raw = T.nbytes(like)
    tree = T.build(tree_name) if op == "save" else None
    gc.collect()
    baseline = _rss_bytes()
    hwm_reset = _reset_hwm()
    if not hwm_reset:  # high-water mark can't be reset: it includes everything so far
        baseline = max(baseline, _peak_bytes())
    t0 = time.perf_counter()
    if op == "save":
        adapter.save(tree, path)
        os.sync()
        out = None
    else:
        out = materialize(adapter.load(path, like))
    dt = time.perf_counter() - t0
    peak = _peak_bytes()
    ok = None
    if out is not None:
        ok = T.flatten(out).keys() == T.flatten(like).keys()
    adapter.close()
    return dict(
        op=op,
        format=adapter.name,
        tree=tree_name,
        raw_bytes=raw,
        baseline_bytes=baseline,
        peak_bytes=peak,
        seconds=dt,
        hwm_reset=hwm_reset,
        structure_ok=ok,
    )


def _spawn_child(op: str, fmt: str, tree_name: str, path: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.harness",
        "--child",
        op,
        "--format",
        fmt,
        "--tree",
        tree_name,
        "--path",
        path,
    ]
    cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"child {op} {fmt} {tree_name} failed (rc={p.returncode}):\n{p.stderr[-3000:]}")


def measure_memory(fmt: str, tree_name: str, tmp_root: str) -> dict[str, Any]:
    """Peak RSS of save and of load for one adapter on one tree, each in a fresh process."""
    run_dir = tempfile.mkdtemp(prefix=f"mem-{tree_name}-{fmt.replace(':', '_')}-", dir=tmp_root)
    try:
        path = os.path.join(run_dir, "ckpt")
        save = _spawn_child("save", fmt, tree_name, path)
        load = _spawn_child("load", fmt, tree_name, path)
        return dict(save=save, load=load)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def memory_table(rows: list[dict[str, Any]]) -> str:
    hdr = ["tree", "format", "op", "s", "baseline MB", "peak MB", "peak−baseline MB", "(peak−baseline)/raw"]
    out = ["| " + " | ".join(hdr) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(hdr) - 3)) + "|"]
    for m in rows:
        if "error" in m:
            out.append(f"| {m['tree']} | {m['format']} | ERROR: {m['error'][:100]} |" + " |" * (len(hdr) - 3))
            continue
        for op in ("save", "load"):
            r = m[op]
            d = r["peak_bytes"] - r["baseline_bytes"]
            out.append(
                "| "
                + " | ".join(
                    [
                        r["tree"],
                        r["format"],
                        op,
                        _fmt_s(r["seconds"]),
                        f"{r['baseline_bytes'] / MB:.0f}",
                        f"{r['peak_bytes'] / MB:.0f}",
                        f"{d / MB:.0f}",
                        f"{d / r['raw_bytes']:.2f}",
                    ]
                )
                + " |"
            )
    return "\n".join(out)


# --------------------------------------------------------------------------
# entry point (child processes; the user-facing CLI is benchmarks.run_peers)
# --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--child" not in argv:  # not a child: behave like the user-facing CLI
        from . import run_peers

        return run_peers.main(argv)
    ap = argparse.ArgumentParser(prog="python -m benchmarks.harness", allow_abbrev=False)
    ap.add_argument(
        "--child", choices=["save", "load"], required=True, help="internal: run one op, print RESULT json"
    )
    ap.add_argument("--format", required=True)
    ap.add_argument("--tree", required=True)
    ap.add_argument("--path", required=True)
    args = ap.parse_args(argv)
    res = child_main(args.child, args.format, args.tree, args.path)
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
