"""treestore: chunked, compressed, content-addressed checkpoints for JAX pytrees.

>>> import numpy as np, treestore
>>> _ = treestore.save("memory://doc/init", {"params": {"w": np.eye(2)}}, "step-1")
>>> treestore.load("memory://doc/init")["params"]["w"]
array([[1., 0.],
       [0., 1.]])
"""

from ._address import format_address, parse_address
from ._codecs import Codec
from ._diff import Diff, LeafDiff, LeafStats
from ._errors import (
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
from ._gc import GcReport
from ._interop import ExportResult, export_file, import_file
from ._lazy import Checkpoint, LazyLeaf
from ._manager import CheckpointManager, StepInfo
from ._manifest import ChunkRef, LeafEntry, Manifest
from ._save import SaveOptions, SaveResult
from ._schema import FORMAT_VERSION
from ._store import CheckpointInfo, Store, diff, load, open, save
from ._transfer import CopyReport, copy
from ._verify import VerifyProblem, VerifyReport, verify

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
