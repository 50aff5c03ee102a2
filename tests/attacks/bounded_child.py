"""Run by tests/attacks/test_bounded.py in a child process under RLIMIT_AS and RLIMIT_CPU:
Hypothesis generates hostile version-2 manifests, and parts of a manifest stored in parts, and
every reader runs on each.

Each example starts from a copy of the attack template (tests/attacks/conftest.py) and changes its
``bad`` manifest in one to three ways that aim at what a reader builds from little input: a
segment made long and the tree rewritten as a deep chain under it (addresses), a column tiled or
filled with extreme words (counts, sizes, offsets), bytes flipped, a column cut short, a field set
to an extreme. The commit record is rewritten to match, so readers get past it to the manifest.
Every reader must then return exact data or raise a clear TreestoreError (the guards of
``_harness.check_readers``: traced memory, files touched, nothing imported); running out of memory
counts as a failure unless the error names a leaf whose declared bytes it could not allocate, and
the process limits bound what tracemalloc does not see. Exit status 0: every example held.

Usage: ``python -m tests.attacks.bounded_child FOLDER EXAMPLES``
"""

from __future__ import annotations

import resource
import shutil
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treestore
from tests.format.test_parts_merge import _reparted as reparted
from tests.format.test_parts_merge import saved as saved_in_parts
from treestore._format import paths as _paths
from treestore._format.manifest.tree import DICT, LEAF, NODE_DTYPE

from ..support import hostile
from ._harness import check_readers
from .conftest import OPTIONS, make_tree

MiB = 2**20
AS_HEADROOM = 1536 * MiB  # address space beyond what the child holds once it has started
CPU_SECONDS = 420
TILED = 64 * MiB  # the most a tiled column may hold (the manifest size cap is tested elsewhere)
COLUMNS = ("nodes", "node_leaves", "leaves", "shapes", "chunks", "packs")
PART_COLUMNS = ("piece_leaves", "piece_chunks", "piece_start", "piece_shape", "chunks", "packs")
WIDE = ("shapes", "piece_start", "piece_shape")  # columns of u8 words; the others are of u4
WORDS = {"nodes": 9, "node_leaves": 4, "leaves": 8, "shapes": 8, "chunks": 48, "packs": 40}
EXTREMES = [0, 1, 2**31 - 1, 2**32 - 1, 2**48, 2**63 - 1]


def _limit() -> None:
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (size + AS_HEADROOM, size + AS_HEADROOM))
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))


def _chain(rec: dict[str, Any], depth: int, width: int) -> None:
    """The tree as a chain of ``depth`` dicts keyed by one segment of ``width`` characters, the
    leaves at the bottom: few bytes of manifest, addresses of depth x width characters each."""
    nleaves = len(rec["leaves"]) // WORDS["leaves"]
    nodes = np.zeros(1 + depth + nleaves, NODE_DTYPE)
    nodes["kind"][: depth + 1] = DICT
    nodes["parent"][1 : depth + 1] = np.arange(depth)
    nodes["kind"][depth + 1 :] = LEAF
    nodes["parent"][depth + 1 :] = depth
    nodes["key"][depth + 1 :] = 1 + np.arange(nleaves)
    rec["segments"] = ["k" * width] + [f"l{i}" for i in range(nleaves)]
    rec["nodes"] = nodes.tobytes()
    rec["node_names"] = []
    rec["node_leaves"] = np.arange(nleaves, dtype="<u4").tobytes()


def _words(column: bytes, size: int) -> np.ndarray:
    usable = len(column) - len(column) % size
    return np.frombuffer(column[:usable], "<u4" if size == 4 else "<u8").copy()


@st.composite
def part_changes(draw: st.DrawFn) -> tuple[int, list[tuple[str, Any]]]:
    """Changes to part ``k`` of the multi-process checkpoint "job": its columns tiled, filled,
    flipped or cut (pieces that multiply, overlap, name leaves or packs that are not there)."""
    out: list[tuple[str, Any]] = []
    for _ in range(draw(st.sampled_from([1, 2]))):
        out.append(draw(column_change(PART_COLUMNS, draw(st.sampled_from(list(COLUMN_ARGS))))))
    return draw(st.integers(0, 3)), out


# The worst cases first: Hypothesis starts from the first element of each choice.
COLUMN_ARGS = {
    "tile": st.sampled_from([5000, 2]) | st.integers(2, 5000),
    "fill": st.sampled_from(EXTREMES[::-1]),
    "flip": st.integers(0, 2**16),
    "cut": st.integers(1, 64),
}


