"""Leaves: what kinds of values treestore stores, and how each is turned into bytes and back.

Array-like leaves (numpy arrays, jax arrays, numpy scalars, typed PRNG key arrays) become a dtype,
a shape and C-ordered little-endian bytes. Python scalars (int, float, bool, complex, str, bytes)
are stored as values in the manifest and restored as the same type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._format.address import encodable
from treestore._format.dtypes import (
    JAX,
    NPSCALAR,
    NUMPY,
    PRNG_IMPLS,
    PRNG_KEY,
    PY_KINDS,
    dtype_name,
    value_to_record,
)
from treestore._format.manifest.rules import check_shape
from treestore._tree.jax_import import jax
from treestore.errors import UnsupportedLeafError


# Leaves are never changed once made (make a new one with dataclasses.replace); they are not
# frozen dataclasses only because a frozen dataclass's __init__ costs a microsecond per leaf.
@dataclass(slots=True)
class ArrayLeaf:
    """An array-like leaf ready to store: its kind, dtype name, and host data (C order, LE).

    A sharded jax.Array is not gathered: ``pieces`` holds (start index, host data) of each shard
    this process owns (replica 0 only), ``data`` is None, and ``global_shape`` is its shape.

    A big jax array that a save fetches while it writes (:func:`prepare_leaf` with ``keep``) has
    ``data`` None and ``source``, the array on its device; a sharded one keeps its big pieces on
    their devices too (jax arrays in ``pieces``).
    """

    kind: str
    dtype: str
    data: np.ndarray[Any, Any] | None
    prng_impl: str | None = None
    pieces: tuple[tuple[tuple[int, ...], np.ndarray[Any, Any]], ...] = ()
    global_shape: tuple[int, ...] | None = None
    weak_type: bool = False
    # Nothing but the save can reach the host data (a copy made for it, or a device array's
    # host copy, which jax never changes): a save reads it without a copy of its own.
    private: bool = False
    source: Any = None  # the jax array whose bytes are fetched as they are written (data is None)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.global_shape is not None:
            return self.global_shape
        if self.data is None:
            return tuple(self.source.shape)
        return tuple(self.data.shape)

    @property
    def sharded(self) -> bool:
        return self.global_shape is not None


@dataclass(slots=True)
class ValueLeaf:
    """A Python scalar leaf, stored in the manifest as its value."""

    kind: str
    value: object

    @property
    def size_floor(self) -> int:
        """At least how many bytes the value takes in a manifest."""
        return len(self.value) if isinstance(self.value, (str, bytes)) else 1


Leaf = ArrayLeaf | ValueLeaf


@dataclass(frozen=True)
class Keep:
    """Which jax arrays a save leaves on their devices, to fetch while it writes: those of at
    least ``min_bytes`` bytes that live off the CPU, or (``cpu``) on any device."""

    min_bytes: int
    cpu: bool = False

    def kept(self, x: jax.Array) -> bool:
        return x.ndim > 0 and x.nbytes >= max(1, self.min_bytes) and (self.cpu or off_cpu(x))


def _host(array: np.ndarray[Any, Any], copy: bool = False) -> np.ndarray[Any, Any]:
    """C-contiguous little-endian host data; the caller's array is never modified."""
    if array.dtype.byteorder == ">":
        return array.astype(array.dtype.newbyteorder("<"))
    return array.copy(order="C") if copy or not array.flags.c_contiguous else array


def off_cpu(x: jax.Array) -> bool:
    """Whether ``x`` lives on no CPU device, so that its host data is a copy jax made (and
    never changes), not a view of a device buffer that a donation could reuse."""
    try:
        return all(d.platform != "cpu" for d in x.devices())
    except Exception:  # an array without devices (deleted, abstract) is never trusted
        return False


