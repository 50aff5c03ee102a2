"""What every subcommand shares: global settings, JSON output, progress bars, checkpoint specs."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from treestore.types import Progress


@dataclass
class Settings:
    """The global options, filled in by the ``treestore`` group before a subcommand runs."""

    quiet: bool = False
    debug: bool = False
    storage_options: dict[str, Any] = field(default_factory=dict)


def settings() -> Settings:
    """The settings of the command running now (defaults outside a command)."""
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_object(Settings) if ctx is not None else None
    return obj if obj is not None else Settings()


def parse_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value); the value is read as JSON when it is JSON (true, 3, null,
    {"a": 1}), else kept as text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def plain(value: Any) -> Any:
    """``value`` as JSON-safe data: non-finite floats and bytes become text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def echo_json(value: Any) -> None:
    click.echo(json.dumps(plain(value), indent=2, allow_nan=False))


def note(message: str) -> None:
    """An informational line on stderr, left out with --quiet."""
    if not settings().quiet:
        click.echo(message, err=True)


@contextlib.contextmanager
def progress(label: str) -> Iterator[Progress | None]:
    """A byte-counting progress bar on stderr when it is a terminal and --quiet was not given;
    yields the ``progress(done, total)`` callback the library calls, or None."""
    if settings().quiet or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(
        total=0, desc=label, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr
    )
    lock = threading.Lock()

    def update(done: int, total: int) -> None:
        with lock:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

    try:
        yield update
    finally:
        bar.close()