@st.composite
def column_change(draw: st.DrawFn, columns: tuple[str, ...], kind: str) -> tuple[str, Any]:
    """One ``kind`` of change ("tile", "fill", "flip", "cut") to one of ``columns``."""
    return kind, (draw(st.sampled_from(columns)), draw(COLUMN_ARGS[kind]))


@st.composite
def changes(draw: st.DrawFn) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for _ in range(draw(st.sampled_from([1, 2, 3]))):
        kind = draw(st.sampled_from(["chain", "tile", "fill", "flip", "cut", "field", "segment"]))
        if kind == "chain":
            # The worst cases first: Hypothesis starts from the first element of each choice.
            depth = draw(st.sampled_from([499, 250, 60, 1]) | st.integers(1, 499))
            width = draw(st.sampled_from([8192, 20_000, 100, 1]) | st.integers(1, 20_000))
            out.append((kind, (depth, width)))
        elif kind in COLUMN_ARGS:
            out.append(draw(column_change(COLUMNS, kind)))
        elif kind == "field":
            field = draw(st.sampled_from(["chunk_size", "created", "version", "values", "codec"]))
            out.append((kind, (field, draw(st.sampled_from([*EXTREMES, -1, 1e300, "x", [], None])))))
        else:
            out.append((kind, draw(st.sampled_from([100_000, 1]) | st.integers(1, 100_000))))
    return out


def apply(rec: dict[str, Any], change: tuple[str, Any]) -> None:
    kind, arg = change
    if kind == "chain":
        _chain(rec, *arg)
    elif kind == "segment":
        rec["segments"][0] = "k" * arg
    elif kind == "field":
        field, value = arg
        rec[field] = value
    else:
        column, value = arg
        data = rec[column]
        if kind == "tile":  # at most TILED bytes: what matters is the counts a reader acts on
            rec[column] = data * max(1, min(value, TILED // max(len(data), 1)))
        elif kind == "cut":
            rec[column] = data[: max(0, len(data) - value)]
        elif kind == "flip" and data:
            flipped = bytearray(data)
            flipped[value % len(flipped)] ^= 0xFF
            rec[column] = bytes(flipped)
        elif kind == "fill":
            size = 8 if column in WIDE else 4
            words = _words(data, size)
            words[:] = min(value, 2 ** (8 * size) - 1)
            rec[column] = words.tobytes() + data[len(words) * size :]


def main(folder: Path, examples: int) -> int:
    template = folder / "template"
    store = treestore.Store(str(template))
    store.save(make_tree(1), "good", options=OPTIONS)
    store.save(make_tree(0), "bad", options=OPTIONS)
    saved_in_parts(str(template))  # "job": a four-process checkpoint, its manifest in parts
    check_readers(str(template))  # warm every reader up, and the pristine store passes
    check_readers(str(template), "job")
    _limit()
    count = [0, 0]

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(changes())
    def hostile_v2_manifests_are_bounded(found: list[tuple[str, Any]]) -> None:
        count[0] += 1
        root = folder / f"case-{count[0]}"
        shutil.copytree(template, root)
        try:
            url = str(root)
            ref = hostile.commit_record(url, "bad")
            data = hostile.storage(url).read(_paths.manifest_path(ref["manifest"]))
            rec = msgpack.unpackb(data, raw=False)
            for change in found:
                apply(rec, change)
            hostile.write_manifest(url, "bad", rec, leaves=ref["leaves"])
            check(check_readers(url, "bad", root=root, memory=256 * MiB))
        finally:
            shutil.rmtree(root, ignore_errors=True)

    @settings(
        max_examples=examples // 2,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(part_changes())
    def hostile_parts_are_bounded(found: tuple[int, list[tuple[str, Any]]]) -> None:
        count[1] += 1
        root = folder / f"parts-{count[1]}"
        shutil.copytree(template, root)
        k, edits = found

        def change(data: bytes) -> bytes:
            rec = msgpack.unpackb(data, raw=False)
            for edit in edits:
                apply(rec, edit)
            return msgpack.packb(rec, use_bin_type=True)

        try:
            reparted(str(root), "job", k, change)
            check(check_readers(str(root), "job", root=root, memory=256 * MiB))
        finally:
            shutil.rmtree(root, ignore_errors=True)

    hostile_v2_manifests_are_bounded()
    hostile_parts_are_bounded()
    print(f"{count[0]} hostile manifests and {count[1]} hostile parts, every reader bounded")
    return 0


def check(outcomes: dict[str, Any]) -> None:
    """Running out of memory is a failure unless a leaf's declared bytes could not be allocated."""
    for op, outcome in outcomes.items():
        error = outcome.error
        if isinstance(error, treestore.errors.OutOfMemoryError) and error.address is None:
            raise AssertionError(f"{op}: out of memory on a hostile manifest: {error}")


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2])))
