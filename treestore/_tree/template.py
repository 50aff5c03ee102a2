"""Templates (``like=``): match a checkpoint's leaves to the caller's expected tree, and report
every mismatch at once; then turn stored data into the template's leaf types."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from treestore._format.dtypes import JAX, NPSCALAR, NUMPY, PRNG_KEY, PY_KINDS, dtype_name
from treestore._format.manifest import LeafEntry, Manifest
from treestore._tree.leaves import restore_array
from treestore._tree.structure import leaves_with_addresses
from treestore.errors import StructureMismatchError


@dataclass(frozen=True)
class Slot:
    """One leaf of the template, the stored entry that fills it, and how to restore it."""

    address: str
    like: Any
    entry: LeafEntry


def _is_key_like(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _expected(like: Any) -> tuple[str, tuple[int, ...] | None, str | None]:
    """(kind, shape, dtype name) a template leaf asks for; kind is a leaf kind or 'array'."""
    if type(like) in PY_KINDS:
        return PY_KINDS[type(like)], None, None
    if _is_key_like(like):
        data = jax.eval_shape(jax.random.key_data, like)
        return PRNG_KEY, tuple(data.shape), dtype_name(np.dtype(data.dtype))
    if hasattr(like, "shape") and hasattr(like, "dtype"):
        return "array", tuple(like.shape), dtype_name(np.dtype(like.dtype)) or str(like.dtype)
    return type(like).__name__, None, None


def describe(entry: LeafEntry) -> str:
    if entry.is_array:
        what = "PRNG key data" if entry.kind == PRNG_KEY else "array"
        return f"{what} {entry.dtype}{list(entry.shape or ())}"
    return f"Python {entry.kind}"


def _describe_like(like: Any) -> str:
    kind, shape, dtype = _expected(like)
    if shape is not None:
        return f"{'PRNG key data' if kind == PRNG_KEY else 'array'} {dtype}{list(shape)}"
    return f"Python {kind}"


def match(
    manifest: Manifest,
    like: Any,
    *,
    cast: bool,
    prefix: str = "",
) -> tuple[list[Slot], Any]:
    """Pair the template's leaves with stored leaves; raise one StructureMismatchError listing
    every missing, unexpected, kind-, shape- and dtype-mismatched address.

    ``prefix`` roots the template at a subtree of the checkpoint (its addresses are relative).
    """
    pairs, treedef = leaves_with_addresses(like)
    stored = {e.address: e for e in manifest.leaves}
    joined = (lambda a: f"{prefix}/{a}" if a else prefix) if prefix else (lambda a: a)
    problems: list[str] = []
    slots: list[Slot] = []
    wanted = set()
    for rel, leaf in pairs:
        address = joined(rel)
        wanted.add(address)
        entry = stored.get(address)
        if entry is None:
            problems.append(
                f"{address or '(root)'}: missing: expected {_describe_like(leaf)}, not in the checkpoint"
            )
            continue
        kind, shape, dtype = _expected(leaf)
        if kind in PY_KINDS.values():
            if entry.kind != kind:
                problems.append(f"{address or '(root)'}: expected Python {kind}, found {describe(entry)}")
        elif kind in ("array", PRNG_KEY):
            if not entry.is_array or (kind == PRNG_KEY) != (entry.kind == PRNG_KEY):
                problems.append(
                    f"{address or '(root)'}: expected {_describe_like(leaf)}, found {describe(entry)}"
                )
            elif shape != entry.shape:
                problems.append(f"{address or '(root)'}: expected shape {shape}, found {entry.shape}")
            elif dtype != entry.dtype and not cast:
                problems.append(
                    f"{address or '(root)'}: expected dtype {dtype}, found {entry.dtype} "
                    "(pass cast=True to convert)"
                )
        else:
            problems.append(
                f"{address or '(root)'}: template leaf of type {kind} is not a "
                "supported leaf (use arrays, jax.ShapeDtypeStruct or Python scalars)"
            )
        slots.append(Slot(address, leaf, entry))
    under = (lambda a: a == prefix or a.startswith(prefix + "/")) if prefix else (lambda a: True)
    for address, entry in stored.items():
        if address not in wanted and under(address):
            problems.append(
                f"{address or '(root)'}: unexpected: found {describe(entry)}, not in the template"
            )
    if problems:
        raise StructureMismatchError(problems, checkpoint=manifest.name)
    return slots, treedef


def target_sharding(slot: Slot) -> Any:
    """The sharding to assemble this leaf onto shard by shard, or None to read it whole: a
    template's sharding over several devices (or other processes' devices)."""
    sharding = getattr(slot.like, "sharding", None)
    if sharding is None or not slot.entry.is_array or slot.entry.kind == PRNG_KEY:
        return None
    if len(sharding.device_set) == 1 and sharding.is_fully_addressable:
        return None
    return sharding


def assemble(slot: Slot, sharding: Any, read: Callable[[tuple[slice, ...]], np.ndarray[Any, Any]]) -> Any:
    """A jax.Array on ``sharding`` whose every addressable shard is read by ``read(region)`` —
    each distinct region once, whatever sharding the leaf was saved with."""
    like, entry = slot.like, slot.entry
    dtype = np.dtype(like.dtype)
    cache: dict[tuple[tuple[int, int], ...], np.ndarray[Any, Any]] = {}

    def shard(index: tuple[slice, ...] | None) -> np.ndarray[Any, Any]:
        region = _region_of(index or (), entry.shape or ())
        key = tuple((r.start, r.stop) for r in region)
        if key not in cache:
            data = read(region)
            cache[key] = data if data.dtype == dtype else data.astype(dtype)
        return cache[key]

    return jax.make_array_from_callback(tuple(entry.shape or ()), sharding, shard)


def _region_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    out = []
    for s, n in zip(index, shape, strict=False):
        start, stop, _ = s.indices(n)
        out.append(slice(start, stop))
    out += [slice(0, n) for n in shape[len(out) :]]
    return tuple(out)


def restore(slot: Slot, data: Any) -> Any:
    """The stored leaf as the type its template leaf asks for."""
    like, entry = slot.like, slot.entry
    if not entry.is_array:
        return entry.value
    kind, _, dtype = _expected(like)
    if kind == "array" and dtype is not None and dtype != entry.dtype:
        data = data.astype(np.dtype(like.dtype))
    if entry.kind == PRNG_KEY:
        return restore_array(PRNG_KEY, data, entry.prng_impl)
    if isinstance(like, np.generic):
        return restore_array(NPSCALAR, data, None)
    if isinstance(like, np.ndarray):
        return restore_array(NUMPY, data, None)
    weak = bool(getattr(like, "weak_type", entry.weak_type))
    array = restore_array(JAX, data, None, as_jax=True, weak_type=weak)
    sharding = getattr(like, "sharding", None)
    return array if sharding is None else jax.device_put(array, sharding)
