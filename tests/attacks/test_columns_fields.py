"""Hostile edits of single columns of a version-2 manifest, each reaching one refusal of the
reader's checks (named in each case): every reader refuses the manifest as damaged, naming the
checkpoint, within a memory bound, and never reads data it describes wrongly. The edited
manifest keeps its commit record consistent, as a hostile store would."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest

import treestore
from treestore._format.manifest.columns import DTYPE_NAMES, KINDS

from ..support import hostile
from ._harness import check_readers


def _saved(tmp_path: Any) -> str:
    url = str(tmp_path / f"store-{uuid.uuid4().hex[:8]}")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    tree = {
        "big": np.arange(40_000, dtype=np.float32),  # chunks of its own
        "small": np.arange(8, dtype=np.int16),  # packed
        "j": jax.numpy.ones(4),  # a jax array
        "key": jax.random.key(0),  # PRNG key data, uint32[2]
        "sharded": jax.device_put(np.arange(512, dtype=np.float32).reshape(16, 32), spec),  # 2 pieces
        "step": 3,  # a scalar
    }
    treestore.save(url, tree, "bad", options=treestore.SaveOptions(chunk_size=64 * 1024, small_leaf=4096))
    return url


def _edit(url: str, change: Callable[[dict[str, Any], dict[str, np.ndarray]], None]) -> None:
    hostile.mutate_v2_manifest(url, "bad", change)


def _leaf(rec: dict[str, Any], arrays: dict[str, np.ndarray], kind: str) -> int:
    """The row of the first leaf of ``kind`` (a KINDS name)."""
    return int(np.flatnonzero(arrays["leaves"]["kind"] == KINDS.index(kind))[0])


def _jax_dtype_jax_lacks(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # columns_check.validate
    a["leaves"]["dtype"][_leaf(rec, a, "jax")] = DTYPE_NAMES.index("float6_e2m3fn")


def _key_data_of_the_wrong_width(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # validate
    row = _leaf(rec, a, "prng_key")
    start = int(a["leaves"]["ndim"][:row].sum())
    a["shapes"][start] = 3  # uint32[3]: the width of no implementation's key data


def _pack_index_out_of_range(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # _check_refs
    a["chunks"]["pack"][np.flatnonzero(a["chunks"]["pack"] >= 0)[0]] = len(a["packs"])


def _pack_offset_over_the_bound(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # _check_refs
    a["chunks"]["offset"][np.flatnonzero(a["chunks"]["pack"] >= 0)[0]] = 2**32 - 1


def _member_outside_its_pack(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # _check_refs
    j = np.flatnonzero(a["chunks"]["pack"] >= 0)[0]
    a["chunks"]["offset"][j] = a["packs"]["raw"][a["chunks"]["pack"][j]] - 2


def _a_piece_count_missing(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # _check_pieces
    a["piece_counts"] = a["piece_counts"][:-1]


def _segments_not_str(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # columns_codec._str_list
    rec["segments"] = [*rec["segments"][:-1], 7]


def _metadata_over_its_bound(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # _decode_record
    rec["metadata"] = {"x": "y" * (2**20 + 1)}


def _a_shape_over_the_size_bound(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # _leaf_bytes
    row = int(np.flatnonzero(a["leaves"]["ndim"] == 2)[0])
    start = int(a["leaves"]["ndim"][:row].sum())
    a["shapes"][start : start + 2] = 2**47


def _no_root_node(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # check_nodes
    a["nodes"] = a["nodes"][:0]


def _root_with_a_parent(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # check_nodes
    a["nodes"]["parent"][0] = 1


def _key_outside_the_segments(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # check_nodes
    a["nodes"]["key"][1] = len(rec["segments"]) + 5


def _a_name_without_its_node(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # check_nodes
    rec["node_names"] = ["Point"]  # no namedtuple or custom node to name


def _a_piece_record_missing(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # _check_pieces
    a["piece_chunks"] = a["piece_chunks"][:-1]


def _a_piece_start_missing(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # _check_pieces
    a["piece_start"] = a["piece_start"][:-1]


def _a_piece_start_beyond_any_dimension(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:
    a["piece_start"][0] = 2**49  # _check_pieces: over 2**48, before any arithmetic on it


def _a_scalar_with_dimensions(rec: dict[str, Any], a: dict[str, np.ndarray]) -> None:  # validate
    a["leaves"]["ndim"][_leaf(rec, a, "int")] = 1


@pytest.mark.parametrize(
    "change, words",
    [
        (_jax_dtype_jax_lacks, "a jax array cannot have dtype float6_e2m3fn"),
        (_key_data_of_the_wrong_width, "key data must be uint32 of shape"),
        (_pack_index_out_of_range, "pack index is out of range"),
        (_pack_offset_over_the_bound, "pack offset should be an integer"),
        (_member_outside_its_pack, "lie outside pack"),
        (_a_piece_count_missing, "piece counts for"),
        (_segments_not_str, "'segments' should be a list of str"),
        (_metadata_over_its_bound, "metadata is"),
        (_a_shape_over_the_size_bound, "is too large to exist"),
        (_no_root_node, "the tree has no root node"),
        (_root_with_a_parent, "the root node should have parent 0 and key 0"),
        (_key_outside_the_segments, "key is outside the"),
        (_a_name_without_its_node, "one str name per namedtuple or custom node"),
        (_a_piece_record_missing, "piece records for"),
        (_a_piece_start_missing, "piece boxes hold"),
        (_a_scalar_with_dimensions, "a scalar leaf has a dtype, dimensions, flags or chunks"),
        (_a_piece_start_beyond_any_dimension, "a piece start or dimension is over 2**48"),
    ],
    ids=lambda x: getattr(x, "__name__", "")[1:] or None,
)
def test_a_hostile_column_is_refused_by_every_reader(tmp_path, change, words):
    url = _saved(tmp_path)
    _edit(url, change)
    out = check_readers(url, good=None, ops=["manifest", "load", "open", "verify"], memory=128 * 2**20)
    for op in ("manifest", "load", "open"):
        error = out[op].error
        assert isinstance(error, treestore.errors.ManifestDamagedError), (op, out[op])
        assert words in str(error) and "'bad'" in str(error), (op, str(error))
    assert not out["verify"].value.ok
