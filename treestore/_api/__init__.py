"""Layer 4, the public surface: Store, load/save/open, checkpoint views, diff, verify, copy,
the checkpoint manager and file import/export, built on the engine. ``treestore/__init__.py``
re-exports what users call."""
