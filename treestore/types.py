"""The records and results treestore's functions return: what a save, copy, gc, verify, diff or
listing reports, the manifest a checkpoint's view exposes (``Checkpoint.manifest``), the
options of a checkpoint manager (``Retention``, ``RemoteTier``, also in ``treestore``), and the
type of the progress callbacks long operations take (``Progress``: ``progress(done, total)`` in
raw bytes).

>>> import numpy as np, treestore
>>> r = treestore.save("memory://doc/types", {"w": np.zeros(3)}, "a")
>>> isinstance(r, treestore.types.SaveResult), type(r).__module__
(True, 'treestore.types')
"""

from treestore._api.copy import CopyReport
from treestore._api.health import ValueStats
from treestore._api.inspection.diff import Diff, LeafDiff
from treestore._api.inspection.diff_values import ValueChange
from treestore._api.inspection.norms import Norms
from treestore._api.inspection.timeline import Timeline
from treestore._api.interop.exporting import ExportResult
from treestore._api.listing import CheckpointInfo
from treestore._api.manager.options import RemoteTier, Retention
from treestore._api.manager.retention import StepInfo
from treestore._api.verify import VerifyProblem, VerifyReport
from treestore._engine.gc import GcReport
from treestore._engine.progress import Progress
from treestore._engine.write import SaveResult
from treestore._format.manifest.record_views import Manifest
from treestore._format.manifest.records import ChunkRef, LeafEntry, Piece

__all__ = [
    "CheckpointInfo",
    "ChunkRef",
    "CopyReport",
    "Diff",
    "ExportResult",
    "GcReport",
    "LeafDiff",
    "LeafEntry",
    "Manifest",
    "Norms",
    "Piece",
    "Progress",
    "RemoteTier",
    "Retention",
    "SaveResult",
    "StepInfo",
    "Timeline",
    "ValueChange",
    "ValueStats",
    "VerifyProblem",
    "VerifyReport",
]

for _cls in (
    CheckpointInfo,
    ChunkRef,
    CopyReport,
    Diff,
    ExportResult,
    GcReport,
    LeafDiff,
    LeafEntry,
    Manifest,
    Piece,
    SaveResult,
    StepInfo,
    Norms,
    Timeline,
    ValueChange,
    ValueStats,
    VerifyProblem,
    VerifyReport,
):
    _cls.__module__ = __name__
del _cls
# The manager's options, also treestore.Retention and treestore.RemoteTier (their name there).
Retention.__module__ = RemoteTier.__module__ = "treestore"


def __getattr__(name: str) -> type:
    if name == "LeafStats":  # 0.2's name of ValueChange
        from treestore._deprecated import warn_renamed

        warn_renamed("treestore.types.LeafStats", "treestore.types.ValueChange")
        return ValueChange
    raise AttributeError(f"module 'treestore.types' has no attribute {name!r}")
