"""The votes of a restore that shares replicated leaves between the processes of a job.

A load onto a template whose leaves are replicated across processes
(:func:`treestore._engine.reading.share_plan.crosses`; every process decides alike from its
template) reads each replicated byte once and shares it over the devices
(:mod:`treestore._engine.reading.share`): a process then relies on bytes another read. So the
processes vote, through the job's runtime (JAX's key-value store and barriers), before each
collective and once at the end: every process says it succeeded (and what it is about to share,
as a digest every process must match) or why it failed. A failure anywhere makes every process
raise, the others an error of the failing process's class naming it; a process that does not
vote within the barrier timeout makes the others raise ``BarrierTimeoutError`` naming it. So
every process returns its tree, or none does, and none waits longer than the barrier timeout.

The restores of a job are numbered, in the order each process makes them (every process makes
the same restores in the same order, as with any collective): vote ``k`` of restore ``n`` is
the barrier ``treestore/restore/<n>/<k>``, each process's ballot the key under it. Process 0
deletes a vote's keys once every process has gone past it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

from treestore import errors as _errors
from treestore._engine.group.distributed import group
from treestore._engine.group.group_runtime import Runtime
from treestore._engine.reading import share_plan as _share_plan
from treestore._engine.reading.parts import named
from treestore._format.parts.explain import process_names
from treestore.errors import BarrierTimeoutError, InvalidInputError, StorageError, TreestoreError

_log = logging.getLogger("treestore")
_counters: dict[tuple[int, int], itertools.count[int]] = {}
_counting = threading.Lock()
MAX_ERROR = 2000  # characters of a failing process's error its ballot carries


def _next_restore(runtime: Runtime, index: int) -> int:
    """The number of this restore among the job's (as this process counts them)."""
    with _counting:
        return next(_counters.setdefault((runtime.job, index), itertools.count()))


class Vote:
    """This process's votes in one restore that shares bytes (see the module's docstring)."""

    def __init__(self, index: int, count: int, runtime: Runtime, timeout: float, restore: int) -> None:
        self.index, self.count, self.runtime, self.timeout = index, count, runtime, timeout
        self.restore = restore
        self.checkpoint: str | None = None  # named once the process has found it
        self.settled = False  # a vote raised what every process raises: nothing more to vote
        self._step = 0

    def agree(self, token: str) -> None:
        """Vote that this process succeeded so far and shares what ``token`` digests; return
        when every process did the same, else raise (see the module's docstring)."""
        self._vote({"ok": True, "token": token}, None)

    def fail(self, error: BaseException) -> None:
        """Vote that this process failed with ``error``, so that every other process raises at
        once; returns (the caller raises ``error``), waiting at most the barrier timeout."""
        ballot = {"ok": False, "class": type(error).__name__, "error": str(error)[:MAX_ERROR]}
        if isinstance(error, TreestoreError) and error.address is not None:
            ballot["address"] = error.address
        try:
            self._vote(ballot, error)
        except Exception as exc:  # the others did not all arrive, or the runtime is gone: the
            _log.warning("%s", exc)  # caller raises its own error

    def _where(self) -> str:
        name = "" if self.checkpoint is None else f" of checkpoint {self.checkpoint!r}"
        return f"multi-process restore{name}"

    def _vote(self, ballot: dict[str, Any], own: BaseException | None) -> None:
        root = f"treestore/restore/{self.restore}/{self._step}"
        self._step += 1
        self.runtime.set(f"{root}/{self.index}", json.dumps(ballot))
        why = self.runtime.wait(root, self.timeout)
        if why is not None:
            self._timed_out(root, why)
        found = self.runtime.items(f"{root}/")
        if self.index == 0:  # every process is past the previous vote (and restore)
            with contextlib.suppress(Exception):
                previous = f"{self.restore}/{self._step - 2}" if self._step > 1 else f"{self.restore - 1}"
                self.runtime.delete(f"treestore/restore/{previous}/")
        if own is not None:
            return
        ballots = {i: _ballot(found.get(f"{root}/{i}")) for i in range(self.count)}
        failed = {i: b for i, b in ballots.items() if not b.get("ok")}
        self.settled = bool(failed)
        if failed:
            raise _raised(failed, self._where(), self.checkpoint)
        tokens: dict[str, list[int]] = {}
        for i, b in ballots.items():
            tokens.setdefault(str(b.get("token")), []).append(i)
        if len(tokens) > 1:
            self.settled = True
            groups = "; ".join(process_names(found) for found in tokens.values())
            raise InvalidInputError(
                f"{self._where()}: the processes do not restore the same leaves of the same "
                f"checkpoint onto the same shardings (they differ between {groups}): every process "
                "must pass the same checkpoint and a template with the same shardings",
                checkpoint=self.checkpoint,
            )

    def _timed_out(self, root: str, why: str) -> None:
        self.settled = True
        arrived: set[str] = set()
        with contextlib.suppress(Exception):
            arrived = {k.rsplit("/", 1)[-1] for k in self.runtime.items(f"{root}/")}
        missing = [i for i in range(self.count) if str(i) not in arrived]
        if missing:
            text = f"{process_names(missing)} (of {self.count}) did not arrive within {self.timeout:g} s"
        else:
            text = f"process {self.index} arrived after the others had stopped waiting"
        raise BarrierTimeoutError(
            f"{self._where()}, vote {root.rsplit('/', 1)[-1]}: {text} ({why}); the restore returns nothing",
            missing=missing,
            checkpoint=self.checkpoint,
        )


