"""Layer 2, tree: pytrees ↔ what the format records — flattening a tree into addresses and
leaves, classifying and restoring leaves, rebuilding trees, and matching a ``like=`` template.
Imports only the format layer."""
