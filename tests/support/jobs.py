"""Multi-process saves by a job of threads: each thread saves as one process of the job.

The threads are synchronised by a ``LocalRuntime`` as JAX's runtime synchronises real processes
(``treestore._engine.group.distributed.joined``); each process owns the pieces of its sharded leaves
that ``boxes`` gives it, as jax's replica-0 shards would be.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from treestore._engine.group import distributed as D
from treestore._engine.group.group_runtime import LocalRuntime
from treestore._engine.write import SaveOptions, write
from treestore._format.dtypes import dtype_name
from treestore._tree.leaves import ArrayLeaf, prepare_leaf
from treestore._tree.prepare import Prepared, prepare

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (start, shape)


def prepared(tree: Any, boxes: Mapping[str, Sequence[Sequence[Box]]], index: int) -> Prepared:
    """What process ``index`` prepares: the leaves at the addresses of ``boxes`` sharded, with
    ``boxes[address][index]`` its pieces (in that order); the others as a save prepares them."""

    def leaf(address: str, value: Any) -> Any:
        if address not in boxes:
            return prepare_leaf(value, address)
        parts = tuple(
            (
                start,
                np.ascontiguousarray(
                    value[tuple(slice(a, a + n) for a, n in zip(start, shape, strict=True))]
                ),
            )
            for start, shape in boxes[address][index]
        )
        return ArrayLeaf("numpy", dtype_name(value.dtype), None, pieces=parts, global_shape=value.shape)

    return prepare(tree, leaf=leaf)


def rows(n: int, count: int, width: int | None = None) -> list[list[Box]]:
    """One box per process: process i owns rows [i·n/count, (i+1)·n/count) of an (n, width) leaf
    (of an (n,) leaf without ``width``)."""
    step = n // count
    rest = () if width is None else (width,)
    zeros = () if width is None else (0,)
    return [[((i * step, *zeros), (step, *rest))] for i in range(count)]


def run_job(
    storage: Any,
    trees: Sequence[Prepared | None],
    name: str,
    *,
    runtime: LocalRuntime | None = None,
    options: SaveOptions | None = None,
    before: Callable[[int], None] | None = None,
) -> list[Any]:
    """Save ``trees[i]`` as process i of a job of ``len(trees)`` threads (a None tree: that process
    never saves); each one's SaveResult, or the exception it raised, or None."""
    count = len(trees)
    runtime = runtime or LocalRuntime(count)
    results: list[Any] = [None] * count

    def process(i: int) -> None:
        tree = trees[i]
        if tree is None:
            return
        with D.joined(runtime, i, count):
            try:
                if before is not None:
                    before(i)
                results[i] = write(storage, tree, name, options=options or SaveOptions(threads=2))
            except BaseException as exc:
                results[i] = exc

    threads = [threading.Thread(target=process, args=(i,), name=f"process-{i}") for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a process of the job did not finish"
    return results
