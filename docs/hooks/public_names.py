"""mkdocs hook: the reference pages name objects by their public names. Signatures are rendered
from annotations as written in the source (``-> _write.SaveResult``) and cross-reference titles
carry the defining module (``treestore._engine.write.SaveResult``); both become the name users
import (``SaveResult``, ``treestore.types.SaveResult``), so no private module path is shown."""

from __future__ import annotations

import re
from typing import Any

import treestore
from treestore import errors, types

# A private module qualifier in a highlighted signature: <span class="n">_write</span><span class="o">.</span>
_QUALIFIER = re.compile(r'<span class="n">_[a-z_]+</span><span class="o">\.</span>')
_PRIVATE_PATH = re.compile(r"\btreestore(?:\.[a-z_]+)*\._[a-z_]+(?:\.[a-z_]+)*\.([A-Za-z_]\w*)")


def public_name(name: str) -> str:
    """Where users import ``name`` from."""
    if name in treestore.__all__:
        return f"treestore.{name}"
    if hasattr(types, name):
        return f"treestore.types.{name}"
    if hasattr(errors, name):
        return f"treestore.errors.{name}"
    return name


def on_page_content(html: str, **_: Any) -> str:
    html = _QUALIFIER.sub("", html)
    return _PRIVATE_PATH.sub(lambda m: public_name(m.group(1)), html)
