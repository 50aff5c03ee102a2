"""Chunk codecs: raw bytes <-> the bytes of a chunk object.

A chunk object is self-describing (SPEC.md, "Chunk objects")::

    magic "TSC1" | codec u8 | plane width u8 | plane mask u16 | raw size u64 | body

codec 0 stores the raw bytes, codec 1 one zstd frame, codec 2 byte planes: byte j of every element
gathered into plane j (least significant first), each plane zstd-compressed when its bit in the mask is
set, else stored raw, preceded by a table of the planes' stored lengths (u64 each). Whether a plane (or a
whole chunk) is compressed is decided from a small sample, so incompressible mantissa bytes cost no CPU.
Decoding trusts nothing: every length is checked against the declared raw size before allocating.

Planes are made and undone by :mod:`treestore._kernels.planes` (compiled loops where they were
built, else numpy; the same bytes either way), frames by each thread's own compressors
(:mod:`treestore._kernels.compressors`). Decoding decompresses each plane straight into this
thread's scratch buffer and unshuffles it into the caller's array.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from treestore._format.limits import CHUNK_HEADER_BYTES, CHUNK_SLACK, MAX_PLANE_WIDTH
from treestore._kernels.compressors import compressor, decompressor
from treestore._kernels.planes import WIDEST, join_planes, joined_fast, split_planes
from treestore._kernels.scratch import scratch
from treestore.errors import ChunkDamagedError, InvalidInputError

MAGIC = b"TSC1"
HEADER = struct.Struct("<4sBBHQ")
assert HEADER.size == CHUNK_HEADER_BYTES
assert MAX_PLANE_WIDTH <= WIDEST  # the compiled planes are checked at every width a chunk may have
RAW, ZSTD, PLANES = 0, 1, 2
SAMPLE_BYTES = 64 * 1024
PAYS_OFF = 0.97  # compress a plane only if a sample shrinks below this fraction
# A pack is compressed only if that at least halves it: stored raw, any member of it is one range
# of the object, read alone (SPEC.md section 6.5), which is worth more to a read of one small leaf
# than the quarter or tenth that weights in bf16 or fp32 shrink by (packs hold a model's smallest
# leaves: a sliver of its bytes). Zeros, counters and masks still compress.
PACK_PAYS_OFF = 0.5


@dataclass(frozen=True)
class Codec:
    """How chunks are compressed: ``Codec()`` is zstd level 1 with byte planes for floats.

    Each plane is compressed only when a sample says it pays; the rest is stored as it is.

    Attributes:
        name: ``"zstd"`` or ``"raw"`` (no compression).
        level: The zstd level, -7 to 22 (checked with ``"raw"`` too, where it is not used).
        byte_planes: Split floating-point chunks into byte planes before compressing (the
            exponent bytes compress well, mantissa bytes hardly at all).

    Raises:
        InvalidInputError: An unknown name or a level out of range.

    Examples:
        >>> Codec(level=30)
        Traceback (most recent call last):
        ...
        treestore.errors.InvalidInputError: zstd level must be between -7 and 22, got 30
    """

    name: str = "zstd"
    level: int = 1
    byte_planes: bool = True

    def __post_init__(self) -> None:
        if self.name not in ("zstd", "raw"):
            raise InvalidInputError(f"codec name must be 'zstd' or 'raw', got {self.name!r}")
        if type(self.level) is not int or not -7 <= self.level <= 22:
            raise InvalidInputError(f"zstd level must be between -7 and 22, got {self.level!r}")

    def to_record(self) -> dict[str, object]:
        """The codec as a manifest records it (what :attr:`Checkpoint.codec` gives back).

        Returns:
            dict[str, object]: ``{"name": ..., "level": ..., "byte_planes": ...}``.

        Examples:
            >>> Codec(level=3).to_record()
            {'name': 'zstd', 'level': 3, 'byte_planes': True}
        """
        return {"name": self.name, "level": self.level, "byte_planes": self.byte_planes}


def plane_width(dtype: np.dtype[Any]) -> int:
    """Bytes per floating-point element worth splitting into planes; 0 for other dtypes."""
    if dtype.kind == "c":
        return dtype.itemsize // 2
    if dtype.kind == "f" or dtype.name.startswith(("bfloat", "float8", "float6", "float4")):
        return dtype.itemsize if dtype.itemsize >= 2 else 0
    return 0


def stored_codec(chunks: Sequence[tuple[int, int]], dtype: np.dtype[Any], codec: dict[str, Any]) -> str:
    """How a leaf's chunks — (raw size, stored size) pairs — are stored, told without reading
    them: a raw chunk object is exactly its raw size plus the header; the others are compressed
    as the checkpoint's codec record says. "raw", "zstd", "zstd+planes", with "/raw" when some
    chunks did not compress; "-" for a leaf without chunks."""
    if not chunks:
        return "-"
    raw = [stored == size + HEADER.size for size, stored in chunks]
    if all(raw):
        return "raw"
    name = "zstd+planes" if codec.get("byte_planes") and plane_width(dtype) else "zstd"
    return name + ("/raw" if any(raw) else "")


def _maybe_compress(data: np.ndarray[Any, Any], level: int, spread: bool = False) -> bytes | None:
    """zstd of ``data`` if a sample says it pays, else None; ``spread``: on every core."""
    if data.nbytes > 2 * SAMPLE_BYTES:
        mid = data.nbytes // 2
        sample = data[mid : mid + SAMPLE_BYTES]
        if len(compressor(level).compress(sample.data)) > PAYS_OFF * SAMPLE_BYTES:
            return None
    packed = compressor(level, spread=spread).compress(data.data)
    return packed if len(packed) < PAYS_OFF * data.nbytes else None


def encode(
    raw: np.ndarray[Any, Any],
    width: int,
    codec: Codec,
    *,
    reuse: bool = False,
    spread: bool = False,
    pays_off: float | None = None,
) -> list[bytes | memoryview]:
    """The chunk object for ``raw`` (a 1-D uint8 array), as buffers to write in order.

    With ``reuse`` the buffers may point into this thread's scratch memory: write them before
    this thread encodes again. With ``spread`` its planes are compressed on every core (the
    bytes differ, the chunk they decode to does not). With ``pays_off`` the object is stored raw
    unless compression brings it below that fraction of ``raw`` (packs: :data:`PACK_PAYS_OFF`).
    """
    buffers = _encode(raw, width, codec, reuse, spread)
    if pays_off is not None and sum(len(b) for b in buffers) > pays_off * raw.nbytes + HEADER.size:
        return [HEADER.pack(MAGIC, RAW, 0, 0, raw.nbytes), raw.data]
    return buffers


def _encode(
    raw: np.ndarray[Any, Any], width: int, codec: Codec, reuse: bool, spread: bool
) -> list[bytes | memoryview]:
    size = raw.nbytes
    if codec.name == "zstd" and size:
        if codec.byte_planes and width >= 2 and size % width == 0:
            flat = scratch(size) if reuse else np.empty(size, np.uint8)
            split_planes(raw, flat, width)
            planes = flat.reshape(width, -1)
            parts: list[bytes | memoryview] = []
            lengths = []
            mask = 0
            for j in range(width):
                packed = _maybe_compress(planes[j], codec.level, spread)
                if packed is None:
                    parts.append(planes[j].data)
                    lengths.append(planes[j].nbytes)
                else:
                    mask |= 1 << j
                    parts.append(packed)
                    lengths.append(len(packed))
            if mask:
                table = struct.pack(f"<{width}Q", *lengths)
                return [HEADER.pack(MAGIC, PLANES, width, mask, size), table, *parts]
        else:
            packed = _maybe_compress(raw, codec.level, spread)
            if packed is not None:
                return [HEADER.pack(MAGIC, ZSTD, 0, 0, size), packed]
    return [HEADER.pack(MAGIC, RAW, 0, 0, size), raw.data]


def _unzstd_into(frame: bytes | memoryview, out: np.ndarray[Any, Any]) -> None:
    """Decompress the zstd frame ``frame`` straight into ``out`` (1-D uint8), which it must
    fill exactly: the frame's declared size is checked first, and nothing is written past
    ``out``."""
    size = out.nbytes
    declared = zstandard.frame_content_size(frame)
    if declared != size:
        raise ChunkDamagedError(f"zstd frame declares {declared} bytes, expected {size}")
    target = memoryview(out.data).cast("B")
    reader = decompressor().stream_reader(frame)
    done = 0
    while done < size:
        n = reader.readinto(target[done:])
        if not n:
            break
        done += n
    if done != size:
        raise ChunkDamagedError(f"zstd frame decoded to {done} bytes, expected {size}")


def _header(obj: bytes | memoryview, size: int) -> tuple[int, int, int]:
    """The codec, plane width and mask of chunk object ``obj`` (raw size ``size``), after checking
    its header; ChunkDamagedError otherwise."""
    if len(obj) < HEADER.size:
        raise ChunkDamagedError(f"chunk object is {len(obj)} bytes, shorter than its header")
    magic, codec, width, mask, raw_size = HEADER.unpack_from(obj)
    if magic != MAGIC:
        raise ChunkDamagedError(f"chunk object starts with {magic!r}, expected {MAGIC!r}")
    if raw_size != size:
        raise ChunkDamagedError(f"chunk object declares {raw_size} raw bytes, expected {size}")
    if codec in (RAW, ZSTD) and (width or mask):
        raise ChunkDamagedError(f"codec {codec} chunk has plane fields {width}, {mask:#x}; expected 0")
    return codec, width, mask


PROBE_BYTES = HEADER.size + 8 * MAX_PLANE_WIDTH  # what :func:`sound` reads of an object at most


def sound(head: bytes, stored: int, raw_size: int) -> bool:
    """Whether an object of ``stored`` bytes whose first bytes are ``head`` (up to
    :data:`PROBE_BYTES`) can be the chunk object of ``raw_size`` raw bytes, told from its header
    and sizes alone — the reuse check of SPEC.md section 5.2. An empty, truncated, extended or
    overwritten object fails it; a body damaged in place behind an intact header and size passes
    (only a full decode finds that)."""
    if not HEADER.size < stored <= raw_size + CHUNK_SLACK or len(head) < min(stored, PROBE_BYTES):
        return False
    try:
        codec, width, mask = _header(head, raw_size)
    except ChunkDamagedError:
        return False
    if codec == RAW:
        return stored == HEADER.size + raw_size
    if codec == ZSTD:
        return True
    if codec != PLANES or not 2 <= width <= MAX_PLANE_WIDTH or raw_size % width or mask >= 1 << width:
        return False
    table = HEADER.size + 8 * width
    return stored >= table and sum(struct.unpack_from(f"<{width}Q", head, HEADER.size)) == stored - table


def decode_into(obj: bytes | memoryview, out: np.ndarray[Any, Any]) -> None:
    """Decode the chunk object ``obj`` into ``out`` (1-D uint8, exactly the raw size).

    Raises ChunkDamagedError on any inconsistency (an undefined codec included); never allocates
    more than ``out.nbytes`` for decoded data.
    """
    size = out.nbytes
    codec, width, mask = _header(obj, size)
    body = memoryview(obj)[HEADER.size :]
    try:
        if codec == RAW:
            if len(body) != size:
                raise ChunkDamagedError(f"raw chunk holds {len(body)} bytes, expected {size}")
            out[:] = np.frombuffer(body, np.uint8)
        elif codec == ZSTD:
            _unzstd_into(body, out)
        elif codec == PLANES:
            _decode_planes(body, out, width, mask)
        else:
            raise ChunkDamagedError(f"has codec id {codec}, which no version defines")
    except zstandard.ZstdError as exc:
        raise ChunkDamagedError(f"zstd frame does not decode: {exc}") from None


def decode_in_place(buf: np.ndarray[Any, Any], n: int, out: np.ndarray[Any, Any]) -> None:
    """:func:`decode_into` for a chunk object held in ``buf[:n]`` (1-D uint8, writable), where
    ``buf`` may be used as scratch up to :func:`in_place_room` bytes.

    Byte planes whose compressed planes all follow the raw ones (fp32 and bf16 weights: the
    exponent planes compress, the mantissa planes do not) are unshuffled from ``buf`` itself:
    the compressed planes are moved past the planes' span and decompressed into place, so the
    raw planes are never copied. Anything else decodes as :func:`decode_into` does, with the
    same checks.
    """
    size = out.nbytes
    obj = buf[:n]
    codec, width, mask = _header(obj.data, size)
    table = HEADER.size + 8 * width
    raw_planes = (~mask & ((1 << width) - 1)).bit_length()  # planes below the first compressed one
    if (
        codec != PLANES
        or not joined_fast(width)
        or not out.flags.c_contiguous
        or not 2 <= width <= MAX_PLANE_WIDTH
        or size % width
        or not 0 < mask < 1 << width
        or mask != ((1 << width) - 1) ^ ((1 << raw_planes) - 1)  # compressed planes not a suffix
        or n < table
    ):
        decode_into(obj.data, out)
        return
    plane = size // width
    lengths = struct.unpack_from(f"<{width}Q", obj.data, HEADER.size)
    span = table + width * plane  # where the planes lie once decoded
    if (
        sum(lengths) != n - table
        or any(lengths[j] != plane for j in range(raw_planes))
        or n > span  # "compressed" planes longer than raw ones: not worth a special case
        or len(buf) < span + n - (table + raw_planes * plane)
    ):
        decode_into(obj.data, out)  # (which names what is wrong)
        return
    packed = table + raw_planes * plane
    buf[span : span + n - packed] = buf[packed:n]  # after the source: no overlap (n <= span)
    at = span
    try:
        for j in range(raw_planes, width):
            _unzstd_into(buf[at : at + lengths[j]].data, buf[table + j * plane : table + (j + 1) * plane])
            at += lengths[j]
    except zstandard.ZstdError as exc:
        raise ChunkDamagedError(f"zstd frame does not decode: {exc}") from None
    join_planes(buf[table:span], out, width)


def in_place_room(raw_size: int) -> int:
    """How many bytes of scratch :func:`decode_in_place` may use for a chunk of ``raw_size``
    raw bytes: the object, its planes decoded, and its compressed planes moved past them."""
    return 2 * (raw_size + CHUNK_SLACK) + 1


def _decode_planes(body: memoryview, out: np.ndarray[Any, Any], width: int, mask: int) -> None:
    size = out.nbytes
    if not 2 <= width <= MAX_PLANE_WIDTH or size % width or mask >= 1 << width:
        raise ChunkDamagedError(f"bad byte-plane header (width {width}, mask {mask:#x})")
    table = struct.calcsize(f"<{width}Q")
    if len(body) < table:
        raise ChunkDamagedError("byte-plane table is truncated")
    lengths = struct.unpack_from(f"<{width}Q", body)
    if sum(lengths) != len(body) - table:
        raise ChunkDamagedError(f"byte planes declare {sum(lengths)} bytes, chunk holds {len(body) - table}")
    plane_size = size // width
    fast = joined_fast(width) and out.flags.c_contiguous
    # Where planes join fast (the compiled join, or word arithmetic) every plane goes to
    # this thread's scratch (compressed ones decompressed there directly) and one join writes
    # ``out``; otherwise each plane is written into ``out`` with a strided copy, straight from
    # the chunk object when the plane is raw.
    planes = scratch(size, "planes").reshape(width, -1)
    grid = out.reshape(-1, width)
    at = table
    for j, length in enumerate(lengths):
        data = body[at : at + length]
        at += length
        if mask >> j & 1:
            _unzstd_into(data, planes[j])
            if not fast:
                grid[:, j] = planes[j]
        elif length == plane_size:
            if fast:
                planes[j] = np.frombuffer(data, np.uint8)
            else:
                grid[:, j] = np.frombuffer(data, np.uint8)
        else:
            raise ChunkDamagedError(f"raw byte plane {j} holds {length} bytes, expected {plane_size}")
    if fast:
        join_planes(planes.reshape(-1), out, width)
