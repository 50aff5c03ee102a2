"""Rules of the layering that import contracts cannot state: the public layer asks a manifest's
columns what its leaves are (``Columns.is_array``, ``kind``, ``dtype_name``, ``by_dtype``,
``same_types``) instead of decoding the leaf table's codes and bit fields itself."""

from __future__ import annotations

import ast
from pathlib import Path

import treestore._format.columns as columns_module

ROOT = Path(__file__).resolve().parent.parent
CODES = {"ARRAY_CODES", "DTYPE_NAMES", "KINDS", "PRNG_NAMES", "PRNG_SHIFT", "WEAK_TYPE", "IN_PIECES"}
CODES |= {"FLAG_BITS"}
FIELDS = {"kind", "dtype", "flags"}  # of the leaf table; the stats table has a "kind" too


def _modules() -> list[Path]:
    return sorted([*(ROOT / "treestore" / "_api").glob("*.py"), *(ROOT / "cli").glob("*.py")])


def test_the_codes_named_here_are_the_leaf_tables():
    assert all(hasattr(columns_module, name) for name in CODES)
    assert set(columns_module.LEAF_DTYPE.names) >= FIELDS


def test_the_public_layer_does_not_decode_leaf_table_codes():
    """No module of ``_api`` or ``cli`` imports a code table or bit field of the leaf table, or
    reads a field of it by name (``columns.leaves["kind"]``)."""
    found = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("treestore._format"):
                found += [f"{path.name}: imports {a.name}" for a in node.names if a.name in CODES]
            elif isinstance(node, ast.Attribute) and node.attr in CODES:
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
            elif (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Subscript | ast.Attribute)
                and "leaves" in ast.unparse(node.value)
                and isinstance(node.slice, ast.Constant)
                and node.slice.value in FIELDS
            ):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found
