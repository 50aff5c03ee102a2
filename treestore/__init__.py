"""treestore: chunked, compressed, content-addressed checkpoints for JAX pytrees.

>>> import numpy as np, treestore
>>> _ = treestore.save("memory://doc/init", {"params": {"w": np.eye(2)}}, "step-1")
>>> treestore.load("memory://doc/init")["params"]["w"]
array([[1., 0.],
       [0., 1.]])
"""

from treestore._api.checkpoint import Checkpoint, LazyLeaf
from treestore._api.copy import CopyReport, copy
from treestore._api.diff import Diff, LeafDiff, LeafStats
from treestore._api.interop import ExportResult, export_file, import_file
from treestore._api.manager import CheckpointManager, StepInfo
from treestore._api.store import CheckpointInfo, Store, diff, load, open, save
from treestore._api.verify import VerifyProblem, VerifyReport, verify
from treestore._engine.gc import GcReport
from treestore._engine.write import SaveOptions, SaveResult
from treestore._format.address import format_address, parse_address
from treestore._format.codecs import Codec
from treestore._format.encoding import FORMAT_VERSION
from treestore._format.manifest import ChunkRef, LeafEntry, Manifest
from treestore.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChunkCorruptError,
    ChunkMissingError,
    CorruptionError,
    InvalidInputError,
    ManifestCorruptError,
    NoMatchError,
    NotFoundError,
    OutOfBoundsError,
    OutOfMemoryError,
    StorageError,
    StoreBusyError,
    StructureMismatchError,
    TreestoreError,
    UnsupportedFormatError,
    UnsupportedKeyError,
    UnsupportedLeafError,
)

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ChunkCorruptError",
    "ChunkMissingError",
    "ChunkRef",
    "Codec",
    "CopyReport",
    "CorruptionError",
    "Diff",
    "ExportResult",
    "GcReport",
    "InvalidInputError",
    "LazyLeaf",
    "LeafDiff",
    "LeafEntry",
    "LeafStats",
    "Manifest",
    "ManifestCorruptError",
    "NoMatchError",
    "NotFoundError",
    "OutOfBoundsError",
    "OutOfMemoryError",
    "SaveOptions",
    "SaveResult",
    "StepInfo",
    "StorageError",
    "Store",
    "StoreBusyError",
    "StructureMismatchError",
    "TreestoreError",
    "UnsupportedFormatError",
    "UnsupportedKeyError",
    "UnsupportedLeafError",
    "VerifyProblem",
    "VerifyReport",
    "copy",
    "diff",
    "export_file",
    "format_address",
    "import_file",
    "load",
    "open",
    "parse_address",
    "save",
    "verify",
]
