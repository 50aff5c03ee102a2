"""The manifest: the rules every version shares (``rules``), the in-memory model (``columns``) and
its tree of nodes (``tree``, ``node_order``, ``node_edit``), the one validation (``check``), the
codec of both versions (``codec``, ``v1``), the builder of leaf tables (``leaf_table``), leaves
taken from several manifests (``take``), the frame of a manifest in parts, and the records the
public types are read from (``records``, ``record_views``)."""
