"""Object-store backends (S3, GCS, Azure Blob) and read-only HTTP, on top of :class:`Storage`.

What each one guarantees (SPEC.md section 2.2) and how:

- every write is one PUT of the whole object, so it is atomic; nothing is ever renamed;
- ``write_new`` is a conditional PUT that the server decides: S3 ``If-None-Match: *`` (s3fs
  ``mode="create"``), Azure ``If-None-Match: *`` (adlfs ``overwrite=False``), GCS
  ``ifGenerationMatch=0`` (gcsfs ``mode="create"``). GCS also checks for the object first, because
  the GCS emulator ignores the precondition: there two racing writers can both succeed;
- a ranged read may ask for more bytes than the object holds (callers bound reads that way); a
  range that starts past the end reads as ``b""`` on every backend;
- a size check (how a save asks whether the store has a chunk) is one request (S3: one HEAD,
  not s3fs's HEAD-then-LIST);
- listings are not cached (``open_storage`` passes ``use_listings_cache=False``) and are one
  paginated listing of every key under a prefix (``find``), which raises any failure instead of
  leaving keys out;
- an upload has a deadline (:func:`upload_deadline`): clients time out a silent read, but an
  upload whose connection stalls mid-body (a network partition, a server that stopped reading)
  would otherwise wait for the kernel to give up on TCP, many minutes later. The deadline cancels
  it; the write is then retried like any transient failure.

fsspec's async filesystems run every call on one event-loop thread, so one instance is safely
shared by the save and load thread pools; those pools bound how many requests are in flight."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable
from typing import Any

from fsspec.asyn import AsyncFileSystem

from treestore._storage.base import Storage

_BULK_DELETE = 1000  # keys per S3 DeleteObjects request


_GCS_SIMPLE_LIMIT = 50 * 2**20  # gcsfs uploads smaller objects in one multipart/related request


UPLOAD_TIMEOUT = 60.0  # seconds every upload may take, plus the time to send its bytes at ...


UPLOAD_MIN_RATE = 1 << 20  # ... this many bytes per second


def upload_deadline(nbytes: int) -> float:
    """Seconds an upload of ``nbytes`` may take before it is cancelled (and retried).

    ``UPLOAD_TIMEOUT + nbytes / UPLOAD_MIN_RATE``; the environment variable
    ``TREESTORE_UPLOAD_TIMEOUT`` replaces ``UPLOAD_TIMEOUT`` (seconds, for slow links or tests).
    """
    base = UPLOAD_TIMEOUT
    text = os.environ.get("TREESTORE_UPLOAD_TIMEOUT", "").strip()
    if text:
        with contextlib.suppress(ValueError):
            base = max(float(text), 0.001)
    return base + nbytes / UPLOAD_MIN_RATE


class ObjectStorage(Storage):
    """An object store: whole-object PUTs, server-side put-if-absent, no renames."""

    flat_listing = True  # one paginated listing of every key under a prefix; it raises failures

    def _pipe(self, full: str, data: bytes, **kwargs: Any) -> None:
        """``fs.pipe_file`` with a deadline (fsspec's ``sync`` cancels the upload when it passes)."""
        if isinstance(self.fs, AsyncFileSystem):
            kwargs["timeout"] = upload_deadline(len(data))
        self.fs.pipe_file(full, data, **kwargs)

    def _put(self, full: str, data: bytes) -> None:
        self._pipe(full, data)

    def _put_if_absent(self, full: str, data: bytes) -> None:
        """PUT ``data`` unless the object exists; FileExistsError if it does."""
        self._pipe(full, data, mode="create")

    def write_new(self, path: str, data: bytes) -> bool:
        self._check_writable(path)
        full = self._full(path)
        try:
            self._call("writing", path, lambda: self._put_if_absent(full, data))
            return True
        except FileExistsError:
            pass
        # The name is taken. It can be this very write: an attempt that reached the server but
        # whose answer was lost, then retried (by us or inside the client), finds its own object.
        # The same bytes mean the same commit, so that counts as written.
        return self._holds(path, data)


class S3Storage(ObjectStorage):
    """s3fs. Conditional PUT (``If-None-Match: *``), one HEAD per size check, bulk deletes."""

    def object_size(self, path: str) -> int | None:
        full = self._full(path)
        bucket, key, _ = self.fs.split_path(full)
        if not key:
            return None

        def head() -> dict[str, Any]:
            # s3fs's info() follows a missing key with a LIST (is it a folder?): two requests
            # per new chunk in a save. A HEAD alone answers the question for objects.
            out = self.fs.call_s3("head_object", self.fs.kwargs, Bucket=bucket, Key=key)
            assert isinstance(out, dict)
            return out

        try:
            out = self._call("inspecting", path, head)
        except FileNotFoundError:
            return None
        return int(out["ContentLength"])

    def _put_if_absent(self, full: str, data: bytes) -> None:
        try:
            self._pipe(full, data, mode="create")
        except FileExistsError:
            raise
        except Exception as exc:
            # 409 ConditionalRequestConflict: a concurrent conditional write to this key was in
            # flight; S3 asks to retry, and the retry then sees the winner (412).
            if "conditionalrequestconflict" in f"{type(exc).__name__} {exc}".lower():
                raise ConnectionError(f"conditional write conflict, retrying: {exc}") from exc
            raise

    def delete_many(self, paths: Iterable[str]) -> None:
        todo = [self._full(p) for p in paths]
        if not todo:
            return
        self._check_writable(todo[0])
        for i in range(0, len(todo), _BULK_DELETE):
            batch = todo[i : i + _BULK_DELETE]
            with contextlib.suppress(FileNotFoundError):
                self._call("deleting", self._rel(batch[0]), functools.partial(self.fs.rm, batch))


class GCSStorage(ObjectStorage):
    """gcsfs. ``ifGenerationMatch=0`` makes put-if-absent atomic on real GCS; the emulator
    ignores it, so an existence check comes first (racy there, exact without a race)."""

    def _upload(self, full: str, data: bytes, mode: str) -> None:
        kwargs: dict[str, Any] = {"mode": mode}
        if data.endswith(b"\r") and len(data) < _GCS_SIMPLE_LIMIT:
            # gcsfs's one-request upload frames the body as multipart/related with bare-LF
            # delimiters, so a body ending in CR reads as ending in the CRLF of a delimiter: the
            # GCS emulator drops that last byte (a commit record ending in the number 13, one
            # chunk in 256). The resumable upload sends the bytes as they are.
            kwargs["chunksize"] = len(data)
        self._pipe(full, data, **kwargs)

    def _put(self, full: str, data: bytes) -> None:
        self._upload(full, data, "overwrite")

    def _put_if_absent(self, full: str, data: bytes) -> None:
        try:
            self.fs.info(full)
        except FileNotFoundError:
            pass
        else:
            raise FileExistsError(full)
        self._upload(full, data, "create")


class AzureStorage(ObjectStorage):
    """adlfs. Put-if-absent is ``overwrite=False`` (``If-None-Match: *``), decided by the server."""

    def _put_if_absent(self, full: str, data: bytes) -> None:
        self._pipe(full, data, overwrite=False)
