"""The training loop's room: the checkpoint manager (``checkpoint_manager``), its option objects
(``options``), the async save in flight (``save_queue``), retention, the two tiers and
replication, and the preemption handler. It uses the public surface (``Store``, copy, health)
and nothing of interop or inspection (pyproject.toml's contracts)."""
