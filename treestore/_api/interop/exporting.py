"""Export of a checkpoint as a .safetensors, .npz or flax msgpack file, an orbax checkpoint
folder, or the Hugging Face shard set; key paths are joined into the key names import split
them from (:mod:`treestore._api.interop.importing`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from treestore._api.checkpoint import Checkpoint
from treestore._api.functions import resolve
from treestore._api.interop import file_formats as _formats
from treestore._api.interop import hf_shards as _shards
from treestore._api.interop import orbax_folders as _orbax
from treestore._api.interop import temporary
from treestore._api.lazy_leaf import LazyLeaf
from treestore._engine.progress import Progress, counter
from treestore._format.address import DictKey, GetAttrKey, SequenceKey, parse_address
from treestore._format.manifest.record_views import Stored, stored
from treestore._tree.jax_import import jax
from treestore.errors import InvalidInputError, NotFoundError, StorageError

# The Python scalars each format holds besides arrays (orbax's StandardCheckpointer refuses str).
_SCALARS = {"msgpack": ("bool", "int", "float", "complex", "str", "bytes"), "orbax": ("bool", "int", "float")}


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_file` wrote: the file (the index of a shard set), its
    format, how many tensors and raw bytes, and in how many safetensors shards.

    Attributes:
        path: The file or orbax folder written; of a shard set, its
            ``model.safetensors.index.json``.
        format: ``"safetensors"``, ``"npz"``, ``"msgpack"`` or ``"orbax"``.
        tensors: How many leaves were written.
        nbytes: Raw bytes of the arrays written.
        shards: How many safetensors files hold the tensors (1 unless sharded).
    """

    path: str
    format: str
    tensors: int
    nbytes: int
    shards: int = 1


def _segment(key: object) -> str | None:
    if isinstance(key, DictKey) and type(key.key) in (str, int):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, GetAttrKey):
        return key.name
    return None


def _names(ckpt: Checkpoint, separator: str | None, scalars: str) -> list[tuple[tuple[str, ...], Stored]]:
    """Each leaf's key segments, after checking that the target format can express it;
    ``scalars`` is the format whose Python scalars it holds (see ``_SCALARS``), if any."""
    problems: list[str] = []
    out: list[tuple[tuple[str, ...], Stored]] = []
    seen: dict[tuple[str, ...], str] = {}
    columns = ckpt._columns
    columns.addresses  # noqa: B018 - built in one pass, then each leaf's is looked up
    for i in range(len(columns)):
        e = stored(columns, i)
        where = e.address or "(root)"
        found = [_segment(k) for k in parse_address(e.address)]
        segments = tuple(s for s in found if s is not None)
        if not found:
            problems.append("the checkpoint is a single leaf without a key name")
        elif len(segments) != len(found):
            problems.append(f"{where}: a key of this path cannot be a key name (bool or index key)")
        elif separator is not None and len(segments) > 1 and any(separator in s for s in segments):
            problems.append(f"{where}: a key contains {separator!r}, the separator of the key names")
        elif e.kind == "prng_key":
            problems.append(f"{where}: PRNG keys cannot be exported; export jax.random.key_data of them")
        elif not e.is_array and e.kind not in _SCALARS.get(scalars, ()):
            held = _SCALARS.get(scalars)
            problems.append(
                f"{where}: a Python {e.kind} is not an array; this format holds arrays only"
                if not held
                else f"{where}: a Python {e.kind} cannot go in an {scalars} checkpoint, which holds "
                f"arrays and Python {', '.join(held)}"
            )
        else:
            if segments in seen:
                problems.append(f"{where} and {seen[segments]} would get the same key name")
            seen[segments] = where
            out.append((segments, e))
    if problems:
        more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
        raise InvalidInputError(
            f"cannot export {len(problems)} leaves:\n  " + "\n  ".join(problems[:10]) + more
        )
    return out


def _leaves(
    ckpt: Checkpoint, named: list[tuple[tuple[str, ...], Stored]], progress: Progress | None
) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Each leaf's value (host numpy arrays for arrays), read one leaf at a time."""
    advance = counter(progress, sum(e.nbytes for _, e in named))
    for names, e in named:
        value: Any = e.value
        if e.is_array:
            value = np.asarray(ckpt[e.address])
            if advance is not None:
                advance(e.nbytes)
        yield names, value


