"""Reading and writing other checkpoint files: .safetensors, .npz and flax msgpack (orbax folders:
:mod:`treestore._api.interop.orbax_folders`), and the checks every foreign file passes first.

Readers return a flat dict of arrays (safetensors, npz) or the nested tree the format holds (flax
msgpack), plus a record of what they found; writers write one file from named arrays. Every
failure of a foreign file is an UnsupportedFormatError naming the file.

Nothing is opened before ``os.stat`` says it is a regular file (a FIFO would block the reader
forever, a link to ``/dev/zero`` feed it until memory runs out) of a size its reader can hold; an
array is allocated only once the file is known to hold the bytes its header declares.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from treestore._engine.reading.memory import physical_memory
from treestore._format.dtypes import DTYPES, NUMPY_NAMES
from treestore.errors import InvalidInputError, OutOfMemoryError, TreestoreError, UnsupportedFormatError

FORMATS = ("safetensors", "npz", "msgpack", "orbax")
SUFFIXES = {".safetensors": "safetensors", ".npz": "npz", ".msgpack": "msgpack"}
FLAT = ("safetensors", "npz")
NPY_DTYPES = NUMPY_NAMES  # .npy holds these
# safetensors dtype codes -> our dtype names (every code safetensors writes that numpy can hold)
_ST_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip
NPY_MAGIC = b"\x93NUMPY"
DEFLATE_RATIO = 1032  # the most deflate can expand its input
ST_HEADER_BYTES = 100_000_000  # the most of a safetensors header read (the safetensors package's cap)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a special file"


def check_kind(
    path: Path, expected: str, error: type[TreestoreError] = UnsupportedFormatError
) -> os.stat_result:
    """``os.stat`` of ``path`` (a symlink followed), refused unless it is ``expected`` ("a regular
    file" or "a folder"). os.stat answers without opening anything, so a FIFO, which would block
    a reader forever, or a link to a device such as /dev/zero, which would feed it without end,
    is refused before any library opens it."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise error(f"{path}: expected {expected}, but cannot stat it: {exc.strerror or exc}") from None
    found = _kind(st.st_mode)
    if found != expected:
        link = f" (a symlink to {os.path.realpath(path)})" if os.path.islink(path) else ""
        raise error(f"{path}: expected {expected}, found {found}{link}")
    return st


def check_size(path: Path, st: os.stat_result, cap: int) -> None:
    """A file its reader reads whole is at most ``cap`` bytes."""
    if st.st_size > cap:
        raise UnsupportedFormatError(
            f"{path}: {st.st_size:,} bytes, more than the {cap:,} bytes treestore reads of such a file"
        )


def _check_memory(path: Path, declared: int) -> None:
    """What the arrays of a file declare together fits in this machine's memory; the operating
    system would grant more lazily and kill the process later."""
    if declared > physical_memory():
        raise OutOfMemoryError(
            f"{path}: its arrays declare {declared:,} bytes, more than this machine's "
            f"{physical_memory():,} bytes of memory"
        )


def detect_format(path: str | os.PathLike[str], format: str | None = None) -> str:
    """The format of ``path``: ``format`` when given, else from its suffix (a folder is orbax)."""
    if format is not None:
        if format not in FORMATS:
            raise InvalidInputError(f"unknown format {format!r}; treestore knows {', '.join(FORMATS)}")
        return format
    p = Path(path)
    if p.is_dir():
        return "orbax"
    found = SUFFIXES.get(p.suffix.lower())
    if found is None:
        raise InvalidInputError(
            f"cannot tell the format of {str(p)!r} from its name; use a .safetensors, .npz or "
            f".msgpack file, an orbax folder, or say which with format= (--format)"
        )
    return found


def _missing(package: str, what: str) -> UnsupportedFormatError:
    """The error for an optional package that is not installed: it says what to install."""
    return UnsupportedFormatError(
        f"{what} needs the {package} package, which is not installed: pip install {package}"
    )


@dataclass(frozen=True)
class StTensor:
    """One tensor a safetensors header declares, checked against the file: its bytes are
    ``[start, stop)`` of the file (absolute offsets)."""

    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    start: int
    stop: int


def safetensors_header(path: Path) -> tuple[dict[str, StTensor], dict[str, str], int]:
    """The tensors a safetensors file declares, its metadata block and its size, every tensor's
    dtype, shape and offsets checked against the file before any array is allocated.

    treestore's own checks run first, so an error names the tensor at fault (the safetensors
    package says only that some tensor is wrong); the package then checks what they leave out
    (overlapping tensors, gaps)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise _missing("safetensors", f"reading {path}") from None

    found = _st_tensors(path)
    try:
        with safe_open(str(path), framework="np") as f:
            keys = list(f.keys())
            file_meta = f.metadata()
    except Exception as exc:
        raise UnsupportedFormatError(f"{path} is not a valid safetensors file: {exc}") from None
    size = os.stat(path).st_size
    return {key: found[key] for key in keys if key in found}, file_meta or {}, size


def _st_tensors(path: Path) -> dict[str, StTensor]:
    """The tensors of a safetensors header, each dtype, shape and offsets checked against the
    file's size; the header is read only when the file holds it and it is within the cap the
    safetensors package keeps to."""
    invalid = f"{path} is not a valid safetensors file"
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise UnsupportedFormatError(f"{invalid}: {size} bytes, too short for a header")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8 or n > ST_HEADER_BYTES:
            raise UnsupportedFormatError(f"{path}: header of {n:,} bytes in a file of {size:,}")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise UnsupportedFormatError(f"{invalid}: its header is not JSON ({exc})") from None
        except RecursionError:
            raise UnsupportedFormatError(f"{invalid}: its header is nested too deep") from None
    if not isinstance(header, dict):
        raise UnsupportedFormatError(f"{invalid}: its header is not a JSON object")
    base = 8 + n
    found: dict[str, StTensor] = {}
    for key, info in header.items():
        if key != "__metadata__":
            found[key] = _st_tensor(path, key, info, base, size)
    return found


def _st_tensor(path: Path, key: str, info: Any, base: int, size: int) -> StTensor:
    """One tensor's header entry, checked: a known dtype, a shape of non-negative ints, and
    offsets within the data section that span exactly the bytes the shape declares."""
    fields = info if isinstance(info, dict) else {}
    code, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
    if (
        not isinstance(code, str)
        or not isinstance(shape, list)
        or not all(type(d) is int and d >= 0 for d in shape)
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
    ):
        raise UnsupportedFormatError(
            f"{path}: tensor {key!r} has header entry {str(info)[:200]}; expected "
            "dtype, shape (non-negative ints) and data_offsets (two ints)"
        )
    name = _ST_DTYPES.get(code)
    if name is None or name not in DTYPES:
        raise UnsupportedFormatError(f"{path}: tensor {key!r} has dtype {code}, which treestore cannot store")
    dtype = DTYPES[name]
    start, stop = offsets
    declared = math.prod(shape) * dtype.itemsize
    if not 0 <= start <= stop <= size - base or stop - start != declared:
        raise UnsupportedFormatError(
            f"{path}: tensor {key!r} declares {declared:,} bytes at offsets [{start}, {stop}) "
            f"of a data section of {size - base:,} bytes"
        )
    return StTensor(dtype, tuple(shape), base + start, base + stop)


def read_safetensors(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    found, file_meta, _ = safetensors_header(path)
    flat: dict[str, Any] = {}
    with open(path, "rb") as f:
        for key, t in found.items():
            buf = np.empty(t.stop - t.start, np.uint8)
            f.seek(t.start)
            if f.readinto(buf.data) != buf.size:
                raise UnsupportedFormatError(f"{path}: tensor {key!r} is truncated")
            flat[key] = buf.view(t.dtype).reshape(t.shape)
    return flat, {"metadata": file_meta}


def read_npz(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The arrays of an .npz archive, each member's header checked against the bytes the archive
    holds for it, and all of them against this machine's memory, before any is allocated."""
    with open(path, "rb") as f:
        if f.read(len(NPY_MAGIC)) == NPY_MAGIC:
            raise UnsupportedFormatError(f"{path} holds a single .npy array, not an .npz archive")
    try:
        with zipfile.ZipFile(path) as z:
            members = [info for info in z.infolist() if not info.is_dir()]
            _check_memory(path, sum(_npy_bytes(path, z, info) for info in members))
            flat = {}
            for info in members:
                with z.open(info) as f:
                    flat[info.filename[: -len(".npy")]] = np.lib.format.read_array(f, allow_pickle=False)
            return flat, {}
    except TreestoreError:
        raise
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        raise UnsupportedFormatError(f"{path} is not a readable .npz archive: {exc}") from None


def _npy_bytes(path: Path, z: zipfile.ZipFile, info: zipfile.ZipInfo) -> int:
    """The bytes the array in member ``info`` declares, once its header is known to fit in what
    the archive holds for the member (a tiny file may declare terabytes)."""
    where = f"{path}: member {info.filename!r}"
    if not info.filename.endswith(".npy"):
        raise UnsupportedFormatError(
            f"{where}: expected an .npy array, as np.savez writes; found another file"
        )
    _check_claim(where, info, os.stat(path).st_size)
    with z.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise UnsupportedFormatError(f"{where}: .npy format version {version}; expected 1.0 or 2.0")
        offset = f.tell()
    declared = math.prod(shape) * dtype.itemsize
    if declared > info.file_size - offset:
        raise UnsupportedFormatError(
            f"{where}: declares an array of {shape} {dtype} ({declared:,} bytes), "
            f"but holds {info.file_size - offset:,} bytes of data"
        )
    return declared


def _check_claim(where: str, info: zipfile.ZipInfo, archive: int) -> None:
    """A member's compressed bytes fit in the archive, and its uncompressed size is what a stored
    (or deflated) member of that many bytes can hold."""
    ratio = {zipfile.ZIP_STORED: 1, zipfile.ZIP_DEFLATED: DEFLATE_RATIO}.get(info.compress_type)
    if info.compress_size > archive or (ratio is not None and info.file_size > info.compress_size * ratio):
        raise UnsupportedFormatError(
            f"{where}: claims {info.file_size:,} bytes ({info.compress_size:,} compressed) "
            f"in an archive of {archive:,} bytes"
        )


def read_msgpack(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        from flax import serialization
    except ImportError:
        raise _missing("flax", f"reading the flax msgpack file {path}") from None
    _check_memory(path, path.stat().st_size)  # read whole; read_file checked it is a regular file
    try:
        tree = serialization.msgpack_restore(path.read_bytes())
    except Exception as exc:
        raise UnsupportedFormatError(
            f"{path} is not a flax msgpack file: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(tree, dict):
        raise UnsupportedFormatError(f"{path} holds a {type(tree).__name__}, not a flax state dict")
    return tree, {}


READERS = {"safetensors": read_safetensors, "npz": read_npz, "msgpack": read_msgpack}  # orbax: orbax_folders


def write_safetensors(tmp: str, items: Iterator[tuple[str, Any]], metadata: dict[str, str] | None) -> None:
    try:
        import safetensors.numpy
    except ImportError:
        raise _missing("safetensors", "writing .safetensors files") from None
    tensors = dict(items)
    try:
        safetensors.numpy.save_file(tensors, tmp, metadata=metadata)
    except Exception as exc:
        raise UnsupportedFormatError(f"safetensors cannot write these tensors: {exc}") from None


def write_npz(out: BinaryIO, items: Iterator[tuple[str, Any]]) -> None:
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for key, array in items:  # what np.savez does, one array at a time
            with z.open(key + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asarray(array), allow_pickle=False)


def write_msgpack(out: BinaryIO, items: Iterator[tuple[tuple[str, ...], Any]]) -> None:
    try:
        from flax import serialization
    except ImportError:
        raise _missing("flax", "writing flax msgpack files") from None
    root: dict[str, Any] = {}
    for names, value in items:
        node = root
        for part in names[:-1]:
            node = node.setdefault(part, {})
        node[names[-1]] = value
    out.write(serialization.msgpack_serialize(root))
