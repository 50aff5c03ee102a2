"""Names that 0.2 used and this version renamed to the SPEC's word, and attributes that exposed
internal objects: each still works, with a DeprecationWarning naming its replacement, until a later
release drops it."""

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


def internal_attribute(owner: str, old: str, private: str, instead: str) -> Any:
    """A read-only property ``old`` of class ``owner`` that returns attribute ``private``, an
    internal object, warning that it is deprecated and that ``instead`` gives what users need."""

    def get(self: object) -> Any:
        warnings.warn(
            f"{owner}.{old} is deprecated: it returns an internal object, which may change without "
            f"notice; use {instead}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self, private)

    return property(get, doc=f"Deprecated (an internal object): use {instead}.")
