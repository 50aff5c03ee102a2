"""Checkpoint-format adapters ("peers") for the side-by-side benchmark.

Adapter interface (duck-typed; subclassing :class:`Adapter` is optional but
gives you ``files_and_bytes`` and ``close`` for free)::

    class MyAdapter(Adapter):
        name = "mine"                                     # column label / --formats name

        def save(self, tree: dict, path: str) -> None: ...
        def load(self, path: str, like: dict) -> dict: ...
        def load_one(self, path: str, key: str, like: dict) -> np.ndarray: ...
        def files_and_bytes(self, path: str) -> tuple[int, int]: ...   # optional
        def close(self) -> None: ...                                 # optional

Contract:

* ``tree`` is a nested ``dict[str, dict | np.ndarray]``; keys never contain
  ``"."``.
* ``path`` is an absolute local path that does **not** exist yet, inside a
  fresh, empty run directory.  The adapter may create a file *or* a directory
  there (or use it as an fsspec root, e.g. ``"file://" + path``).  Everything
  the checkpoint needs must live under ``path`` (for a file: ``path`` itself)
  so that ``files_and_bytes`` sees it.
* ``save`` must return only when the checkpoint is complete (async writers must
  wait).  Durability is the harness's job: it calls ``os.sync()`` inside the
  timed region after every ``save``, for every format.
* ``like`` is the same nested dict with ``jax.ShapeDtypeStruct`` leaves (only
  ``.shape`` / ``.dtype`` may be used).  ``load`` must return the full nested
  dict with host ``np.ndarray`` leaves (jax arrays are accepted and converted
  by the harness) of exactly those shapes/dtypes.
* ``key`` is the leaf's dotted path, e.g. ``"h.0.attn.c_attn.w"`` (helpers:
  ``trees.get_leaf(like, key)``, ``key.split(".")``).  ``load_one`` returns that
  one array, reading as little as the format allows.
* The harness touches one byte per page of every returned array inside the
  timed region, so lazily mmapped results are not "free".

Plugging in treestore later = one small class + one line::

    @register
    class TreestoreAdapter(Adapter):
        name = "treestore"
        def save(self, tree, path): treestore.save(tree, path)
        ...

(or without touching this file: ``--formats mypkg.mymod:TreestoreAdapter``).
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
from typing import Any

import numpy as np

from . import trees as T

Tree = dict[str, Any]


class Adapter:
    """Base class; see module docstring for the contract."""

    name: str = "?"

    def save(self, tree: Tree, path: str) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def load(self, path: str, like: Tree) -> Tree:  # pragma: no cover - abstract
        raise NotImplementedError

    def load_one(self, path: str, key: str, like: Tree) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def files_and_bytes(self, path: str) -> tuple[int, int]:
        """(number of regular files, sum of their apparent sizes) under ``path``."""
        return files_and_bytes(path)

    def close(self) -> None:
        pass


def files_and_bytes(path: str) -> tuple[int, int]:
    if os.path.isfile(path):
        return 1, os.path.getsize(path)
    n = total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            if os.path.isfile(p) and not os.path.islink(p):
                n += 1
                total += os.path.getsize(p)
    return n, total


def _as_like_dtype(arr: np.ndarray, spec: Any) -> np.ndarray:
    """Reinterpret ``arr`` with ``spec``'s dtype when the format lost it (e.g. bf16 -> V2)."""
    dt = np.dtype(spec.dtype)
    if arr.dtype != dt:
        if arr.dtype.itemsize != dt.itemsize:
            raise TypeError(f"cannot reinterpret {arr.dtype} as {dt}")
        arr = arr.view(dt)
    return arr


def _contig(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x))


# --------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------


class SafetensorsAdapter(Adapter):
    """One ``.safetensors`` file, keys flattened to ``"a.b.c"``.

    bf16: safetensors>=0.4's numpy API handles ``ml_dtypes.bfloat16`` natively
    (written as ``BF16``, read back as ``ml_dtypes.bfloat16``) -- checked with
    safetensors 0.8.0.  ``load`` uses ``safetensors.numpy.load_file`` (default
    ``mmap`` backend; in 0.8 the arrays are materialised copies);
    ``load_one`` uses ``safe_open(...).get_tensor(key)`` which reads only that
    tensor's byte range.
    """

    name = "safetensors"

    def save(self, tree, path):
        from safetensors.numpy import save_file

        save_file({k: _contig(v) for k, v in T.flatten(tree).items()}, path)

    def load(self, path, like):
        from safetensors.numpy import load_file

        return T.unflatten(load_file(path))

    def load_one(self, path, key, like):
        from safetensors import safe_open

        with safe_open(path, framework="np") as f:
            return f.get_tensor(key)


# --------------------------------------------------------------------------
# orbax-checkpoint
# --------------------------------------------------------------------------


