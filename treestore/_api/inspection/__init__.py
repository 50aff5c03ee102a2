"""Reading a run's room: exact diffs and diffs of values, norms, timelines and their heatmaps,
and watching a store for new checkpoints. It uses checkpoints, lazy leaves and the reading of a
checkpoint argument; the surface (``Store``, ``diff``) calls it (pyproject.toml's contracts)."""
