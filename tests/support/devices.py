"""Accelerator conditions on a CPU: the device path forced on (:data:`ALWAYS`), a device that
reports the memory statistics of a busy chip (:func:`device_reports`), and jax's errors raised
where a device would raise them (:func:`raising`)."""

from __future__ import annotations

from typing import Any

import jax
import pytest

from treestore._engine.saving import device_memory

MiB = 1 << 20
ALWAYS: dict[str, Any] = dict(device_path="always", chunk_size=1 << 20, host_window=4 << 20)  # 2 MiB slices
OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 268435456 bytes."


def device_reports(
    monkeypatch: pytest.MonkeyPatch, *, limit: int, in_use: int, peak: int, reserved: int = 0
) -> None:
    """Every device reports these memory statistics (a CPU reports none). ``reserved``: the peak
    of the bytes a TPU reserves for programs' temporaries, apart from its buffers."""
    stats = {
        "bytes_limit": limit,
        "bytes_in_use": in_use,
        "peak_bytes_in_use": peak,
        "bytes_reserved": reserved,
        "peak_bytes_reserved": reserved,
    }
    monkeypatch.setattr(device_memory, "stats", lambda device: dict(stats))


def counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """The calls of ``module.name`` from now on, one entry each."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def raising(message: str = OOM) -> Any:
    """A function that fails as jax does (RESOURCE_EXHAUSTED, by default)."""

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise jax.errors.JaxRuntimeError(message)

    return fail
