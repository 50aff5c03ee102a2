"""treestore: chunked, compressed, content-addressed checkpoints for JAX pytrees.

The whole public API is what this module exports, plus two namespaces: :mod:`treestore.errors`
(every error class) and :mod:`treestore.types` (the records and results functions return).

>>> import numpy as np, treestore
>>> _ = treestore.save("memory://doc/init", {"params": {"w": np.eye(2)}}, "step-1")
>>> treestore.load("memory://doc/init#step-1")["params"]["w"]
array([[1., 0.],
       [0., 1.]])
"""

from treestore import errors, types
from treestore._api.checkpoint import Checkpoint, LazyLeaf
from treestore._api.copy import copy
from treestore._api.interop import export_file, import_file
from treestore._api.manager import CheckpointManager
from treestore._api.store import Store, diff, load, open, save
from treestore._api.verify import verify
from treestore._api.watch import watch
from treestore._engine.write import SaveOptions
from treestore._format.address import format_address
from treestore._format.codecs import Codec
from treestore._format.encoding import FORMAT_VERSION
from treestore._tree.keys import parse_address
from treestore.errors import (
    CorruptionError,
    InvalidInputError,
    NotFoundError,
    StorageError,
    StructureMismatchError,
    TreestoreError,
    UnsupportedFormatError,
)

__version__ = "0.2.0"

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointManager",
    "Codec",
    "CorruptionError",
    "InvalidInputError",
    "LazyLeaf",
    "NotFoundError",
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

for _obj in (
    Checkpoint,
    LazyLeaf,
    CheckpointManager,
    Store,
    SaveOptions,
    Codec,
    copy,
    diff,
    export_file,
    format_address,
    import_file,
    load,
    open,
    parse_address,
    save,
    verify,
    watch,
):
    _obj.__module__ = __name__  # reprs, tracebacks and help() show treestore.X
del _obj
