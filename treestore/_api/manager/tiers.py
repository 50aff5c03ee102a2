"""The steps of a checkpoint manager's two tiers as one: which steps either tier holds, the store
to load each from (the local one when both have it), the newest healthy one, and a load that falls
back to the remote copy of a step damaged locally."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from treestore._api.manager.retention import HealthCheck, StepInfo, check_step, newest_by_health, step_infos
from treestore._api.store import Store
from treestore._format.paths import step_name
from treestore.errors import CheckpointNotFoundError, DamagedError, TreestoreError

_log = logging.getLogger("treestore")


@dataclass(frozen=True)
class Tiers:
    """A local store and, optionally, the remote store its steps are replicated to; ``healthy``
    is the manager's own test of a step's statistics and metadata, beside NaN/inf."""

    local: Store
    remote: Store | None = None
    healthy: HealthCheck | None = None

    def steps(self) -> dict[int, tuple[StepInfo, Store]]:
        """Each step committed in either tier, with the store to load it from (the local one
        when both have it). A remote that cannot be listed is logged and left out."""
        out = {step: (info, self.local) for step, info in step_infos(self.local).items()}
        if self.remote is not None:
            try:
                remote = step_infos(self.remote)
            except TreestoreError as exc:
                _log.warning(
                    "%s: listing the remote tier failed (%s: %s); using the local tier only",
                    self.remote.url,
                    type(exc).__name__,
                    exc,
                )
                remote = {}
            for step, info in remote.items():
                out.setdefault(step, (info, self.remote))
        return out

    def latest(self, *, healthy: bool = False) -> int | None:
        """The newest step of either tier; with ``healthy``, the newest known to be healthy: its
        statistics show no NaN/inf and :attr:`healthy` accepts it (read from manifests alone,
        newest first; a step whose health is unknown is never taken for healthy)."""
        if not healthy:
            return max(self.steps(), default=None)
        return self._by_health()[0]

    def _by_health(self) -> tuple[int | None, int | None]:
        """The newest step known to be healthy and the newest not known to be unhealthy, each
        judged from the copy it would be loaded from."""
        return newest_by_health(((s, i, store) for s, (i, store) in self.steps().items()), self.healthy)

    def find(self, step: int | None) -> tuple[StepInfo, Store]:
        """``step`` (default: the newest) and the store to load it from; CheckpointNotFoundError
        listing the newest saved steps when no tier has it."""
        tiers = self.steps()
        step = max(tiers, default=None) if step is None else check_step(step)
        where = self.local.url if self.remote is None else f"{self.local.url} or {self.remote.url}"
        if step is None:
            raise CheckpointNotFoundError(f"no steps saved in {where}")
        if step not in tiers:
            shown = ", ".join(map(str, sorted(tiers)[-10:])) or "none"
            raise CheckpointNotFoundError(
                f"step {step} is not saved in {where}; saved steps: {shown}",
                checkpoint=step_name(step),
            )
        return tiers[step]

    def load(self, step: int | None, *, healthy: bool = False, **kwargs: Any) -> Any:
        """The tree of ``step`` (default: the newest; with ``healthy``, the newest healthy one), as
        :meth:`Store.load` with ``kwargs`` loads it, from the remote tier when the local copy is
        damaged and the remote has the step."""
        if step is None and healthy:
            step, maybe = self._by_health()
            if step is None:
                raise _no_healthy_step(self.local.url, maybe)
        info, store = self.find(step)
        try:
            return store.load(info.name, **kwargs)
        except DamagedError as exc:
            if store is not self.local or self.remote is None or info.step not in step_infos(self.remote):
                raise
            _log.warning(
                "%s: %s is damaged locally (%s); loading it from the remote tier %s",
                self.local.url,
                info.name,
                exc,
                self.remote.url,
            )
            return self.remote.load(info.name, **kwargs)


def _no_healthy_step(url: str, unknown: int | None) -> CheckpointNotFoundError:
    """The error of a healthy load with no step known healthy; it names ``unknown``, the newest
    step whose health is unknown (the one retention keeps then), when there is one."""
    found = (
        ""
        if unknown is None
        else f"; the health of step {unknown} is unknown (no statistics, none readable, or the "
        f"healthy= check failed): restore(step={unknown}) loads it"
    )
    return CheckpointNotFoundError(
        f"no healthy step in {url}: none is known to hold no NaN/inf (statistics showing none, "
        f"and accepted by the healthy= check if one is set){found}"
    )


__all__ = ["Tiers"]
