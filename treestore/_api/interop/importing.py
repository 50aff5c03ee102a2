"""Import of other checkpoint formats — .safetensors, .npz, flax msgpack, orbax folders, the
Hugging Face shard set — as treestore checkpoints.

Flat formats (safetensors, npz) name tensors with keys like ``encoder.layer.0.w``; on import a key
is split at ``.`` and ``/`` into nested dicts with string keys (``{"encoder": {"layer": {"0":
...}}}``). The separator found (``/`` when keys use only slashes, else ``.``) is kept in the
checkpoint's metadata with the source file's own metadata, so that export
(:mod:`treestore._api.interop.exporting`) joins the segments back into the same key names and a
safetensors file comes back bit-exact.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from treestore._api.interop import file_formats as _formats
from treestore._api.interop import hf_shards as _shards
from treestore._api.interop import orbax_folders as _orbax
from treestore._api.interop import remote_source as _remote
from treestore._api.spec import parse_spec
from treestore._engine import write as _write
from treestore._engine.progress import Progress, counter
from treestore._format.paths import step_name
from treestore._storage.registry import open_storage
from treestore._tree import prepare as _prepare
from treestore._tree.jax_import import jax
from treestore.errors import InvalidInputError, NotFoundError


def nest(flat: dict[str, Any], *, source: str) -> tuple[dict[str, Any], str]:
    """Nested dicts from flat keys split at ``.`` and ``/``, and the separator to join them back."""
    dots = any("." in k for k in flat)
    slashes = any("/" in k for k in flat)
    separator = "/" if slashes and not dots else "."
    root: dict[str, Any] = {}
    problems = []
    for key, value in flat.items():
        parts = re.split(r"[./]", key)
        if "" in parts:
            problems.append(f"key {key!r} has an empty segment")
            continue
        node = root
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"key {key!r} extends tensor {'.'.join(parts[: i + 1])!r}")
                break
            node = child
        else:
            if parts[-1] in node:
                problems.append(f"key {key!r} names a tensor and a prefix of other keys")
            else:
                node[parts[-1]] = value
    if problems:
        raise InvalidInputError(
            f"{source}: cannot nest its keys ({'; '.join(problems[:5])}); "
            "import it with flat keys instead (nest=False, --flat)"
        )
    return root, separator


def read_file(
    path: str | os.PathLike[str], *, format: str | None = None, nest_keys: bool = True
) -> tuple[Any, dict[str, Any]]:
    """The tree held by a .safetensors/.npz/flax msgpack file or orbax folder, and a record of
    where it came from (kept as the ``source`` metadata of an imported checkpoint)."""
    p = Path(path)
    if not p.exists():
        raise NotFoundError(f"no file or folder {str(p)!r}")
    index = _shards.find_index(p) if format in (None, "safetensors") else None
    if index is not None:  # the Hugging Face shard set
        fmt = "safetensors"
        tree, extra = _shards.read_shards(index)
        p = index
    else:
        fmt = _formats.detect_format(p, format)
        _formats.check_kind(p, "a folder" if fmt == "orbax" else "a regular file", InvalidInputError)
        tree, extra = (_orbax.read_orbax if fmt == "orbax" else _formats.READERS[fmt])(p)
    source: dict[str, Any] = {"format": fmt, "file": p.name, **extra}
    if fmt in _formats.FLAT and nest_keys:
        tree, source["separator"] = nest(tree, source=str(p))
    return tree, source


def _default_name(path: Path) -> str:
    stem = path.stem if path.is_file() else path.name
    if path.name.endswith(_shards.INDEX_SUFFIX):  # model.safetensors.index.json: "model"
        stem = path.name[: -len(_shards.INDEX_SUFFIX)]
    stem = re.sub(r"[^A-Za-z0-9._=+-]", "-", stem)
    stem = stem.lstrip("._=+-")[:200]
    if not stem:
        raise InvalidInputError(f"name the checkpoint to import {str(path)!r} into: URL#NAME")
    return stem


def import_file(
    path: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str | None = None,
    nest_keys: bool = True,
    metadata: Any = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    options: _write.SaveOptions | None = None,
    progress: Progress | None = None,
    source_storage_options: dict[str, Any] | None = None,
) -> _write.SaveResult:
    """Save the tensors of a .safetensors, .npz or flax .msgpack file, of an orbax checkpoint
    folder, or of a Hugging Face shard set (its ``*.safetensors.index.json``, or
    the folder holding it), as checkpoint ``dst`` (``URL#NAME``; without a name, the file's stem).

    A shard set is checked whole before anything is saved (every shard present and a
    regular file, every tensor in the one shard the index names, no shard of the folder holding
    tensors the index lacks, ``total_size`` right) and its tensors are saved from read-only
    memory maps of the shards, one chunk at a time, so the import holds little more than a
    chunk per saving thread in memory. ``path`` may be an fsspec URL (``s3://bucket/model``,
    ``hf://...``, ``https://...``) of a file or of a shard set: it is copied, streamed, to a
    temporary local folder first (an orbax folder is imported from a local path only).

    The checkpoint's metadata is ``{"source": {...}}`` (format, file name, separator, the file's
    own metadata), merged with ``metadata`` when that is a dict.

    An orbax folder may be a checkpoint, a step folder of an orbax CheckpointManager
    (``mgr/5`` or its item ``mgr/5/default``) or the manager's folder itself (``mgr``: its
    newest step; import each step folder to keep them all). A step is imported as
    ``step-000000005`` (the name :class:`CheckpointManager` gives it) with ``{"step": 5}`` and
    the step's metrics in its metadata, so a treestore CheckpointManager on the store resumes
    from it; the saver's ``custom_metadata`` is kept in the source record.

    Args:
        path: The file, orbax folder, or shard set (its folder or index).
        dst: The checkpoint to write: ``URL#NAME``, or ``URL`` to name it after the file's stem.
        format: ``"safetensors"``, ``"npz"``, ``"msgpack"`` or ``"orbax"`` (default: from the
            suffix; a folder is an orbax checkpoint).
        nest_keys: Split flat keys at ``.`` and ``/`` into nested dicts; False keeps them flat.
        metadata: User metadata stored with the checkpoint.
        overwrite: Replace a checkpoint of that name.
        storage_options: Options for the fsspec filesystem of ``dst``.
        options: Chunk sizes, packing and threads of the save.
        progress: Called as ``progress(done, total)`` with bytes saved.
        source_storage_options: Options for the fsspec filesystem of ``path`` when it is a URL.

    Returns:
        SaveResult: A :class:`treestore.types.SaveResult`.

    Raises:
        UnsupportedFormatError: The file is not in a format treestore reads.
        CheckpointExistsError: The checkpoint exists and ``overwrite`` is False.

    Examples:
        >>> import numpy as np, treestore, tempfile, os
        >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
        >>> np.savez(f, **{"dense.kernel": np.ones((2, 2)), "dense.bias": np.zeros(2)})
        >>> treestore.import_file(f, "memory://doc/import#w").leaves
        2
        >>> treestore.load("memory://doc/import", "w")["dense"]["bias"]
        array([0., 0.])
    """
    url, name = parse_spec(dst)
    with _remote.local_copy(path, source_storage_options) as local:  # saved from while it exists
        tree, source = read_file(local, format=format, nest_keys=nest_keys)
        # the step and metrics at the top of the metadata, as CheckpointManager keeps them
        step = {k: source.pop(k) for k in ("step", "metrics") if k in source}
        meta: Any = {**step, "source": source}
        if isinstance(metadata, dict):
            meta = {**step, **metadata, "source": source}
        elif metadata is not None:
            meta = {**step, "source": source, "user": metadata}
        if name is None:  # the step, else a file's (or an index's) name, else the folder's
            named = local if local.is_file() else Path(os.fspath(path).rstrip("/"))
            name = step_name(step["step"]) if "step" in step else _default_name(named)
        storage = open_storage(url, storage_options)
        prepared = _prepare.prepare(tree)
        total = sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(tree))
        return _write.write(
            storage,
            prepared,
            name,
            metadata=meta,
            options=options or _write.SaveOptions(),
            overwrite=overwrite,
            on_chunk=counter(progress, total),
        )