def export_file(
    src: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    separator: str | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    max_shard_size: int | str | None = None,
) -> ExportResult:
    """Write a checkpoint as a .safetensors, .npz or flax .msgpack file, or as an orbax
    checkpoint folder.

    In flat formats every leaf must be an array whose keys are dict keys or list indices, and no
    key of a nested leaf may contain the separator; one error lists every leaf that cannot be
    written. The file is written whole (to a temporary name, then renamed).

    An orbax folder is what ``orbax.checkpoint.StandardCheckpointer().save(path, tree)`` writes:
    the checkpoint's tree as :func:`treestore.load` returns it (numpy arrays as numpy arrays, jax
    arrays as jax arrays, Python int, float and bool as they are; other nodes as dicts), which
    orbax restores with or without a target; the
    ``custom_metadata`` of a checkpoint imported from orbax goes back with it. To add it to an
    orbax CheckpointManager folder as step 5, export to ``mgr/5/default``. A safetensors file
    gets back the metadata block of the file it was imported from.

    Hugging Face's shard set: with ``max_shard_size`` (bytes, or a size such as ``"5GB"``,
    ``"500MB"``: decimal units, as Hugging Face reads them; ``path`` is then a folder unless it
    ends in ``.safetensors``), or with ``path`` a folder (existing, or ending in ``/``) and
    ``format="safetensors"`` (5GB shards by default), tensors that exceed
    one shard go in ``model-00001-of-0000N.safetensors`` ... (``STEM-...`` next to a
    ``STEM.safetensors`` path) with a ``model.safetensors.index.json``, as transformers'
    ``save_pretrained`` writes them; tensors that fit in one shard go in one plain
    ``model.safetensors`` (or ``path``) as without sharding. Shards are filled in address order,
    a tensor bigger than a shard alone in its own, and each shard's header carries the same
    metadata block a single file would (the imported file's, if any: a file imported from
    transformers has ``{"format": "pt"}``, which older transformers versions require; a
    checkpoint saved by treestore gets none). The export streams one tensor at a time, and a
    killed one never leaves an index naming a missing or partial shard (each shard is written
    under a temporary name and the index last); with ``overwrite`` the files of an earlier export there
    (single file, index, shards of any count) are replaced.

    Args:
        src: The checkpoint: ``URL`` (its newest) or ``URL#NAME``.
        path: The file or folder to write; its folder must exist.
        format: ``"safetensors"``, ``"npz"``, ``"msgpack"`` or ``"orbax"`` (default: from the
            suffix; an existing folder is an orbax checkpoint).
        separator: Joins key paths into tensor names (default: the one recorded on import,
            else ``.``).
        overwrite: Replace ``path`` if it exists.
        storage_options: Options for the fsspec filesystem of ``src``.
        progress: Called as ``progress(done, total)`` with bytes written.
        max_shard_size: Write Hugging Face's shard set with shards of at most this many
            bytes (an int, or a size such as ``"5GB"``).

    Returns:
        ExportResult: A :class:`treestore.types.ExportResult`.

    Raises:
        NotFoundError: The checkpoint, or the folder to write in, does not exist.
        InvalidInputError: ``path`` exists and ``overwrite`` is False, or leaves cannot be
            written in the format.

    Examples:
        >>> import numpy as np, treestore, tempfile, os
        >>> _ = treestore.save("memory://doc/export", {"dense": {"bias": np.zeros(2)}}, "w")
        >>> f = os.path.join(tempfile.mkdtemp(), "w.npz")
        >>> treestore.export_file("memory://doc/export#w", f).tensors
        1
        >>> list(np.load(f))
        ['dense.bias']
    """
    out = Path(path)
    limit = None if max_shard_size is None else _shards.parse_size(max_shard_size)
    folder = _shard_folder(path, format, max_shard_size)
    fmt = "safetensors" if folder is not None else _formats.detect_format(out, format)
    if max_shard_size is not None and fmt != "safetensors":
        raise InvalidInputError(f"max_shard_size shards safetensors exports only, not {fmt}")
    sharding = fmt == "safetensors" and (folder is not None or max_shard_size is not None)
    if folder is not None:
        out = folder / "model.safetensors"
    stem = out.name[: -len(".safetensors")] if out.name.lower().endswith(".safetensors") else out.name
    where = folder if folder is not None else out
    if not where.parent.is_dir():
        raise NotFoundError(f"no folder {str(where.parent)!r} to write {where.name!r} in")
    there = _shards.existing(out.parent, stem) if sharding and out.parent.is_dir() else []
    if (out.exists() or there) and not overwrite:
        found = str(out) if out.exists() else str(there[0])
        raise InvalidInputError(f"{found!r} exists; pass overwrite=True (--overwrite) to replace it")
    folders = [p for p in there if p.is_dir() and not p.is_symlink()]
    if folders:  # checked before anything is written: an export replaces files, never folders
        raise InvalidInputError(
            f"{str(folders[0])!r} is a folder where the export would replace a file of an earlier "
            "export; move it away first"
        )
    ckpt = resolve(src, storage_options)
    source = ckpt.metadata.get("source") if isinstance(ckpt.metadata, dict) else None
    source = source if isinstance(source, dict) else {}
    sep: str = separator or (source["separator"] if source.get("separator") in (".", "/") else ".")
    named = _names(ckpt, sep if fmt in _formats.FLAT else None, fmt)
    if fmt == "safetensors" and not sharding:  # one error naming every leaf it cannot hold
        _shards.tensors([(sep.join(n), e) for n, e in named])
    if fmt == "npz":
        bad = [e.address for _, e in named if e.dtype not in _formats.NPY_DTYPES]
        if bad:
            raise InvalidInputError(
                f".npz holds numpy dtypes only; {', '.join(bad[:5])} cannot go in one (use .safetensors)"
            )
    st_meta = source.get("metadata") if source.get("format") == "safetensors" else None
    ok = isinstance(st_meta, dict) and all(isinstance(v, str) for v in st_meta.values())
    st_meta = st_meta if ok and st_meta else None
    nbytes = sum(e.nbytes for _, e in named)
    if sharding:
        limit = limit or _shards.parse_size(_shards.DEFAULT_SHARD_SIZE)
        shards = _shards.plan(_shards.tensors([(sep.join(n), e) for n, e in named]), limit)
        if folder is not None:
            folder.mkdir(exist_ok=True)
        if len(shards) > 1:
            advance = counter(progress, nbytes)
            index = _shards.write_shards(ckpt, shards, out.parent, stem, st_meta, advance)
            return ExportResult(str(index), fmt, len(named), nbytes, len(shards))
    if fmt == "orbax":
        tmp = str(out.with_name(f".{out.name}.tmp-{os.getpid()}"))
        custom = source.get("custom_metadata") if source.get("format") == "orbax" else None
        _write_orbax(ckpt, out, tmp, custom if isinstance(custom, dict) else None, progress)
        return ExportResult(str(out), fmt, len(named), sum(e.nbytes for _, e in named))
    items = _leaves(ckpt, named, progress)
    temporary.remove_abandoned(out.parent, out.name)
    fd, made = temporary.create(out.parent, out.name)
    try:
        with os.fdopen(fd, "wb") as f:
            if fmt == "npz":
                _formats.write_npz(f, ((sep.join(n), v) for n, v in items))
            elif fmt != "safetensors":
                _formats.write_msgpack(f, items)
        if fmt == "safetensors":  # safetensors writes by name: into the file made above
            _formats.write_safetensors(str(made), ((sep.join(n), v) for n, v in items), st_meta)
        os.replace(made, out)
    finally:
        if os.path.lexists(made):
            os.unlink(made)
    if sharding:
        _shards.remove_stale(out.parent, stem, out)
    return ExportResult(str(out), fmt, len(named), nbytes)


