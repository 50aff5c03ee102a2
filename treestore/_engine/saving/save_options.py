"""Tuning for saves: :class:`SaveOptions`, checked when made."""

from __future__ import annotations

from dataclasses import dataclass, field

from treestore._engine.threads import default_threads
from treestore._format.codecs import Codec
from treestore._tree.leaves import Keep
from treestore.errors import InvalidInputError

MiB = 2**20
DEFAULT_WINDOW = 64 * MiB  # host bytes of a save's device transfers and chunks in flight, by default


@dataclass(frozen=True)
class SaveOptions:
    """Tuning for saves; the defaults suit model weights on local disks and object stores.

    Attributes:
        codec: How chunks are compressed (see :class:`Codec`).
        chunk_size: Big leaves are cut into chunks of about this many raw bytes (4 KiB to
            256 MiB; default 4 MiB).
        small_leaf: Leaves under this many bytes are packed together (0 to ``chunk_size``;
            default 64 KiB).
        pack_size: Raw bytes per pack of small leaves (``small_leaf`` to 256 MiB; default
            1 MiB).
        threads: Threads that write chunks (1 to 256; default: chosen from the cores).
        stats: Record each array leaf's statistics in the manifest — NaN, +inf and -inf counts,
            min and max of the finite elements, L2 norm (float64) — measured on the host while
            its chunks are hashed, so that health checks, ``treestore show --stats`` and
            retention read manifests only (True or False; default True; see
            :meth:`Checkpoint.stats`). They cost no more CPU than the hashing (the benchmarks
            page has the figures). Leaves that live on an accelerator are measured from the
            bytes fetched to be stored: a tree gets the same record wherever it lives.
        host_window: Bytes of host memory a save of arrays on an accelerator holds at most for
            their transfers and chunks in flight: big leaves are fetched in slices, each
            transfer started as soon as the window has room, and hashed, compressed and
            written as it arrives (at least ``4 * chunk_size``; default None: 64 MiB, or
            ``4 * chunk_size`` where that is more; :attr:`window` is the figure in use).
        device_path: Which jax arrays a save fetches while it writes, in ``host_window``:
            ``"auto"`` those off the CPU (default), ``"always"`` every jax array (CPU ones
            too), ``"never"`` none (every leaf is copied to the host first). Beyond the tree,
            such a save takes at most ``window`` bytes of device memory (the slices of leaves
            bigger than 16 MiB in flight), and none on a device with less room than that beside
            the training step's peak: there, leaves are fetched whole.
        device_snapshot: Bytes of device memory an async save of :class:`CheckpointManager` may
            take to copy the tree on its devices, so that the training step is blocked only while
            the copies are started (None, the default: up to half of what each device has free;
            0: never, the tree is copied to host memory before ``save`` returns). The copies
            are made only where they fit, with ``window`` bytes more for the save's slices, in
            what each device has never used (its limit less its peak use, so that the training
            step's own peak is left to it); a tree that does not fit is copied to host memory,
            its leaves (or shards) bigger than a slice cut into slices within ``window`` (where
            the devices have that room), as a save fetches them.
        keep_host_copies: Whether an async save of :class:`CheckpointManager` keeps its host
            copies of the tree between saves, to copy the next tree into (True, the default:
            at most one host copy of the part of the tree not copied on the devices is held
            between saves; False: they are dropped once each save is written, the C library is
            asked to give the memory back to the system (glibc's ``malloc_trim``), and the next
            save allocates anew).

    Raises:
        InvalidInputError: A value is out of its range (or ``stats`` is not a bool).

    Examples:
        >>> import numpy as np, treestore
        >>> options = treestore.SaveOptions(chunk_size=1 << 20, codec=treestore.Codec(level=3))
        >>> r = treestore.save("memory://doc/options", {"w": np.arange(2.0**19)}, "a", options=options)
        >>> r.chunks_written  # 4 MiB of float64 in chunks of 1 MiB
        4
    """

    codec: Codec = field(default_factory=Codec)
    chunk_size: int = 4 * MiB
    small_leaf: int = 64 * 1024
    pack_size: int = 1 * MiB
    threads: int = field(default_factory=default_threads)
    stats: bool = True
    host_window: int | None = None
    device_path: str = "auto"
    device_snapshot: int | None = None
    keep_host_copies: bool = True

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_size <= 256 * MiB:
            raise InvalidInputError(f"chunk_size must be between 4 KiB and 256 MiB, got {self.chunk_size}")
        if not 0 <= self.small_leaf <= self.chunk_size:
            raise InvalidInputError("small_leaf must be between 0 and chunk_size")
        if not self.small_leaf <= self.pack_size <= 256 * MiB:
            raise InvalidInputError("pack_size must be between small_leaf and 256 MiB")
        if not 1 <= self.threads <= 256:
            raise InvalidInputError(f"threads must be between 1 and 256, got {self.threads}")
        if type(self.stats) is not bool:
            raise InvalidInputError(f"stats must be True or False, got {self.stats!r}")
        if type(self.keep_host_copies) is not bool:
            raise InvalidInputError(f"keep_host_copies must be True or False, got {self.keep_host_copies!r}")
        if self.host_window is not None and (
            type(self.host_window) is not int or self.host_window < 4 * self.chunk_size
        ):
            raise InvalidInputError(
                f"host_window must be None or an int of at least 4 * chunk_size "
                f"({4 * self.chunk_size}), got {self.host_window!r}"
            )
        if self.device_path not in ("auto", "always", "never"):
            raise InvalidInputError(
                f"device_path must be 'auto', 'always' or 'never', got {self.device_path!r}"
            )

        if self.device_snapshot is not None and (
            type(self.device_snapshot) is not int or self.device_snapshot < 0
        ):
            raise InvalidInputError(
                f"device_snapshot must be None or an int >= 0, got {self.device_snapshot!r}"
            )

    @property
    def window(self) -> int:
        """The bytes of host memory a save's device transfers and chunks in flight may hold:
        ``host_window``, or where that is None 64 MiB, or ``4 * chunk_size`` where that is more."""
        if self.host_window is not None:
            return self.host_window
        return max(DEFAULT_WINDOW, 4 * self.chunk_size)

    @property
    def keep(self) -> Keep | None:
        """Which jax arrays :func:`prepare` leaves on their devices for these options."""
        if self.device_path == "never":
            return None
        return Keep(max(self.small_leaf, 1), cpu=self.device_path == "always")
