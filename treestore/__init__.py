"""treestore: chunked, compressed, content-addressed checkpoints for JAX pytrees.

The whole public API is what this module exports, plus two namespaces: :mod:`treestore.errors`
(every error class) and :mod:`treestore.types` (the records and results functions return).

>>> import numpy as np, treestore
>>> _ = treestore.save("memory://doc/init", {"params": {"w": np.eye(2)}}, "step-1")
>>> treestore.load("memory://doc/init#step-1")["params"]["w"]
array([[1., 0.],
       [0., 1.]])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from treestore import errors
from treestore.errors import (
    DamagedError,
    InvalidInputError,
    NotFoundError,
    StorageError,
    StructureMismatchError,
    TreestoreError,
    UnsupportedFormatError,
)

if TYPE_CHECKING:
    from treestore import types
    from treestore._api.checkpoint import Checkpoint
    from treestore._api.copy import copy
    from treestore._api.functions import diff, load, open, save
    from treestore._api.inspection.watch import watch
    from treestore._api.interop.exporting import export_file
    from treestore._api.interop.importing import import_file
    from treestore._api.lazy_leaf import LazyLeaf
    from treestore._api.manager.checkpoint_manager import CheckpointManager
    from treestore._api.manager.options import RemoteTier, Retention
    from treestore._api.store import Store
    from treestore._api.verify import verify
    from treestore._engine.write import SaveOptions
    from treestore._format.address import format_address
    from treestore._format.codecs import Codec
    from treestore._format.encoding import FORMAT_VERSION
    from treestore._tree.keys import parse_address

__version__ = "0.2.0"

# Where each name of the API lives. They are imported on first use (PEP 562), so that
# ``import treestore`` costs what the errors cost, and a command that reads manifests loads
# only the modules it calls, never numpy's heavier neighbours it has no use for.
_LAZY = {
    "Checkpoint": "treestore._api.checkpoint",
    "LazyLeaf": "treestore._api.lazy_leaf",
    "copy": "treestore._api.copy",
    "export_file": "treestore._api.interop.exporting",
    "import_file": "treestore._api.interop.importing",
    "CheckpointManager": "treestore._api.manager.checkpoint_manager",
    "Retention": "treestore._api.manager.options",
    "RemoteTier": "treestore._api.manager.options",
    "Store": "treestore._api.store",
    "diff": "treestore._api.functions",
    "load": "treestore._api.functions",
    "open": "treestore._api.functions",
    "save": "treestore._api.functions",
    "verify": "treestore._api.verify",
    "watch": "treestore._api.inspection.watch",
    "SaveOptions": "treestore._engine.write",
    "format_address": "treestore._format.address",
    "Codec": "treestore._format.codecs",
    "FORMAT_VERSION": "treestore._format.encoding",
    "parse_address": "treestore._tree.keys",
}

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointManager",
    "Codec",
    "DamagedError",
    "InvalidInputError",
    "LazyLeaf",
    "NotFoundError",
    "RemoteTier",
    "Retention",
    "SaveOptions",
    "StorageError",
    "Store",
    "StructureMismatchError",
    "TreestoreError",
    "UnsupportedFormatError",
    "copy",
    "diff",
    "errors",
    "export_file",
    "format_address",
    "import_file",
    "load",
    "open",
    "parse_address",
    "save",
    "types",
    "verify",
    "watch",
]


def __getattr__(name: str) -> Any:
    if name == "types":
        return importlib.import_module("treestore.types")
    if name == "CorruptionError":  # 0.2's name, deprecated (the warning says so)
        from treestore._deprecated import warn_renamed

        warn_renamed("treestore.CorruptionError", "treestore.DamagedError")
        return errors.DamagedError
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'treestore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if hasattr(value, "__module__") and not isinstance(value, int):
        value.__module__ = __name__  # reprs, tracebacks and help() show treestore.X
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
