"""Templates (``like=``): match a checkpoint's leaves to the caller's expected tree, and report
every mismatch at once; then turn stored data into the template's leaf types."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treestore._format.address import format_key, join_address, key_from_record
from treestore._format.dtypes import DTYPES, JAX, NPSCALAR, NUMPY, PRNG_KEY, PY_KINDS, dtype_name
from treestore._format.manifest.columns import Columns
from treestore._format.manifest.record_views import Stored, stored_rows
from treestore._tree.jax_import import jax
from treestore._tree.leaves import restore_array
from treestore._tree.structure import leaves_with_addresses
from treestore.errors import StructureMismatchError


@dataclass(frozen=True)
class Slot:
    """One leaf of the template, the stored leaf that fills it (None: the template's own value
    is kept, see :func:`_kept`), and how to restore it."""

    address: str
    like: Any
    entry: Stored | None
    expected: Expected | None = None  # what ``like`` asks for (:func:`_expected`), once matched


def _is_key_like(x: Any) -> bool:
    if type(x) is np.ndarray:  # never a key (and jax's lookups cost a big template's load)
        return False
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


Expected = tuple[str, tuple[int, ...] | None, str | None]  # kind, shape, dtype name


def _expected(like: Any) -> Expected:
    """(kind, shape, dtype name) a template leaf asks for; kind is a leaf kind or 'array'."""
    if type(like) in PY_KINDS:
        return PY_KINDS[type(like)], None, None
    if _is_key_like(like):
        data = jax.eval_shape(jax.random.key_data, like)
        return PRNG_KEY, tuple(data.shape), dtype_name(np.dtype(data.dtype))
    if hasattr(like, "shape") and hasattr(like, "dtype"):
        return "array", tuple(like.shape), dtype_name(np.dtype(like.dtype)) or str(like.dtype)
    return type(like).__name__, None, None


def describe(entry: Stored) -> str:
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
    columns: Columns,
    rows: Sequence[int] | None,
    like: Any,
    *,
    cast: bool,
    prefix: str = "",
    partial: bool = False,
) -> tuple[list[Slot], Any]:
    """Pair the template's leaves with the stored leaves ``rows`` of ``columns`` (None: every
    leaf); raise one StructureMismatchError listing every missing, unexpected, kind-, shape- and
    dtype-mismatched address.

    ``prefix`` roots the template at a subtree of the checkpoint (its addresses are relative).
    With ``partial`` the template may leave stored leaves out. A template leaf the checkpoint has
    no leaf for is kept from the template (its slot has no entry) when it is a callable, or a
    Python scalar where the checkpoint holds None (see :func:`_kept`); otherwise it is missing.
    """
    pairs, treedef = leaves_with_addresses(like)
    addresses = columns.addresses
    leaf_at = {addresses[i]: i for i in (range(len(columns)) if rows is None else rows)}
    nones: set[str] | None = None  # found on the first leaf the checkpoint lacks
    joined = rooted(prefix)
    found = [(joined(rel), leaf) for rel, leaf in pairs]
    wanted = {address for address, _ in found}
    # the stored leaves matched, read from the columns at once (a call per leaf shows at 100k)
    entries = iter(stored_rows(columns, [leaf_at[a] for a, _ in found if a in leaf_at]))
    problems: list[str] = []
    missing: list[str] = []  # the template's addresses the checkpoint has no leaf for
    slots: list[Slot] = []
    for address, leaf in found:
        if address not in leaf_at:
            nones = _none_addresses(columns.tree_record()) if nones is None else nones
            if _kept(leaf, address in nones):
                slots.append(Slot(address, leaf, None))
                continue
            held = " (it holds None there)" if address in nones else ""
            missing.append(address)
            problems.append(
                f"{address or '(root)'}: missing: expected {_describe_like(leaf)}, not in the "
                f"checkpoint{held}"
            )
            continue
        entry = next(entries)
        expected = _expected(leaf)
        problem = _mismatch(leaf, expected, entry, cast)
        if problem is not None:
            problems.append(f"{address or '(root)'}: {problem}")
        slots.append(Slot(address, leaf, entry, expected))
    unexpected = [a for a in leaf_at if a not in wanted and under(a, prefix) and not partial]
    for address in unexpected:
        held = describe(stored_rows(columns, [leaf_at[address]])[0])
        problems.append(f"{address or '(root)'}: unexpected: found {held}, not in the template")
    if problems:
        raise StructureMismatchError(problems, checkpoint=columns.name, hints=_hints(missing, unexpected))
    return slots, treedef


_DIGITS_QUOTED = re.compile(r'(?<![^/])"(\d+)"(?![^/])')  # a digit-string key segment: "0"


def _hints(missing: list[str], unexpected: list[str]) -> list[str]:
    """What to do about a mismatch, said once: list indices in the template where the checkpoint
    has digit-string dict keys (a flax- or Hugging Face-style tree), and ``partial=True`` when
    leaves of the checkpoint are not in the template."""
    hints = []
    bare = {_DIGITS_QUOTED.sub(r"\1", a): a for a in unexpected}
    paired = [(m, bare[m]) for m in missing if m in bare and bare[m] != m]
    if paired:
        m, u = paired[0]
        hints.append(
            f"{len(paired)} template leaves are missing only because the template has list indices "
            f"where the checkpoint has dict keys that are digit strings ({m} in the template, {u} in "
            'the checkpoint): build that part of the template as a dict with string keys {"0": ...}, '
            "or load without like= to see the stored structure"
        )
    if unexpected and len(paired) < len(unexpected):
        hints.append(
            f"{len(unexpected) - len(paired)} leaves of the checkpoint are not in the template: pass "
            "partial=True to load only the template's leaves"
        )
    return hints


def rooted(prefix: str) -> Callable[[str], str]:
    """The address of a template's leaf (its address ``a`` within the template) in a checkpoint
    the template describes at ``prefix``."""
    return (lambda a: f"{prefix}/{a}" if a else prefix) if prefix else (lambda a: a)


def under(address: str, prefix: str) -> bool:
    """Whether ``address`` is ``prefix`` or lies under it (every address is under "")."""
    return not prefix or address == prefix or address.startswith(prefix + "/")


def reads(like: Any, prefix: str, partial: bool, addresses: Sequence[str]) -> set[str]:
    """The addresses of ``addresses`` (a checkpoint's) a load with template ``like`` reads:
    the template's leaves, at ``prefix``, and, unless ``partial``, every leaf under ``prefix``
    (:func:`match` names those the template lacks)."""
    joined = rooted(prefix)
    wanted = {joined(a) for a, _ in leaves_with_addresses(like)[0]}
    if not partial:
        wanted.update(a for a in addresses if under(a, prefix))
    return wanted & set(addresses)


def _kept(like: Any, none_stored: bool) -> bool:
    """Whether a template leaf the checkpoint has no leaf for comes back as the template's own
    value: a callable (an equinox module's activation function, a class), which no checkpoint
    can hold; or a Python scalar where the checkpoint holds None (what
    ``eqx.filter(model, eqx.is_array)`` leaves of a dropout rate or a flag). Arrays never are."""
    if type(like) in PY_KINDS:
        return none_stored
    return callable(like)


def _none_addresses(node: dict[str, Any]) -> set[str]:
    """The addresses of the None nodes of a (validated) tree record."""
    out: set[str] = set()
    stack = [(node, "")]
    while stack:
        n, address = stack.pop()
        kind = n["type"]
        if kind == "none":
            out.add(address)
        if kind in ("leaf", "none"):
            continue
        children = n["children"]
        if kind in ("list", "tuple"):
            segments = [str(j) for j in range(len(children))]
        else:
            segments = [format_key(key_from_record(k)) for k in n["keys"]]
        stack.extend((c, join_address(address, s)) for s, c in zip(segments, children, strict=True))
    return out


_PY_TYPES = {kind: t for t, kind in PY_KINDS.items()}
_SCALAR_DTYPES = {"bool": np.bool_, "int": np.integer, "float": np.floating, "complex": np.complexfloating}


def _scalar_fits(kind: str, dtype: str | None) -> bool:
    """Whether a Python scalar of ``kind`` and a 0-d array of ``dtype`` convert into each other:
    bool and bool, int and the integer dtypes, float and the floating ones, complex and complex."""
    group = _SCALAR_DTYPES.get(kind)
    return (
        group is not None
        and dtype is not None
        and dtype in DTYPES
        and jax.dtypes.issubdtype(DTYPES[dtype], group)
    )


def _mismatch(leaf: Any, expected: Expected, entry: Stored, cast: bool) -> str | None:
    """What is wrong with filling template leaf ``leaf`` (asking for ``expected``) from
    ``entry``, or None."""
    kind, shape, dtype = expected
    fix = " (pass cast=True to convert)"
    if kind in PY_KINDS.values():
        if entry.kind == kind:
            return None
        if entry.is_array and entry.shape == () and _scalar_fits(kind, entry.dtype):
            return None if cast else f"expected Python {kind}, found {describe(entry)}{fix}"
        return f"expected Python {kind}, found {describe(entry)}"
    if kind not in ("array", PRNG_KEY) and callable(leaf):
        return f"expected {kind} (a callable, kept from the template), found {describe(entry)}"
    if kind not in ("array", PRNG_KEY):
        return (
            f"template leaf of type {kind} is not a supported leaf (use arrays, "
            "jax.ShapeDtypeStruct or Python scalars; callables are kept from the template)"
        )
    if not entry.is_array:
        if kind == "array" and shape == () and _scalar_fits(entry.kind, dtype):
            if not cast:
                return f"expected {_describe_like(leaf)}, found {describe(entry)}{fix}"
            if entry.kind == "int" and dtype is not None:
                info = np.iinfo(DTYPES[dtype])
                if not info.min <= entry.value <= info.max:
                    return f"expected {_describe_like(leaf)}, found Python int {entry.value}, outside {dtype}"
            return None
        return f"expected {_describe_like(leaf)}, found {describe(entry)}"
    if (kind == PRNG_KEY) != (entry.kind == PRNG_KEY):
        return f"expected {_describe_like(leaf)}, found {describe(entry)}"
    found = []
    if shape != entry.shape:
        found.append(f"expected shape {shape}, found {entry.shape}")
    if dtype != entry.dtype and not cast:
        found.append(f"expected dtype {dtype}, found {entry.dtype}{fix}")
    return "; ".join(found) or None


def target_sharding(slot: Slot) -> Any:
    """The sharding to assemble this leaf onto shard by shard, or None to read it whole: a
    template's sharding over several devices (or other processes' devices)."""
    sharding = getattr(slot.like, "sharding", None)
    if sharding is None or slot.entry is None or not slot.entry.is_array or slot.entry.kind == PRNG_KEY:
        return None
    if len(sharding.device_set) == 1 and sharding.is_fully_addressable:
        return None
    return sharding


Region = tuple[slice, ...]
ReadMany = Callable[[list[tuple[Stored, list[Region]]]], list[list[np.ndarray[Any, Any]]]]
_Wanted = tuple[Stored, Slot, Any, dict[tuple[tuple[int, int], ...], Region]]
BATCH_BYTES = 256 * 2**20  # shards read together, at most (a bigger leaf is read alone)


def assemble_all(wanted: Sequence[tuple[Slot, Any]], read: ReadMany) -> list[Any]:
    """A jax.Array for each (slot, sharding), its addressable shards read by ``read`` — for
    consecutive leaves together up to :data:`BATCH_BYTES` of shards, so that small leaves'
    chunks are decoded concurrently too, while the host buffers of a restore onto accelerators
    stay bounded. Each distinct region of a leaf is read once, whatever sharding it was saved
    with."""
    out: list[Any] = []
    batch: list[_Wanted] = []
    size = 0
    seen: dict[tuple[Any, tuple[int, ...]], tuple[dict[tuple[tuple[int, int], ...], Region], int]] = {}
    for slot, sharding in wanted:
        assert slot.entry is not None  # target_sharding gives no sharding to a kept leaf
        shape = tuple(slot.entry.shape or ())
        known = seen.get((sharding, shape))  # leaves sharded alike (the usual case): planned once
        if known is None:
            regions = _regions(shape, sharding)
            elements = sum(math.prod(r.stop - r.start for r in region) for region in regions.values())
            known = seen[sharding, shape] = regions, elements
        regions, elements = known
        nbytes = np.dtype(slot.like.dtype).itemsize * elements
        if batch and size + nbytes > BATCH_BYTES:
            out += _assemble(batch, read)
            batch, size = [], 0
        batch.append((slot.entry, slot, sharding, regions))
        size += nbytes
    return out + _assemble(batch, read) if batch else out


def _regions(shape: tuple[int, ...], sharding: Any) -> dict[tuple[tuple[int, int], ...], Region]:
    """The distinct regions of a leaf of ``shape`` that ``sharding`` puts on this process's
    devices."""
    out = {}
    for index in _indices(sharding, shape):
        region = _region_of(index or (), shape)
        out[_key(region)] = region
    return out


def _key(region: Region) -> tuple[tuple[int, int], ...]:
    return tuple((r.start, r.stop) for r in region)


def _raw(index: Any) -> tuple[tuple[Any, Any, Any], ...]:
    """A hashable key of a shard index as jax gives it (slices are not hashable)."""
    return tuple((s.start, s.stop, s.step) for s in index or ())


def _assemble(batch: list[_Wanted], read: ReadMany) -> list[Any]:
    found = read([(entry, list(regions.values())) for entry, _, _, regions in batch])
    out = []
    shards: dict[tuple[Any, tuple[int, ...]], dict[Any, Any]] = {}  # raw index -> region key
    for (entry, slot, sharding, regions), data in zip(batch, found, strict=True):
        dtype = np.dtype(slot.like.dtype)
        shape = tuple(entry.shape or ())
        keys = shards.get((sharding, shape))
        if keys is None:
            keys = shards[sharding, shape] = {
                _raw(i): _key(_region_of(i or (), shape)) for i in _indices(sharding, shape)
            }
        by_region = {
            k: d if d.dtype == dtype else d.astype(dtype) for k, d in zip(regions, data, strict=True)
        }
        cache = {raw: by_region[key] for raw, key in keys.items()}
        out.append(jax.make_array_from_callback(shape, sharding, functools.partial(_shard, cache, shape)))
    return out


def _shard(cache: dict[Any, np.ndarray[Any, Any]], shape: tuple[int, ...], index: Any) -> Any:
    found = cache.get(_raw(index))
    if found is None:  # an index spelled otherwise than addressable_devices_indices_map spells it
        key = _key(_region_of(index or (), shape))
        found = next(d for raw, d in cache.items() if _key(_region_of(_slices(raw), shape)) == key)
    return found


def _slices(raw: tuple[tuple[Any, Any, Any], ...]) -> tuple[slice, ...]:
    return tuple(slice(*r) for r in raw)


def _indices(sharding: Any, shape: tuple[int, ...]) -> list[tuple[slice, ...] | None]:
    """The index of each shard of ``shape`` on ``sharding`` that lives on this process."""
    return list(sharding.addressable_devices_indices_map(shape).values())


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
    if entry is None:
        return like
    kind, _, dtype = slot.expected or _expected(like)
    if kind in PY_KINDS.values():  # a Python scalar, from one or from a 0-d array (cast=True)
        return entry.value if not entry.is_array else _PY_TYPES[kind](data[()])
    if not entry.is_array:  # a Python scalar into a 0-d array (cast=True)
        data, entry = np.asarray(entry.value, np.dtype(like.dtype)), None
    elif kind == "array" and dtype is not None and dtype != entry.dtype:
        data = data.astype(np.dtype(like.dtype))
    if entry is not None and entry.kind == PRNG_KEY:
        return restore_array(PRNG_KEY, data, entry.prng_impl)
    if isinstance(like, np.generic):
        return restore_array(NPSCALAR, data, None)
    if isinstance(like, np.ndarray):
        return restore_array(NUMPY, data, None)
    weak = bool(getattr(like, "weak_type", entry is not None and entry.weak_type))
    array = restore_array(JAX, data, None, as_jax=True, weak_type=weak)
    sharding = getattr(like, "sharding", None)
    return array if sharding is None else jax.device_put(array, sharding)