class OrbaxAdapter(Adapter):
    """``orbax.checkpoint.StandardCheckpointer`` (OCDBT and zarr3 formats, a directory).

    * save: ``ckptr.save(path, tree)`` then ``ckptr.wait_until_finished()``
      (StandardCheckpointer is async).  One checkpointer per adapter instance,
      reused across runs so thread-pool start-up is not timed.
    * load: ``ckptr.restore(path, like)`` with ``jax.ShapeDtypeStruct`` leaves
      -> restored as ``np.ndarray`` (no sharding given).
    * load_one: a *real partial restore*.  ``StandardRestore`` has no
      partial-restore flag, but the directory is a regular PyTree checkpoint,
      so we use ``Checkpointer(PyTreeCheckpointHandler())`` with
      ``args.PyTreeRestore(item=<subtree with only that leaf>,
      restore_args=RestoreArgs(restore_type=np.ndarray),
      partial_restore=True)`` -- only that array is read from the store.
    """

    name = "orbax"

    def __init__(self):
        import orbax.checkpoint as ocp

        logging.getLogger("absl").setLevel(logging.ERROR)
        try:
            from absl import logging as absl_logging

            absl_logging.set_verbosity(absl_logging.ERROR)
        except Exception:  # pragma: no cover
            pass
        self._ocp = ocp
        self._ckptr = ocp.StandardCheckpointer()
        self._pytree_ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())

    def save(self, tree, path):
        self._ckptr.save(os.path.abspath(path), tree)
        self._ckptr.wait_until_finished()

    def load(self, path, like):
        return self._ckptr.restore(os.path.abspath(path), like)

    def load_one(self, path, key, like):
        ocp = self._ocp
        parts = key.split(T.SEP)
        leaf_spec = T.get_leaf(like, key)
        item: Any = leaf_spec
        rargs: Any = ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaf_spec.dtype)
        for p in reversed(parts):
            item, rargs = {p: item}, {p: rargs}
        out = self._pytree_ckptr.restore(
            os.path.abspath(path),
            args=ocp.args.PyTreeRestore(item=item, restore_args=rargs, partial_restore=True),
        )
        return T.get_leaf(out, key)

    def close(self):
        self._ckptr.close()
        self._pytree_ckptr.close()


# --------------------------------------------------------------------------
# flax msgpack
# --------------------------------------------------------------------------


class FlaxMsgpackAdapter(Adapter):
    """``flax.serialization.msgpack_serialize`` -> one file; bf16 supported.

    No random access: ``load_one`` reads and decodes the whole file, then picks.
    """

    name = "flax-msgpack"

    def save(self, tree, path):
        from flax import serialization

        data = serialization.msgpack_serialize(tree)
        with open(path, "wb") as f:
            f.write(data)

    def load(self, path, like):
        from flax import serialization

        with open(path, "rb") as f:
            return serialization.msgpack_restore(f.read())

    def load_one(self, path, key, like):
        return T.get_leaf(self.load(path, like), key)


# --------------------------------------------------------------------------
# numpy .npz
# --------------------------------------------------------------------------


class NpzAdapter(Adapter):
    """``np.savez`` (uncompressed zip of .npy members), keys ``"a.b.c"``.

    Written through an open file object so numpy does not append ``.npz`` to
    ``path``.  bf16 quirk: ``.npy`` cannot describe ``ml_dtypes.bfloat16``; it
    is stored as ``|V2`` and reinterpreted via ``like``'s dtype on load.
    ``load_one`` uses the lazy ``NpzFile[key]`` access (reads one zip member).
    """

    name = "npz"

    def save(self, tree, path):
        with open(path, "wb") as f:
            np.savez(f, **{k: _contig(v) for k, v in T.flatten(tree).items()})

    def load(self, path, like):
        flat_like = T.flatten(like)
        with np.load(path, allow_pickle=False) as z:
            return T.unflatten({k: _as_like_dtype(z[k], flat_like[k]) for k in z.files})

    def load_one(self, path, key, like):
        with np.load(path, allow_pickle=False) as z:
            return _as_like_dtype(z[key], T.get_leaf(like, key))


# --------------------------------------------------------------------------
# pickle
# --------------------------------------------------------------------------


class PickleAdapter(Adapter):
    """``pickle.dump(tree, protocol=5)`` (in-band buffers) -> one file.

    No random access: ``load_one`` unpickles the whole file, then picks.
    """

    name = "pickle"

    def save(self, tree, path):
        with open(path, "wb") as f:
            pickle.dump(tree, f, protocol=5)

    def load(self, path, like):
        with open(path, "rb") as f:
            return pickle.load(f)

    def load_one(self, path, key, like):
        return T.get_leaf(self.load(path, like), key)


# --------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------

ADAPTERS: dict[str, type[Adapter]] = {}


def register(cls):
    """Class decorator: make ``cls`` selectable as ``--formats <cls.name>``."""
    ADAPTERS[cls.name] = cls
    return cls


for _cls in (SafetensorsAdapter, OrbaxAdapter, FlaxMsgpackAdapter, NpzAdapter, PickleAdapter):
    register(_cls)

DEFAULT_FORMATS = ["treestore", "safetensors", "orbax", "flax-msgpack", "npz", "pickle"]


def resolve(spec: str) -> type[Adapter]:
    """``"safetensors"`` -> registered class; ``"pkg.mod:Class"`` -> imported class.

    A bare name that is not registered yet is also looked up as
    ``benchmarks.adapter_<name>`` / ``benchmarks.<name>_adapter`` modules,
    so dropping e.g. ``benchmarks/treestore_adapter.py`` containing a
    ``@register``-ed class is enough.
    """
    if ":" in spec:
        mod, _, attr = spec.partition(":")
        return getattr(importlib.import_module(mod), attr)
    if spec not in ADAPTERS:
        for mod in (
            f"{__package__}.{spec.replace('-', '_')}_adapter",
            f"{__package__}.adapter_{spec.replace('-', '_')}",
        ):
            try:
                importlib.import_module(mod)
            except ModuleNotFoundError as e:
                if e.name != mod:
                    raise
            if spec in ADAPTERS:
                break
    if spec not in ADAPTERS:
        raise KeyError(f"unknown format {spec!r}; known: {sorted(ADAPTERS)} (or use 'module:Class')")
    return ADAPTERS[spec]


def make(specs: list[str]) -> list[Adapter]:
    return [resolve(s)() for s in specs]
