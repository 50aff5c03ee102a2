"""What every record treestore reads has in common: msgpack decoding that trusts nothing, a
format version, typed fields with bounds, and BLAKE3 digests of ``DIGEST_BYTES`` (computed by
treestore._kernels.digest)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import msgpack

from treestore.errors import ManifestDamagedError, OutOfMemoryError, UnsupportedFormatError

FORMAT_VERSION = 2  # the version this treestore writes
NEWEST_VERSION = 2  # the newest version this treestore reads (it reads every version from 1)
DIGEST_BYTES = 32


def to_msgpack(obj: object) -> bytes:
    """msgpack encoding (bin type for bytes), as every record and digest uses."""
    return msgpack.packb(obj, use_bin_type=True)


class Bad(Exception):
    """Internal: a schema violation, turned into ManifestDamagedError with context."""


@contextlib.contextmanager
def manifest_errors(what: str, checkpoint: str) -> Iterator[None]:
    """How a manifest decoder reports what it finds wrong: ``Bad`` becomes a ManifestDamagedError
    saying ``what``, and an UnsupportedFormatError or ManifestDamagedError raised inside gets
    ``what`` in front of its message and the checkpoint's name."""
    try:
        yield
    except Bad as exc:
        raise ManifestDamagedError(f"{what}: {exc}", checkpoint=checkpoint) from None
    except (UnsupportedFormatError, ManifestDamagedError) as exc:
        exc.checkpoint = checkpoint
        exc.message = f"{what}: {exc.message}"
        exc.args = (exc.message,)
        raise


def field(rec: dict[str, Any], key: str, *types: type) -> Any:
    if key not in rec:
        raise Bad(f"missing field {key!r}")
    value = rec[key]
    if types and not (type(value) in types or (float in types and type(value) is int)):
        raise Bad(
            f"field {key!r} should be {'/'.join(t.__name__ for t in types)}, found {type(value).__name__}"
        )
    return value


def count(value: object, what: str, limit: int = 2**62) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise Bad(f"{what} should be an integer in [0, {limit}], found {value!r}")
    return value


def from_msgpack(data: bytes, what: str, checkpoint: str | None) -> dict[str, Any]:
    """A msgpack map decoded without trusting it; ManifestDamagedError names ``what``."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except MemoryError:
        raise OutOfMemoryError(f"{what}: out of memory decoding it", checkpoint=checkpoint) from None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ManifestDamagedError(
            f"{what} is not valid msgpack ({type(exc).__name__}: {exc})", checkpoint=checkpoint
        ) from None
    if not isinstance(obj, dict):
        raise ManifestDamagedError(f"{what} is not a map", checkpoint=checkpoint)
    return obj


def check_version(rec: dict[str, Any], magic: str, what: str, checkpoint: str | None) -> int:
    if rec.get("format") != magic:
        raise ManifestDamagedError(
            f"{what} has format {rec.get('format')!r}, expected {magic!r}", checkpoint=checkpoint
        )
    version = rec.get("version")
    if type(version) is not int:
        raise ManifestDamagedError(f"{what} has no integer version", checkpoint=checkpoint)
    if version > NEWEST_VERSION or version < 1:
        raise UnsupportedFormatError(
            f"{what} has format version {version}; this treestore reads versions 1 to "
            f"{NEWEST_VERSION} — upgrade treestore to read it",
            checkpoint=checkpoint,
        )
    return version