def _shard_folder(path: str | os.PathLike[str], format: str | None, max_shard_size: object) -> Path | None:
    """The folder to write Hugging Face's shard set in, when ``path`` names one (an existing folder,
    a path ending in ``/``, or with ``max_shard_size`` a path without a file format's suffix) and
    the export is a safetensors one (``format``, or a ``max_shard_size`` without a format: a
    folder alone means orbax)."""
    text = os.fspath(path)
    named_file = Path(text).suffix.lower() in _formats.SUFFIXES
    folder = (
        Path(text).is_dir() or text.endswith(("/", os.sep)) or (max_shard_size is not None and not named_file)
    )
    wanted = format == "safetensors" or (format is None and max_shard_size is not None)
    return Path(text) if folder and wanted else None


def _write_orbax(
    ckpt: Checkpoint, out: Path, tmp: str, custom: dict[str, Any] | None, progress: Progress | None
) -> None:
    """Write the checkpoint's tree as an orbax checkpoint in folder ``tmp``, then put it at
    ``out`` (replacing what is there only once the new folder is complete)."""
    advance = counter(progress, ckpt._columns.nbytes)

    def host(x: Any) -> Any:  # each leaf as treestore.load gives it: jax arrays stay jax arrays
        if not isinstance(x, LazyLeaf):
            return x
        array = x.read()
        if advance is not None:
            advance(x.nbytes)
        return array

    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if Path(tmp).is_dir():  # left by an export of this process id that was killed
        shutil.rmtree(tmp)
    try:
        _orbax.write_orbax(tmp, jax.tree.map(host, ckpt.tree), custom)
        try:
            moved = out.is_dir() and not out.is_symlink()
            if moved:
                os.replace(out, old)
            elif out.exists() or out.is_symlink():
                out.unlink()
            try:
                os.replace(tmp, out)
            except OSError:
                if moved:
                    os.replace(old, out)  # the folder that was there stays
                raise
        except OSError as exc:
            raise StorageError(f"cannot put the orbax checkpoint at {out}: {exc}") from None
    finally:
        for left in (Path(tmp), old):
            if left.is_dir():
                shutil.rmtree(left)
