"""mkdocs hook: docstrings name other objects with Sphinx roles (``:class:`~treestore.Store```),
which mkdocstrings renders as the role's name before the code; show the object's name alone, as
code, the way the reference pages name everything else."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc|obj):<code>(~?)([^<]*)</code>")


def _name(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if tilde else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub(_name, html)
