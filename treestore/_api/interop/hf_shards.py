"""The Hugging Face shard set: ``model-00001-of-00003.safetensors`` ... plus
``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {tensor: file}}``,
``total_size`` the bytes of tensor data of all shards).

Export streams: each shard's header is computed from the manifest's shapes and dtypes, written,
and followed by each tensor's bytes read one leaf at a time, so an export holds about one tensor
in memory. Each shard is written under a temporary name and renamed, and the index is written
last the same way, so a killed export never leaves an index naming a missing or partial shard.

Import checks the whole shard set before anything is saved: every file the index names is a
regular file whose header is checked as a single file's is, every tensor is in the one file the
index names, no shard holds a tensor the index lacks, and ``total_size`` is what the tensors
hold. The tensors are then handed to the save as read-only memory maps of the shards, so the
save reads them chunk by chunk from the page cache instead of from copies in memory (a shard
truncated by another process during the import would end it with SIGBUS).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from treestore._api.checkpoint import Checkpoint
from treestore._api.interop import file_formats as _formats
from treestore._api.interop import temporary
from treestore._format.limits import MiB
from treestore._format.manifest.record_views import Stored
from treestore.errors import DamagedError, InvalidInputError, StorageError, UnsupportedFormatError

INDEX_SUFFIX = ".safetensors.index.json"
DEFAULT_SHARD_SIZE = "5GB"  # what transformers' save_pretrained uses
INDEX_BYTES = 64 * MiB  # the most of an index file read (a model of 100k tensors needs ~10 MiB)
MAX_SHARD_SIZE = 2**63 - 1  # bytes a file offset can reach
_UNITS = {
    "": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_CODES = {name: code for code, name in _formats._ST_DTYPES.items()}  # our dtype name -> safetensors code


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size such as ``"5GB"``, ``"500MB"`` or ``"10KiB"``: decimal units
    (KB = 1000 bytes) as Hugging Face reads them, binary ones with ``i``; case does not matter."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidInputError(f"max_shard_size must be bytes or a size like '5GB', got {value!r}")
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]{1,20}(?:\.[0-9]{0,20})?)\s*([A-Za-z]*)\s*", value)
        unit = _UNITS.get(m.group(2).upper()) if m else None
        if m is None or unit is None:
            shown = value if len(value) <= 40 else value[:40] + "..."
            raise InvalidInputError(
                f"max_shard_size {shown!r} is not a size; use bytes or e.g. '5GB', '500MB', '10KB'"
            )
        value = int(Fraction(m.group(1)) * unit)  # exact: no float to overflow or round
    if value < 1:
        raise InvalidInputError(f"max_shard_size must be at least 1 byte, got {value}")
    if value > MAX_SHARD_SIZE:
        raise InvalidInputError(f"max_shard_size must be at most {MAX_SHARD_SIZE:,} bytes (8 EiB), got more")
    return value


# --- export ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tensor:
    """One leaf as a safetensors tensor: its key name, stored leaf and dtype code."""

    name: str
    entry: Stored
    code: str

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes


def tensors(named: list[tuple[str, Stored]]) -> list[Tensor]:
    """The leaves as safetensors tensors, in address order; one error names every leaf whose
    dtype safetensors cannot hold."""
    bad = [f"{e.address} ({e.dtype})" for _, e in named if e.dtype not in _CODES]
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise InvalidInputError(f"safetensors cannot hold the dtype of {', '.join(bad[:5])}{more}")
    return [Tensor(name, e, _CODES[str(e.dtype)]) for name, e in named]


def plan(items: list[Tensor], limit: int) -> list[list[Tensor]]:
    """The tensors split into shards of at most ``limit`` bytes of data, in address order; a
    tensor bigger than ``limit`` gets a shard of its own (as Hugging Face does)."""
    shards: list[list[Tensor]] = []
    current: list[Tensor] = []
    fill = 0
    for t in items:
        if current and (fill + t.nbytes > limit or t.nbytes > limit):
            shards.append(current)
            current, fill = [], 0
        current.append(t)
        fill += t.nbytes
        if fill > limit:  # a tensor over the limit, alone
            shards.append(current)
            current, fill = [], 0
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(stem: str, count: int) -> list[str]:
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def header(shard: list[Tensor], metadata: dict[str, str] | None) -> tuple[bytes, list[Tensor]]:
    """The shard's header (length prefix included) and the order its tensors' bytes follow it:
    widest dtypes first, then address order, so each tensor starts aligned to its item size (the
    header is padded to 8 bytes with spaces, as the safetensors package pads it)."""
    ordered = sorted(shard, key=lambda t: -_item_size(t))
    record: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    at = 0
    for t in ordered:
        assert t.entry.shape is not None
        record[t.name] = {"dtype": t.code, "shape": list(t.entry.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    text = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ordered


def _item_size(t: Tensor) -> int:
    return int(_formats.DTYPES[str(t.entry.dtype)].itemsize)


def _write_shard(
    ckpt: Checkpoint,
    fd: int,
    shard: list[Tensor],
    metadata: dict[str, str] | None,
    advance: Callable[[int], None] | None,
) -> None:
    """Write one shard to the file open as ``fd`` (closed after): its header, then each tensor
    read from the checkpoint alone."""
    head, ordered = header(shard, metadata)
    with os.fdopen(fd, "wb") as f:
        f.write(head)
        for t in ordered:
            data = np.asarray(ckpt[t.entry.address])
            data = data.astype(data.dtype.newbyteorder("<"), order="C", copy=False)  # 0-d stays 0-d
            if data.nbytes != t.nbytes or data.shape != t.entry.shape:
                raise DamagedError(
                    f"{t.entry.address}: read {data.shape} ({data.nbytes:,} bytes); its manifest "
                    f"says {t.entry.shape} ({t.nbytes:,} bytes)",
                    address=t.entry.address,
                )
            f.write(data.reshape(-1).view(np.uint8).data)
            if advance is not None:
                advance(t.nbytes)
        f.flush()
        os.fsync(f.fileno())


def existing(folder: Path, stem: str) -> list[Path]:
    """What an export of ``stem`` into ``folder`` would replace: its single file, its index and
    its shards (of any count)."""
    pattern = re.compile(re.escape(stem) + r"-\d{5,}-of-\d{5,}\.safetensors")
    found = [
        p for p in (folder / f"{stem}.safetensors", folder / (stem + INDEX_SUFFIX)) if os.path.lexists(p)
    ]
    return found + sorted(p for p in folder.iterdir() if pattern.fullmatch(p.name))


def write_shards(
    ckpt: Checkpoint,
    shards: list[list[Tensor]],
    folder: Path,
    stem: str,
    metadata: dict[str, str] | None,
    advance: Callable[[int], None] | None,
) -> Path:
    """Write the shards and then their index into ``folder`` and return the index's path.

    An index already there is removed first (no index names a shard this export replaces), and
    the files of an earlier export of ``stem`` this one does not write are removed last. On a
    failure the shards this call put in place are removed again, so the folder holds no index and
    no partial shard of it."""
    names = shard_names(stem, len(shards))
    index = folder / (stem + INDEX_SUFFIX)
    stale = [p for p in existing(folder, stem) if p.name not in names and p != index]
    placed: list[Path] = []
    temporary.remove_abandoned(folder, stem)
    tmp: Path | None = None
    try:
        if os.path.lexists(index):
            index.unlink()
        for name, shard in zip(names, shards, strict=True):
            fd, tmp = temporary.create(folder, stem)
            _write_shard(ckpt, fd, shard, metadata, advance)
            os.replace(tmp, folder / name)
            placed.append(folder / name)
        weight_map = {t.name: name for name, shard in zip(names, shards, strict=True) for t in shard}
        record = {
            "metadata": {"total_size": sum(t.nbytes for s in shards for t in s)},
            "weight_map": weight_map,
        }
        fd, tmp = temporary.create(folder, stem)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(record, indent=2, sort_keys=True) + "\n")  # as transformers writes it
        os.replace(tmp, index)
    except BaseException:
        for p in placed:
            p.unlink(missing_ok=True)
        raise
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    for p in stale:
        p.unlink(missing_ok=True)
    return index


def remove_stale(folder: Path, stem: str, kept: Path) -> None:
    """After a single-file export to ``kept``: the index and shards of an earlier shard set
    of ``stem`` go (index first), so a loader cannot find two copies."""
    for p in existing(folder, stem):
        if p != kept:
            p.unlink(missing_ok=True)


# --- import ----------------------------------------------------------------------------------------
def find_index(path: Path) -> Path | None:
    """The index ``path`` names: itself when its name ends in ``.safetensors.index.json``, the one
    such file in a folder, or None when the folder holds none."""
    if path.name.endswith(INDEX_SUFFIX):
        return path
    if not path.is_dir():
        return None
    found = sorted(p for p in path.iterdir() if p.name.endswith(INDEX_SUFFIX))
    if len(found) > 1:
        raise InvalidInputError(
            f"{path} holds {len(found)} safetensors indexes ({', '.join(p.name for p in found)}); "
            f"import one of them: {found[0]}"
        )
    return found[0] if found else None


def load_index(index: Path) -> tuple[dict[str, str], int | None]:
    """The weight map and total_size (None when absent) of an index file, its size capped and
    its structure checked; every file name a plain name in the index's folder."""
    st = _formats.check_kind(index, "a regular file")
    _formats.check_size(index, st, INDEX_BYTES)
    try:
        record = json.loads(index.read_bytes())
    except ValueError as exc:
        raise UnsupportedFormatError(f"{index} is not JSON: {exc}") from None
    except RecursionError:
        raise UnsupportedFormatError(f"{index}: its JSON is nested too deep for an index") from None
    weight_map = record.get("weight_map") if isinstance(record, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise UnsupportedFormatError(
            f"{index}: expected a safetensors index, a JSON object whose weight_map maps "
            "tensor names to file names"
        )
    for name, file in weight_map.items():
        if file in ("", ".", "..") or os.path.basename(file) != file or "\\" in file:
            raise UnsupportedFormatError(
                f"{index}: tensor {name!r} is in {file!r}, which is not a file name in the index's folder"
            )
    meta = record.get("metadata") or {}
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if total is not None and (type(total) is not int or total < 0):
        raise UnsupportedFormatError(f"{index}: total_size is {total!r}, not a number of bytes")
    return weight_map, total


def _shard_header(index: Path, path: Path) -> tuple[dict[str, _formats.StTensor], dict[str, str]]:
    if not os.path.lexists(path):
        raise DamagedError(f"{index} names shard {path.name}, which is missing from {path.parent}")
    _formats.check_kind(path, "a regular file")
    found, meta, _ = _formats.safetensors_header(path)
    return found, meta


def read_shards(index: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensors of the shard set ``index`` describes, as read-only memory maps, and the record
    of where they came from (the first shard's metadata block, the index's name, the shard
    count), once the whole shard set is checked (see the module's docstring)."""
    weight_map, total = load_index(index)
    folder = index.parent
    files = list(dict.fromkeys(weight_map.values()))
    headers = {file: _shard_header(index, folder / file) for file in files}
    holder: dict[str, str] = {}
    for file, (found, _) in headers.items():
        for name in found:
            if name in holder:
                raise DamagedError(f"{index}: tensor {name!r} is in two shards, {holder[name]} and {file}")
            if name not in weight_map:
                raise DamagedError(
                    f"{folder / file}: holds tensor {name!r}, which {index.name} does not name"
                )
            holder[name] = file
    _check_unnamed(index, set(files))
    for name, file in weight_map.items():
        if holder.get(name) != file:
            where = f"it is in {holder[name]}" if name in holder else "no shard holds it"
            raise DamagedError(f"{index}: tensor {name!r} should be in {file}, but {where}")
    data = sum(t.stop - t.start for found, _ in headers.values() for t in found.values())
    if total is not None and total != data:
        raise DamagedError(f"{index}: total_size is {total:,} bytes, but its tensors hold {data:,}")
    flat: dict[str, Any] = {}
    for file, (found, _) in headers.items():
        whole = _map(folder / file)
        for name, t in found.items():
            flat[name] = whole[t.start : t.stop].view(t.dtype).reshape(t.shape)
    flat = {name: flat[name] for name in weight_map}  # in the index's order
    meta = headers[files[0]][1] if files else {}
    return flat, {"metadata": meta, "shards": len(files)}


def _check_unnamed(index: Path, named: set[str]) -> None:
    """No shard of this index's pattern (``model-00004-of-00004.safetensors``, left by another
    export) lies in the folder unnamed by the index: which copy of its tensors is meant?"""
    stem = index.name[: -len(INDEX_SUFFIX)]
    pattern = re.compile(re.escape(stem) + r"-\d+-of-\d+\.safetensors")
    for p in sorted(index.parent.iterdir()):
        if pattern.fullmatch(p.name) and p.name not in named:
            raise DamagedError(
                f"{p}: a shard file in the folder of {index.name} that the index does not name; "
                "remove it or fix the index"
            )


def _map(path: Path) -> np.ndarray[Any, Any]:
    """The bytes of a shard, mapped read-only (an empty array for an empty file)."""
    try:
        return np.memmap(path, np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise StorageError(f"cannot map {path}: {exc}") from None
