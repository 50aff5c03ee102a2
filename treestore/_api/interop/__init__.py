"""Other formats' room: importing and exporting safetensors (and Hugging Face shard sets), npz,
flax msgpack and orbax, from local files and URLs. It uses the public surface and nothing of the
manager or inspection (pyproject.toml's contracts)."""
