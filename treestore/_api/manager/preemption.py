"""Preemption: a SIGTERM handler that notes the signal for a checkpoint manager, chaining the
handler it replaced and putting it back when the manager closes."""

from __future__ import annotations

import signal
import threading
from typing import Any

from treestore.errors import InvalidInputError


class Preemption:
    """With ``enabled``, a SIGTERM handler for the main thread, installed by :meth:`install`:
    :attr:`arrived` turns True when SIGTERM comes, and any previous Python handler is called
    after it. :meth:`uninstall` puts that handler back if this one is still installed.

    Raises:
        InvalidInputError: ``enabled`` off the main thread (Python installs signal handlers
            only there).
    """

    def __init__(self, enabled: bool) -> None:
        if enabled and threading.current_thread() is not threading.main_thread():
            raise InvalidInputError(
                "preemption=True installs a SIGTERM handler: make the manager in the main thread"
            )
        self.enabled = bool(enabled)
        self.arrived = False
        self._previous: Any = None

    def install(self) -> None:
        """Install the handler (when enabled), keeping the one it replaces."""
        if self.enabled:
            self._previous = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.arrived = True
        if callable(self._previous):
            self._previous(signum, frame)

    def installed(self) -> bool:
        """Whether this handler is SIGTERM's handler now."""
        return self.enabled and signal.getsignal(signal.SIGTERM) == self._on_sigterm

    def uninstall(self) -> None:
        """Put back the handler this one replaced, if this one is still installed (from the main
        thread; elsewhere nothing changes)."""
        if threading.current_thread() is threading.main_thread() and self.installed():
            signal.signal(signal.SIGTERM, self._previous)
