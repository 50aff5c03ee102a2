"""Layer 3, engine: the write path (``write``, ``chunk_writer``, ``packs``; ``commit``, the one
step that publishes a checkpoint), the verified read path (``committed``: commit record →
manifest; ``read``: chunks; ``load``, ``region``: leaves and boxes of them), locks and gc,
multi-process saves, and saves and loads of arrays on accelerators. Imports the format, tree and
storage layers; trees are made ready to write in the tree layer (``treestore._tree.prepare``)."""
