"""The async checkpoint managers the device benchmarks set side by side: treestore's
``CheckpointManager`` and orbax's, each keeping two steps, behind one interface that times how
long ``save`` blocks the training loop."""

from __future__ import annotations

import time
from typing import Any


class AsyncManager:
    """treestore's or orbax's async checkpoint manager (``method``), keeping two steps."""

    def __init__(self, method: str, root: str, keep_host_copies: bool = True) -> None:
        self.method = method
        if method == "treestore":
            import treestore

            options = treestore.SaveOptions(keep_host_copies=keep_host_copies)
            self.m: Any = treestore.CheckpointManager(
                root, retention=treestore.Retention(keep_last=2), options=options
            )
        else:
            import orbax.checkpoint as ocp

            options = ocp.CheckpointManagerOptions(enable_async_checkpointing=True, max_to_keep=2)
            self.m = ocp.CheckpointManager(root, options=options)

    def save(self, step: int, tree: Any) -> float:
        """Seconds ``save`` blocked."""
        t = time.perf_counter()
        if self.method == "treestore":
            self.m.save(step, tree, force=True)
        else:
            import orbax.checkpoint as ocp

            self.m.save(step, args=ocp.args.StandardSave(tree))
        return time.perf_counter() - t

    def wait(self) -> None:
        self.m.wait() if self.method == "treestore" else self.m.wait_until_finished()

    def close(self) -> None:
        self.m.close()
