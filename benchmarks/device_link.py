"""How fast device arrays reach host memory, by each route jax offers: the floor of a save's
staging on an accelerator, by dtype and shape.

    python -m benchmarks.device_link [--quick] [--total-mib N]

For each case, ``--total-mib`` of leaves of one dtype and shape are made on the device, anew for
each route (a jax array caches its host copy, so a route timed on arrays another route fetched
would be timed on nothing), and moved to the host by:

* ``device_get``: ``jax.device_get`` of the list (every transfer started, then each waited for);
* ``one by one``: ``np.asarray`` of each leaf in turn, none started ahead;
* ``pinned_host``: ``jax.device_put`` of each leaf into the ``pinned_host`` memory kind, then
  ``np.asarray`` of each (where the device has that kind);
* ``treestore fetch``: the path a save of device arrays takes
  (:class:`treestore._engine.saving.device_fetch.Fetcher`, default ``SaveOptions``: leaves over
  16 MiB cut into slices on the device, in a 64 MiB window), its chunks dropped as they come
  instead of hashed, compressed and written.

Two host figures go beside them: filling fresh memory (``np.empty`` then ``fill``: the page
faults a fresh host buffer costs) and filling it again (memory bandwidth alone). On the CPU the
transfers are views of device memory and the figures mean nothing; ``--quick`` is the test
that the script runs. Each figure goes to stderr as it is measured (for a run cut short), then one
markdown table to stdout; medians of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

MiB = 1 << 20
CASES = [  # dtype, leaf shape (of 256 MiB, 64 MiB, 16 MiB, 4 MiB leaves)
    ("bfloat16", (131072, 1024)),
    ("float32", (65536, 1024)),
    ("bfloat16", (16384, 8192)),
    ("bfloat16", (134217728,)),
    ("float32", (67108864,)),
    ("bfloat16", (16384, 2048)),
    ("bfloat16", (4096, 2048)),
    ("float32", (2048, 2048)),
    ("int8", (2048, 2048)),
]


@functools.cache
def _generator(dtype: str, shape: tuple[int, ...]) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(dtype))


def _make(dtype: str, shape: tuple[int, ...], count: int, seed: int) -> list[Any]:
    import jax

    make = _generator(dtype, shape)
    xs = [make(jax.random.key(seed + i)) for i in range(count)]
    jax.block_until_ready(xs)
    return xs


def _one_by_one(xs: list[Any]) -> list[np.ndarray[Any, Any]]:
    return [np.asarray(x) for x in xs]


def _pinned(xs: list[Any]) -> list[np.ndarray[Any, Any]]:
    import jax

    moved = [jax.device_put(x, x.sharding.with_memory_kind("pinned_host")) for x in xs]
    return [np.asarray(p) for p in moved]


def _fetched(xs: list[Any]) -> int:
    """Bytes of ``xs`` a save's fetcher hands over, chunk by chunk (each dropped at once)."""
    import concurrent.futures as cf

    from treestore._engine.saving.device_fetch import Fetcher, Window, chunk_step
    from treestore._engine.write import SaveOptions

    options = SaveOptions()
    fetcher = Fetcher(Window(options.window), options.chunk_size)
    got = [0]

    def drop(raw: np.ndarray[Any, Any]) -> cf.Future[None]:
        got[0] += raw.nbytes
        done: cf.Future[None] = cf.Future()
        done.set_result(None)
        return done

    for i, x in enumerate(xs):
        fetcher.add(x, chunk_step(x.dtype.itemsize, options.chunk_size), drop, address=f"l{i}")
    fetcher.run()
    held = sum(int(x.nbytes) for x in xs)
    if got[0] != held:  # a route that lost bytes would look fast
        raise AssertionError(f"the fetcher handed over {got[0]} bytes of {held}")
    return got[0]


def _routes() -> dict[str, Callable[[list[Any]], Any]]:
    import jax

    routes: dict[str, Callable[[list[Any]], Any]] = {"device_get": jax.device_get, "one by one": _one_by_one}
    if any(m.kind == "pinned_host" for m in jax.devices()[0].addressable_memories()):
        routes["pinned_host"] = _pinned
    routes["treestore fetch"] = _fetched
    return routes


def _rate(nbytes: int, run: Callable[..., Any], *args: Any) -> float:
    """GB/s of one ``run(*args)``; what it returns is dropped after the clock stops."""
    t = time.perf_counter()
    out = run(*args)
    seconds = time.perf_counter() - t
    del out
    gc.collect()
    return nbytes / 1e9 / seconds


def host_fill(nbytes: int, repeat: int) -> tuple[float, float]:
    """GB/s filling fresh host memory, and filling it again."""
    fresh, again = [], []
    for _ in range(repeat):
        buffer = np.empty(nbytes, np.uint8)
        fresh.append(_rate(nbytes, buffer.fill, 1))
        again.append(_rate(nbytes, buffer.fill, 2))
        del buffer
    return statistics.median(fresh), statistics.median(again)


def measure(total: int, repeat: int, cases: list[tuple[str, tuple[int, ...]]]) -> list[dict[str, Any]]:
    rows = []
    for dtype, shape in cases:
        itemsize = np.dtype(dtype if dtype != "bfloat16" else np.uint16).itemsize
        leaf = int(np.prod(shape)) * itemsize
        count = max(1, total // leaf)
        row: dict[str, Any] = {"dtype": dtype, "shape": shape, "leaves": count, "GB": count * leaf / 1e9}
        for name, route in _routes().items():
            rates = []
            for r in range(repeat):
                rates.append(_rate(count * leaf, route, _make(dtype, shape, count, 1000 * r)))
            row[name] = statistics.median(rates)
            print(f"{dtype} {shape} {name}: {row[name]:.2f} GB/s", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], fill: tuple[float, float]) -> str:
    routes = [
        k for k in ("device_get", "one by one", "pinned_host", "treestore fetch") if rows and k in rows[0]
    ]
    lines = [
        "| dtype | leaf shape | leaves | GB | " + " | ".join(f"{r} (GB/s)" for r in routes) + " |",
        "|---|---|---:|---:|" + "---:|" * len(routes),
    ]
    for row in rows:
        rates = " | ".join(f"{row[r]:.2f}" for r in routes)
        lines.append(f"| {row['dtype']} | {row['shape']} | {row['leaves']} | {row['GB']:.2f} | {rates} |")
    lines.append("")
    lines.append(
        f"Host memory: fresh pages filled at {fill[0]:.2f} GB/s, filled again at {fill[1]:.2f} GB/s."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small leaves, one run: a test that it runs")
    ap.add_argument("--total-mib", type=int, default=1536, help="bytes of leaves per case and route")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    total, repeat, cases = args.total_mib * MiB, args.repeat, CASES
    if args.quick:
        total, repeat = 8 * MiB, 1
        cases = [(dtype, (256, 1024)) for dtype in ("bfloat16", "float32", "int8")]
    rows = measure(total, repeat, cases)
    print(table(rows, host_fill(total, repeat)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
