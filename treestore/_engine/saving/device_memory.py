"""What device memory a save may take: the room a device has beside the training step.

A training step's temporaries come and go: between two steps, when a save starts, a device shows
far less in use than it will hold at the step's peak. So the room a save may take on a device is
measured against the most it has ever held, not against what it holds now:
``bytes_limit - peak_bytes_in_use - peak_bytes_reserved`` (:func:`room`). A TPU reserves a
program's temporaries apart from its buffers when it loads the program, so the step's
temporaries show in the reserved bytes alone (a step sorting 8.9 GiB of temporaries on a v5e left
its peak in use at the tree's 4.2 GiB). The peak counts a save's own earlier device copies too, so
the rule errs towards taking nothing. A device that reports no memory statistics (a CPU) has no
bound here.

Beyond the tree itself, a save takes device memory for two things only, each only when it fits
in that room (the training guide says the same):

- the slices of big leaves in flight to the host: at most ``SaveOptions.window`` bytes in all,
  and none where a device has less room than that (the leaves are then fetched whole, straight
  to host memory, without a program);
- an async save's device snapshot: a copy of the leaves it keeps on the device, only where the
  copy and the window of slices fit in the room together.

An async save's host snapshot cuts its big leaves in slices too, within the same window and
rule (:mod:`treestore._engine.saving.staging`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def stats(device: Any) -> dict[str, Any] | None:
    """The device's memory statistics, or None where it gives none (the one place they are read)."""
    try:
        return device.memory_stats()
    except Exception:  # a backend without memory statistics
        return None


def room(device: Any) -> int | None:
    """Bytes the device has never been seen to use: its limit less its peak of buffers and its
    peak of programs' reserved temporaries (or those in use now, where more); None where the
    device does not tell."""
    memory = stats(device)
    if not memory or "bytes_limit" not in memory:
        return None
    used = max(int(memory.get("peak_bytes_in_use", 0)), int(memory.get("bytes_in_use", 0)))
    reserved = max(int(memory.get("peak_bytes_reserved", 0)), int(memory.get("bytes_reserved", 0)))
    return int(memory["bytes_limit"]) - used - reserved


def fits(need: dict[Any, int], extra: int = 0) -> bool:
    """Whether ``need[device]`` bytes, and ``extra`` more, fit in the :func:`room` of each device."""
    for device, nbytes in need.items():
        free = room(device)
        if free is not None and nbytes + extra > free:
            return False
    return True


def per_device(arrays: Iterable[Any]) -> dict[Any, int]:
    """The bytes of ``arrays`` (jax arrays) on each device that holds a shard of them."""
    need: dict[Any, int] = {}
    for x in arrays:
        for shard in x.addressable_shards:
            need[shard.device] = need.get(shard.device, 0) + int(shard.data.nbytes)
    return need


__all__ = ["fits", "per_device", "room", "stats"]
