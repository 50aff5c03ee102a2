"""jax, imported on first use: the one place treestore imports it (``tests/package/test_layering.py``
keeps it so; apart from here, only ``_tree/leaves.py`` imports jax's private ``lax``, inside the
function that makes weak types, which runs on jax arrays only).

Reading manifests (listing, showing, diffing, verifying and copying checkpoints, collecting
garbage) never needs jax, and importing jax takes most of a short command's time. Every module
that uses jax does so only inside functions, and takes it from here::

    from treestore._tree.jax_import import jax

``jax`` stands in for the module: the first attribute looked up on it imports jax, and every
attribute is jax's own. Type checkers see the module itself.
"""

from __future__ import annotations

import functools
import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any


def imported() -> bool:
    """Whether this process has imported jax (whoever did): a process that has not cannot be one
    of a ``jax.distributed`` job, nor hold a jax array."""
    return "jax" in sys.modules


@functools.cache
def _module() -> ModuleType:
    return importlib.import_module("jax")


class _Deferred:
    """Stands in for the jax module until, and after, it is imported."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        return getattr(_module(), name)

    def __repr__(self) -> str:
        return "<jax, imported on first use>"


if TYPE_CHECKING:
    import jax as jax
else:
    jax = _Deferred()
