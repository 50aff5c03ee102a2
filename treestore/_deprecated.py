"""Names that 0.2 used and this version renamed to the SPEC's word: each still works, with a
DeprecationWarning naming its replacement, until a later release drops it."""

from __future__ import annotations

import warnings
from typing import Any


def warn_renamed(old: str, new: str) -> None:
    """Warn the caller's caller that ``old`` is now ``new``."""
    warnings.warn(f"{old} is deprecated: use {new}, the same thing", DeprecationWarning, stacklevel=3)


def renamed_attribute(owner: str, old: str, new: str) -> Any:
    """A read-only property ``old`` of class ``owner`` that warns and returns attribute ``new``."""

    def get(self: object) -> Any:
        warn_renamed(f"{owner}.{old}", f"{owner}.{new}")
        return getattr(self, new)

    return property(get, doc=f"Deprecated: :attr:`{new}`.")
