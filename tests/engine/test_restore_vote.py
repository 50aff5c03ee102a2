"""The votes of a restore that shares bytes (treestore._engine.group.restore_vote), in a job of
threads (LocalRuntime): a failure anywhere makes every process raise, of the failing process's
class and naming it; a process that never votes makes the others raise BarrierTimeoutError."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from treestore._engine.group.group_runtime import LocalRuntime
from treestore._engine.group.restore_vote import Vote, voting
from treestore.errors import (
    BarrierTimeoutError,
    ChunkDamagedError,
    InvalidInputError,
    StorageError,
    StructureMismatchError,
)


def job(count: int, body: Callable[[int, Vote], None], timeout: float = 5.0) -> list[BaseException | None]:
    """Each thread's outcome: the error it raised, or None."""
    runtime = LocalRuntime(count)
    outcomes: list[BaseException | None] = [None] * count

    def process(i: int) -> None:
        vote = Vote(i, count, runtime, timeout, restore=0)
        vote.checkpoint = "c"
        try:
            with voting(vote):
                body(i, vote)
        except BaseException as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=process, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


def test_processes_that_agree_return():
    assert job(3, lambda i, vote: vote.agree("same")) == [None, None, None]


def test_a_process_that_fails_makes_every_process_raise_its_class():
    def body(i: int, vote: Vote) -> None:
        if i == 1:
            raise ChunkDamagedError("w: chunk 0123 does not match its digest", checkpoint="c", address="w")
        vote.agree("same")

    outcomes = job(3, body)
    assert all(isinstance(e, ChunkDamagedError) for e in outcomes), outcomes
    assert "process 1: ChunkDamagedError: w: chunk 0123" in str(outcomes[0])
    assert outcomes[0].address == "w" and outcomes[0].checkpoint == "c"
    assert str(outcomes[1]) == "w: chunk 0123 does not match its digest"  # its own error


def test_other_failures_raise_as_their_class_or_storage_errors():
    def mismatch(i: int, vote: Vote) -> None:
        if i == 0:
            raise StructureMismatchError(["w: expected shape (3,), found (2,)"], checkpoint="c")
        vote.agree("same")

    outcomes = job(2, mismatch)
    assert isinstance(outcomes[1], StructureMismatchError) and "process 0" in str(outcomes[1])

    def crash(i: int, vote: Vote) -> None:
        if i == 0:
            raise KeyError("not one of treestore's")
        vote.agree("same")

    outcomes = job(2, crash)
    assert isinstance(outcomes[0], KeyError) and isinstance(outcomes[1], StorageError)


def test_a_failure_after_a_vote_passed_is_voted_at_the_next():
    def body(i: int, vote: Vote) -> None:
        vote.agree("same")
        if i == 2:
            raise OSError("the collective failed")
        vote.agree("again")

    outcomes = job(3, body)
    assert isinstance(outcomes[2], OSError)
    assert all(isinstance(e, StorageError) and "process 2" in str(e) for e in outcomes[:2]), outcomes


def test_a_failure_after_the_last_collective_makes_every_process_raise():
    """No process returns a tree another process failed to make."""

    def body(i: int, vote: Vote) -> None:
        vote.agree("same")
        if i == 0:
            raise OSError("placing the shared leaves failed")

    outcomes = job(3, body)
    assert isinstance(outcomes[0], OSError)
    assert all(isinstance(e, StorageError) and "process 0" in str(e) for e in outcomes[1:]), outcomes


def test_processes_sharing_different_things_all_raise():
    outcomes = job(3, lambda i, vote: vote.agree("mine" if i == 1 else "same"))
    assert all(isinstance(e, InvalidInputError) for e in outcomes), outcomes
    assert "differ between processes 0, 2; process 1" in str(outcomes[0])


def test_a_process_that_never_votes_is_named_by_the_others_within_the_timeout():
    def body(i: int, vote: Vote) -> None:
        if i == 2:
            time.sleep(2.0)  # gone: it votes after the others stopped waiting
            return
        vote.agree("same")

    started = time.monotonic()
    outcomes = job(3, body, timeout=0.5)
    assert all(isinstance(e, BarrierTimeoutError) for e in outcomes[:2]), outcomes
    assert outcomes[0].missing == (2,) and "process 2 (of 3) did not arrive within 0.5 s" in str(outcomes[0])
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("count", [2, 4])
def test_the_votes_of_past_steps_are_deleted(count):
    runtime = LocalRuntime(count)

    def body(i: int) -> None:
        vote = Vote(i, count, runtime, 5.0, restore=3)
        for k in range(4):
            vote.agree(f"step {k}")

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    left = {k.rsplit("/", 1)[0] for k in runtime.items("treestore/restore/")}
    assert left <= {"treestore/restore/3/2", "treestore/restore/3/3"}, left
