"""Rules of the layering that import contracts cannot state: the public layer asks a manifest's
columns what its leaves are (``Columns.is_array``, ``kind``, ``of_kind``, ``dtype_name``, ``by_dtype``,
``same_types``) instead of decoding the leaf table's codes and bit fields itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import treestore._format.manifest.columns as columns_module

ROOT = Path(__file__).resolve().parent.parent.parent
CLI = ROOT / "cli" / "treestore_cli"  # the command line's package
CODES = {"ARRAY_CODES", "DTYPE_NAMES", "KINDS", "PRNG_NAMES", "PRNG_SHIFT", "WEAK_TYPE", "IN_PIECES"}
CODES |= {"FLAG_BITS"}
FIELDS = {"kind", "dtype", "flags"}  # of the leaf table; the stats table has a "kind" too


def _modules() -> list[Path]:
    return sorted([*(ROOT / "treestore" / "_api").glob("*.py"), *CLI.glob("*.py")])


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


def _calls_and_imports(path: Path, names: set[str]) -> list[str]:
    """Where ``path`` imports or calls one of ``names``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            found += [f"{path}:{node.lineno}" for a in node.names if a.name in names]
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in names:
                found.append(f"{path}:{node.lineno}")
    return found


def test_commit_records_are_encoded_by_the_one_commit_only():
    """Only ``_engine/commit.py`` encodes a commit record (the step that makes a checkpoint
    visible, after its chunks and manifest): no other module can publish a checkpoint."""
    allowed = {ROOT / "treestore/_engine/commit.py", ROOT / "treestore/_format/commit_record.py"}
    found = []
    for path in sorted((ROOT / "treestore").rglob("*.py")):
        if path not in allowed:
            found += _calls_and_imports(path, {"encode_commit_record"})
    assert not found, found


def test_checkpoints_are_committed_through_the_one_door_only():
    """Only the engine's one door for writes (``_engine/saving/writing.py``) imports the commit
    step: every save, derive, copy, import and multi-process save commits through it."""
    allowed = {ROOT / "treestore/_engine/saving/writing.py"}
    found = []
    for path in sorted((ROOT / "treestore").rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                names = {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
                if "treestore._engine.commit" in names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(
                a.name == "treestore._engine.commit" for a in node.names
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_jax_is_imported_at_import_time_by_no_module():
    """No module imports jax when it is imported itself (``import treestore`` stays cheap);
    jax comes through ``_tree/jax_import``, on first use, or inside functions that run after."""
    found = []
    for path in sorted((ROOT / "treestore").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only; TYPE_CHECKING blocks never run
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "jax" for a in node.names):
                found.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jax":
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found


def _package_modules() -> list[Path]:
    return sorted([*(ROOT / "treestore").rglob("*.py"), *CLI.glob("*.py")])


def _runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree`` outside ``if TYPE_CHECKING:`` blocks."""
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for child in node.body
        for n in ast.walk(child)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_jax_is_imported_in_jax_import_only():
    """``_tree/jax_import`` is where treestore imports jax; the only other import of it is of
    jax's private ``lax`` (``_tree/leaves.py``, inside the function that makes weak types)."""
    allowed = {("_tree/jax_import.py", "jax"), ("_tree/leaves.py", "jax._src.lax")}
    found = []
    for path in sorted((ROOT / "treestore").rglob("*.py")):
        name = path.relative_to(ROOT / "treestore").as_posix()
        for line, module in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if module.split(".")[0] == "jax" and (name, module) not in allowed:
                found.append(f"{name}:{line}: {module}")
    assert not found, found


def test_storage_imports_only_the_error_classes_and_the_path_grammar_of_treestore():
    """``_storage`` imports its own modules, ``treestore.errors`` and the store's path grammar
    (``_format.paths``: the names of temporary files), nothing else of treestore (the layering
    contract would let it import all of ``_format``)."""
    found = []
    for path in sorted((ROOT / "treestore" / "_storage").glob("*.py")):
        for line, module in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            own = module.startswith(("treestore._storage", "treestore.errors", "treestore._format.paths"))
            if module.startswith("treestore") and not own:
                found.append(f"{path.name}:{line}: {module}")
    assert not found, found


def test_kernels_import_only_the_error_classes_of_treestore():
    """``_kernels`` imports its own modules and ``treestore.errors``, nothing else of treestore
    (the layering contract forbids the layers above it, not ``treestore.types`` or the package's
    own ``__init__``)."""
    found = []
    for path in sorted((ROOT / "treestore" / "_kernels").glob("*.py")):
        for line, module in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            own = module.startswith(("treestore._kernels", "treestore.errors"))
            if module.startswith("treestore") and not own:
                found.append(f"{path.name}:{line}: {module}")
    assert not found, found


def test_columns_are_made_by_validate_only():
    """Only ``_format/manifest/check.py`` (its ``validate``) constructs ``Columns``: every manifest
    in memory, whatever its version and whoever made it, passed the readers' checks (others
    derive one from such columns with ``dataclasses.replace``)."""
    found = []
    for path in _package_modules():
        if path == ROOT / "treestore/_format/manifest/check.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name == "Columns":
                    found.append(f"{path}:{node.lineno}")
    assert not found, found


def test_patterns_are_matched_by_select_only():
    """``_format/select.py`` is the one pattern dialect: no other module matches addresses with
    ``fnmatch`` of its own (``glob.escape``, which makes an address a literal pattern, is fine)."""
    found = []
    for path in _package_modules():
        if path == ROOT / "treestore/_format/select.py":
            continue
        for line, module in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"))):
            if module == "fnmatch":
                found.append(f"{path}:{line}: {module}")
    assert not found, found


def test_checkpoint_arguments_are_read_by_spec_only():
    """``_api/spec.py`` is the one reading of ``URL#NAME``: no other module splits text at ``#``."""
    found = []
    for path in _package_modules():
        if path == ROOT / "treestore/_api/spec.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"partition", "rpartition", "split", "rsplit", "index", "find"}
                and any(isinstance(a, ast.Constant) and a.value == "#" for a in node.args)
            ):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_every_package_of_the_library_is_in_the_distribution():
    """pyproject.toml lists the packages a wheel holds by name: a sub-package missing from that
    list imports from a checkout and is absent from every install."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    found = set()
    for top, name in ((ROOT / "treestore", "treestore"), (CLI, "treestore_cli")):
        for init in top.rglob("__init__.py"):
            found.add(".".join((name, *init.parent.relative_to(top).parts)))
    assert set(listed["packages"]) == found


def test_progress_callbacks_have_one_type():
    """``Progress`` (``progress(done, total)``) is defined in ``_engine/progress.py`` alone: every
    long operation (copy, verify, diff, timeline, import, export) takes that one type."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in _package_modules()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "Progress" for t in node.targets)
    ]
    assert found == ["treestore/_engine/progress.py:8"], found