def _ballot(text: str | None) -> dict[str, Any]:
    if text is None:
        return {"ok": False, "error": "it sent no vote"}
    try:
        found = json.loads(text)
    except ValueError:
        found = None
    return found if isinstance(found, dict) else {"ok": False, "error": "its vote is malformed"}


def _raised(failed: dict[int, dict[str, Any]], where: str, checkpoint: str | None) -> TreestoreError:
    """The error every other process raises when processes ``failed``: of the class the first
    of them raised (when it is one of treestore's), naming each with its error."""
    text = f"{where} failed: " + named(
        {i: f"{b.get('class', 'error')}: {b.get('error', '')}" for i, b in failed.items()}
    )
    first = failed[min(failed)]
    cls = getattr(_errors, str(first.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, TreestoreError)):
        return StorageError(text, checkpoint=checkpoint)
    if cls is _errors.StructureMismatchError:
        return cls([text], checkpoint=checkpoint)
    if cls is BarrierTimeoutError:
        return cls(text, checkpoint=checkpoint)
    address = first.get("address")
    return cls(text, checkpoint=checkpoint, address=address if isinstance(address, str) else None)


def begin(like: Any, share: bool) -> Vote | None:
    """The votes of a restore onto ``like`` when it shares bytes between processes (``share``,
    a job of several processes, a template replicating a leaf across them), else None."""
    if not share or like is None:
        return None
    found = group()
    if found is None or not _share_plan.crosses(like):
        return None
    restore = _next_restore(found.runtime, found.index)
    return Vote(found.index, found.count, found.runtime, found.timeout, restore)


@contextlib.contextmanager
def voting(vote: Vote | None) -> Iterator[None]:
    """A restore by every process of the job (with ``vote``): an error in the block is voted
    before it propagates, so the others raise at once (unless every process raises it already:
    a vote's outcome, or a timeout, which the others reach as well); a block that ends well is
    voted on last, so that every process returns its tree or none does."""
    if vote is None:
        yield
        return
    try:
        yield
    except Exception as exc:
        if not vote.settled and not isinstance(exc, BarrierTimeoutError):
            vote.fail(exc)
        raise
    vote.agree("done")


__all__ = ["Vote", "begin", "voting"]