def prepare_leaf(value: object, address: str, *, copy: bool = False, keep: Keep | None = None) -> Leaf:
    """Classify one leaf, or raise UnsupportedLeafError naming its address and type.

    jax arrays are copied to host here, once; those that ``keep`` keeps (and the pieces of a
    sharded one that it keeps) stay on their devices, for the save to fetch.
    """
    if type(value) is np.ndarray:  # the most common leaf first
        return _numpy_leaf(value, address, copy)
    where = address or "(root)"
    kind = PY_KINDS.get(type(value))
    if kind is not None:
        if kind == "str" and not encodable(value):  # type: ignore[arg-type]
            raise UnsupportedLeafError(
                f"{where}: str leaf is not valid Unicode text (lone surrogate)", address=address
            )
        if kind == "int":
            try:
                value_to_record(kind, value)  # the bound readers keep to
            except ValueError as exc:
                raise UnsupportedLeafError(f"{where}: {exc}", address=address) from None
        return ValueLeaf(kind, value)
    if isinstance(value, jax.Array):
        deleted = getattr(value, "is_deleted", None)  # tracers have none
        if deleted is not None and deleted():
            raise UnsupportedLeafError(
                f"{where}: the jax array has been deleted (donated to a jitted function, or "
                "deleted with .delete()); save a live array",
                address=address,
            )
        impl = None
        kind = JAX
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            kind, impl = PRNG_KEY, str(jax.random.key_impl(value))
            if impl not in PRNG_IMPLS:
                raise UnsupportedLeafError(
                    f"{where}: PRNG keys of implementation {impl!r} cannot be stored; treestore "
                    f"stores {', '.join(PRNG_IMPLS)} keys (save jax.random.key_data of others)",
                    address=address,
                )
            value = jax.random.key_data(value)
        name = _checked_array(np.dtype(value.dtype), tuple(value.shape), address)
        weak = bool(getattr(value, "weak_type", False))
        owned = _owned_shards(value, keep)
        jax_copy = off_cpu(value)  # the host data is jax's own copy
        if owned is None:
            if keep is not None and keep.kept(value):
                source = value if value.is_fully_addressable else value.addressable_data(0)
                return ArrayLeaf(kind, name, None, impl, weak_type=weak, private=True, source=source)
            whole = _whole(value)
            data = _host(whole, copy)
            return ArrayLeaf(kind, name, data, impl, weak_type=weak, private=jax_copy or data is not whole)
        shards = tuple((s, d if not isinstance(d, np.ndarray) else _host(d, copy)) for s, d in owned)
        copied = all(
            h is not d or not isinstance(d, np.ndarray) for (_, h), (_, d) in zip(shards, owned, strict=True)
        )
        private = jax_copy or copied
        return ArrayLeaf(kind, name, None, impl, shards, tuple(value.shape), weak, private)
    if isinstance(value, (np.matrix, np.ma.MaskedArray)):
        what = "an np.matrix" if isinstance(value, np.matrix) else "a masked array (its mask)"
        fix = "np.asarray(x)" if isinstance(value, np.matrix) else "x.data and x.mask as two leaves"
        raise UnsupportedLeafError(
            f"{where}: cannot store {what}: it would not load back as what was saved; store {fix}",
            address=address,
        )
    if isinstance(value, np.ndarray):
        return _numpy_leaf(value.view(np.ndarray), address, copy)  # a subclass: np.memmap ...
    if isinstance(value, np.generic):
        data = np.asarray(value)
        return ArrayLeaf(NPSCALAR, _checked_name(data.dtype, address), _host(data))
    raise UnsupportedLeafError(
        f"{address or '(root)'}: cannot store a leaf of type {type(value).__module__}."
        f"{type(value).__qualname__}; treestore stores numpy and jax arrays, numpy scalars, "
        "PRNG keys, and Python int, float, bool, complex, str and bytes",
        address=address,
    )


def _numpy_leaf(value: np.ndarray[Any, Any], address: str, copy: bool) -> ArrayLeaf:
    name = _checked_array(value.dtype, value.shape, address)
    data = _host(value, copy)
    return ArrayLeaf(NUMPY, name, data, None, (), None, False, data is not value)


def _whole(x: jax.Array) -> np.ndarray[Any, Any]:
    """Host data of an unsharded or fully replicated array, copied from one device."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


def _owned_shards(x: jax.Array, keep: Keep | None = None) -> list[tuple[tuple[int, ...], Any]] | None:
    """(start, host data) of the shards of ``x`` this process writes, or None when ``x`` is
    not sharded (one device, or every device holds all of it). Each distinct shard is read from
    the device holding its replica 0, never gathered: one process holding every shard reads
    each once, as each process of a multi-process save reads its own. Shards that ``keep``
    keeps stay on their devices (their jax arrays stand for their data)."""
    sharding = x.sharding
    if sharding.is_fully_replicated or len(sharding.device_set) == 1:
        return None
    parts = []
    for shard in x.addressable_shards:
        if shard.replica_id != 0:  # one replica owner writes each distinct shard
            continue
        start = tuple(0 if s.start is None else int(s.start) for s in shard.index)
        data = shard.data
        parts.append((start, data if keep is not None and keep.kept(data) else np.asarray(data)))
    return parts


_ARRAYS_OK: dict[tuple[np.dtype[Any], tuple[int, ...]], str] = {}  # accepted (dtype, shape): name


def _checked_array(dtype: np.dtype[Any], shape: tuple[int, ...], address: str) -> str:
    """The store name of ``dtype``, once an array of it and ``shape`` is one readers accept;
    UnsupportedLeafError naming ``address`` otherwise. A model repeats a few dtypes and shapes
    many times: each pair is checked once (one lookup a leaf after that)."""
    name = _ARRAYS_OK.get((dtype, shape))
    if name is not None:
        return name
    name = _checked_name(dtype, address)
    try:
        check_shape(shape, dtype.itemsize)  # the bound readers keep to
    except ValueError as exc:
        raise UnsupportedLeafError(
            f"{address or '(root)'}: cannot store an array of shape {shape}: {exc}", address=address
        ) from None
    if len(_ARRAYS_OK) < 4096:
        _ARRAYS_OK[(dtype, shape)] = name
    return name


def _checked_name(dtype: np.dtype[Any], address: str) -> str:
    name = dtype_name(dtype)
    if name is None:
        raise UnsupportedLeafError(
            f"{address or '(root)'}: cannot store arrays of dtype {dtype}", address=address
        )
    return name


def restore_array(
    kind: str,
    data: np.ndarray[Any, Any],
    prng_impl: str | None,
    *,
    as_jax: bool | None = None,
    weak_type: bool = False,
) -> object:
    """Turn host data back into the leaf type it was saved as (or as the template asks)."""
    if kind == PRNG_KEY:
        return jax.random.wrap_key_data(jax.numpy.asarray(data), impl=prng_impl)
    if kind == NPSCALAR and as_jax is not True:
        return data[()]
    if as_jax if as_jax is not None else kind == JAX:
        array = jax.numpy.asarray(data)
        return _weakly_typed(array) if weak_type else array
    return data


def _weakly_typed(array: jax.Array) -> jax.Array:
    """``array`` as a weakly typed value (as Python scalars become in jax), so that a restored
    training state promotes dtypes exactly as the saved one did."""
    try:
        from jax._src.lax import lax as lax_internal  # no public API makes weak types

        return lax_internal._convert_element_type(array, array.dtype, weak_type=True)
    except (ImportError, AttributeError, TypeError):  # a jax without it: strongly typed
        return array
