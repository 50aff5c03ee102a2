"""Layer 3, engine: the one write path (``write``: prepare, chunk writer; ``commit``: the one
commit), the one verified read path (``read``: commit record → manifest → chunks; ``region``:
boxes of leaves), locks and gc, multi-process coordination and background snapshots. Imports the
format, tree and storage layers."""
