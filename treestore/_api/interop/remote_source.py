"""Importing from an fsspec URL: the file, or the Hugging Face shard set, copied to a
temporary local folder first, so every check and reader of a local import applies unchanged.

A copy is streamed to disk file by file (never held in memory whole), and what is copied is
bounded before it is: an index is read only up to its cap and must name plain file names in its
folder; a shard or file is copied only if the filesystem lists it as a file. An orbax folder is
not fetched (it is many files, whose structure orbax decides): import it from a local path.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec

from treestore._api.interop import hf_shards as _shards
from treestore.errors import InvalidInputError, NotFoundError, StorageError, TreestoreError


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is an fsspec URL other than a local file (``file://`` is local)."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


@contextlib.contextmanager
def local_copy(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Iterator[Path]:
    """``path`` as a local path: itself, or for an fsspec URL a temporary copy (:func:`fetched`)."""
    if not is_remote(path):
        yield Path(path)
        return
    with fetched(os.fspath(path), storage_options) as local:
        yield local


@contextlib.contextmanager
def fetched(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[Path]:
    """A local copy of what ``url`` names, in a temporary folder removed on exit: a single file,
    a shard set's index (with every shard it names), or a folder holding one index."""
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError, TypeError) as exc:
        raise InvalidInputError(f"no filesystem for {url!r}: {exc}") from None
    root = root.rstrip("/")
    with tempfile.TemporaryDirectory(prefix="treestore-import-") as tmp:
        try:  # the copy only: what the caller does with it raises its own errors
            copied = _copy(fs, root, url, Path(tmp))
        except TreestoreError:
            raise
        except Exception as exc:  # fsspec backends raise many unrelated types (aiohttp's, botocore's)
            raise StorageError(f"reading {url} failed: {type(exc).__name__}: {exc}") from None
        yield copied


def _copy(fs: Any, root: str, url: str, local: Path) -> Path:
    if not fs.exists(root):
        raise NotFoundError(f"no file or folder at {url}")
    index = root
    if fs.isdir(root):
        names = [posixpath.basename(p) for p in fs.ls(root, detail=False)]
        found = sorted(n for n in names if n.endswith(_shards.INDEX_SUFFIX))
        if len(found) != 1:
            raise InvalidInputError(
                f"{url} holds {len(found)} safetensors indexes; only a file or a folder of one "
                "safetensors shard set is imported from a URL (import an orbax folder from a "
                "local path)"
            )
        index = posixpath.join(root, found[0])
    elif not index.endswith(_shards.INDEX_SUFFIX):
        return _get(fs, root, local)
    local_index = _get(fs, index, local, limit=_shards.INDEX_BYTES)
    weight_map, _ = _shards.load_index(local_index)  # plain file names, checked
    folder = posixpath.dirname(index)
    for name in sorted(set(weight_map.values())):
        if fs.exists(posixpath.join(folder, name)):  # a missing shard is reported by the reader
            _get(fs, posixpath.join(folder, name), local)
    return local if fs.isdir(root) else local_index


def _get(fs: Any, remote: str, local: Path, limit: int | None = None) -> Path:
    """Copy file ``remote`` into folder ``local`` (streamed), refusing anything but a file and,
    with ``limit``, a file over that many bytes."""
    info = fs.info(remote)
    if info.get("type") != "file":
        raise InvalidInputError(f"{remote}: expected a file, found a {info.get('type')}")
    size = info.get("size")
    if limit is not None and isinstance(size, int) and size > limit:
        raise InvalidInputError(f"{remote}: {size:,} bytes, more than the {limit:,} read of such a file")
    out = local / posixpath.basename(remote)
    fs.get_file(remote, str(out))
    return out
