"""CLI: side-by-side checkpoint benchmark.

    python -m benchmarks.run_peers --trees minilm-fp32,minilm-bf16,gpt2,small --runs 5 \\
        --formats safetensors,orbax,flax-msgpack,npz,pickle

    # peak RSS of save / load (fresh subprocess per op):
    python -m benchmarks.run_peers --memory --trees gpt2 --formats safetensors,orbax

Formats are names registered in ``benchmarks.peers`` (``@register``) or
``module:Class`` specs.  Progress goes to stderr; the markdown report goes to
stdout (and ``--out FILE``).  ``--json FILE`` dumps every per-run sample.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import time

from . import harness as H
from . import peers as P
from . import trees as T


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.run_peers",
        allow_abbrev=False,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--trees", type=_csv, default=list(T.TREES), help=f"comma list from {list(T.TREES)}")
    ap.add_argument(
        "--formats",
        type=_csv,
        default=list(P.DEFAULT_FORMATS),
        help=f"comma list of adapter names ({sorted(P.ADAPTERS)}) or module:Class",
    )
    ap.add_argument(
        "--runs", type=int, default=5, help="runs per tree x format; medians reported (default 5)"
    )
    ap.add_argument(
        "--tmp-root",
        default=None,
        help="parent dir for run dirs (local disk; default $TREESTORE_BENCH_TMP or the system temp dir)",
    )
    ap.add_argument(
        "--allow-tmpfs", action="store_true", help="allow a tmpfs --tmp-root (not a fair disk benchmark)"
    )
    ap.add_argument("--no-verify", action="store_true", help="skip the once-per-adapter bit-identity check")
    ap.add_argument("--memory", action="store_true", help="measure peak RSS of save/load instead of timings")
    ap.add_argument("--json", default=None, help="write raw results as JSON here")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    args = ap.parse_args(argv)

    bad = [t for t in args.trees if t not in T.TREES]
    if bad:
        ap.error(f"unknown trees {bad}; known: {list(T.TREES)}")
    for f in args.formats:  # fail fast on typos
        P.resolve(f)

    tmp_root = H.make_tmp_root(args.tmp_root, args.allow_tmpfs)
    t_start = time.perf_counter()
    failed = False
    try:
        if args.memory:
            rows = []
            for tname in args.trees:
                for fmt in args.formats:
                    H.log(f"[memory] {tname} {fmt} ...")
                    try:
                        m = H.measure_memory(fmt, tname, tmp_root)
                    except Exception as e:
                        failed = True
                        m = dict(tree=tname, format=fmt, error=f"{type(e).__name__}: {e}")
                        H.log(m["error"])
                    rows.append(m)
            report = "\n".join(
                [
                    "## Peak resident memory (fresh subprocess per op)",
                    "",
                    H.environment_header(1, tmp_root, memory=True),
                    "- baseline = RSS right before the op (save: process holds the tree; load: only the "
                    "ShapeDtypeStruct spec); peak = VmHWM after resetting it via /proc/self/clear_refs; "
                    "raw = the tree's array bytes; RSS includes file-backed pages a format mmaps",
                    "",
                    H.memory_table(rows),
                ]
            )
            raw = rows
        else:
            adapters = P.make(args.formats)
            try:
                res = H.run_timings(
                    adapters, args.trees, runs=args.runs, tmp_root=tmp_root, verify=not args.no_verify
                )
            finally:
                for a in adapters:
                    with contextlib.suppress(Exception):
                        a.close()
            failed = any(
                st["error"] or st["verify_error"] for per in res["results"].values() for st in per.values()
            )
            report = "\n".join(
                [
                    "## Checkpoint formats, side by side",
                    "",
                    H.environment_header(args.runs, tmp_root, res["trees"]),
                    f"- total benchmark wall time {time.perf_counter() - t_start:.0f}s",
                    "",
                    H.timing_table(res),
                ]
            )
            raw = res
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)

    print(report, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
