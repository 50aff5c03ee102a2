"""A checkpoint manager's saves in flight: at most one at a time, written on a background thread
(with ``async_save``) after the tree is copied where the caller cannot change it, or written at
once; the error of a background save is kept until the next call that collects it."""

from __future__ import annotations

from collections.abc import Callable

from treestore._engine import write as _write
from treestore._engine.saving.snapshot import Background, HostSnapshot
from treestore._engine.saving.staging import Stager
from treestore._tree import prepare as _prepare
from treestore._tree.jax_import import imported as jax_imported
from treestore._tree.leaves import Keep


class SaveQueue:
    """One save in flight at most. With ``background``, :meth:`prepare` copies the tree (its big
    arrays on their devices where they have the room, ``SaveOptions.device_snapshot``; the rest
    into one host copy of the last save, kept to reuse) and :meth:`submit` writes it on one
    thread; without, :meth:`prepare` validates the tree and :meth:`submit` writes it at once."""

    def __init__(self, background: bool, options: _write.SaveOptions) -> None:
        self._options = options
        self._background = Background() if background else None
        self.snapshot = HostSnapshot()
        self.pending: int | None = None  # the step of the save in flight

    def prepare(self, tree: object) -> _prepare.Prepared:
        """``tree`` validated and converted for a save; with a background, copied as well."""
        if self._background is None:
            return _prepare.prepare(tree, keep=self._options.keep)
        return self.snapshot.take(
            tree, *self._device_snapshot(), window=self._options.window, stager=self._stager()
        )

    def _stager(self) -> Stager | None:
        """What fetches the big arrays that a snapshot copies to host memory: the save's own
        fetcher, in slices (None where the options keep no array on its devices)."""
        keep, options = self._options.keep, self._options
        if keep is None or not jax_imported():
            return None
        return Stager(options.chunk_size, options.window, cpu=keep.cpu)

    def _device_snapshot(self) -> tuple[Keep | None, int | None]:
        """Which arrays an async save may copy on their devices (None: none), and the bound on
        the bytes of those copies; the snapshot checks the devices' room once the tree is valid."""
        keep, limit = self._options.keep, self._options.device_snapshot
        if keep is None or limit == 0 or not jax_imported():
            return None, None
        return keep, limit

    def submit(self, step: int, commit: Callable[[], None]) -> None:
        """Run ``commit`` (the save of ``step``): on the background thread, releasing the
        snapshot's device copies once it is written, or at once without a background."""
        if self._background is None:
            commit()
            return

        held = [commit]  # the job lets go of the commit, and of the tree it holds, once it is written
        del commit

        def job() -> None:
            try:
                held.pop()()
            finally:
                if self._options.keep_host_copies:
                    self.snapshot.release()  # the device copies, as soon as they are written
                else:
                    self.snapshot.clear()  # the host copies too

        try:
            self._background.submit(job)
        except RuntimeError:  # no thread to write on: write now, which frees the device copies too
            job()
            return
        self.pending = step

    def collect(self, *, block: bool) -> None:
        """Raise the error of the finished save in flight (waiting for it with ``block``)."""
        if self._background is not None and (block or self._background.done()):
            try:
                self._background.collect()
            finally:
                self.pending = None

    def close(self) -> None:
        """Stop the thread (after the save in flight) and drop the kept copies."""
        if self._background is not None:
            self._background.shutdown()
        self.snapshot.clear()
