"""One table of URL protocols: the storage class that serves each, the extra that installs its
filesystem, and whether its listings must bypass fsspec's cache. :func:`open_storage` picks from
it; any protocol not in the table gets the generic :class:`Storage`.

A plain local path is opened without fsspec, whose import is a tenth of a second of every
command's start-up: :class:`LocalStorage` reads, writes and lists through ``os``, and its root
is the one fsspec's local filesystem would give (:func:`local_root`). The other backends'
modules, which import fsspec's, are imported when their protocol is first opened.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

from treestore._storage.base import Storage
from treestore._storage.local import LocalStorage
from treestore.errors import InvalidInputError


@dataclass(frozen=True)
class Backend:
    module: str  # the module of treestore._storage holding its class
    name: str  # the class
    extra: str | None  # the treestore extra that installs its fsspec filesystem
    uncached_listings: bool  # pass use_listings_cache=False unless the caller set it

    @property
    def cls(self) -> type[Storage]:
        module = importlib.import_module(f"treestore._storage.{self.module}")
        found: type[Storage] = getattr(module, self.name)
        return found


_LOCAL = Backend("local", "LocalStorage", None, False)
_S3 = Backend("cloud", "S3Storage", "s3", True)
_GCS = Backend("cloud", "GCSStorage", "gcs", True)
_AZURE = Backend("cloud", "AzureStorage", "azure", True)
_HTTP = Backend("http", "HTTPStorage", "http", False)  # fsspec's HTTP filesystem does not cache listings

BACKENDS: dict[str, Backend] = {
    "file": _LOCAL,
    "local": _LOCAL,
    "memory": Backend("local", "MemoryStorage", None, False),
    "s3": _S3,
    "s3a": _S3,
    "gs": _GCS,
    "gcs": _GCS,
    "az": _AZURE,
    "abfs": _AZURE,
    "abfss": _AZURE,
    "http": _HTTP,
    "https": _HTTP,
}


def local_root(path: str) -> str | None:
    """The root fsspec's local filesystem gives the plain path ``path`` (absolute, ``~``
    expanded, ``./`` and trailing slashes dropped, nothing else normalized), or None when
    ``path`` is not one this function answers for: off POSIX, or holding a ``:`` (a protocol,
    a chained URL, fsspec's ``data:``), which fsspec parses."""
    if os.sep != "/" or ":" in path:
        return None
    if path.startswith("~"):
        path = os.path.expanduser(path)
    elif not path.startswith("/"):
        if path.startswith("./"):
            path = path[2:]
        elif path == ".":
            path = ""
        path = f"{os.getcwd()}/{path}"
    return path.rstrip("/") or "/"


def _protocol_of(url: str) -> str:
    if "://" in url:
        return url.split("://", 1)[0].lower()
    if "::" in url:  # a chained URL ("simplecache::s3://..."): the outermost layer
        return url.split("::", 1)[0].lower()
    return "file"


def open_storage(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Storage:
    """The :class:`Storage` for a store URL (any fsspec URL or a local path).

    ``storage_options`` go to the filesystem unchanged, except that object stores (S3, GCS,
    Azure) get ``use_listings_cache=False`` unless it is given: a cached listing would hide
    objects other writers added since (a new checkpoint, a chunk another save wrote).
    """
    if not isinstance(url, (str, os.PathLike)):
        raise InvalidInputError(f"a store URL is a str or path, got {type(url).__name__}")
    url = os.fspath(url)
    if not url:
        raise InvalidInputError("a store URL cannot be empty")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise InvalidInputError(
            f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}"
        )
    root = None if storage_options else local_root(url)
    if root is not None:
        return LocalStorage(None, root, url.rstrip("/"))
    import fsspec  # (here: a local path opens without it)

    protocol = _protocol_of(url)
    options = dict(storage_options or {})
    backend = BACKENDS.get(protocol)
    if backend is not None and backend.uncached_listings:
        options.setdefault("use_listings_cache", False)
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        extra = backend.extra if backend is not None else None
        hint = f"; install it with: pip install 'treestore-jax[{extra}]'" if extra else ""
        raise InvalidInputError(f"no filesystem for {url!r}: {exc}{hint}") from None
    except (ValueError, TypeError) as exc:
        raise InvalidInputError(f"not a usable store URL {url!r} (or storage options): {exc}") from None
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    for p in protocols:
        found = BACKENDS.get(p)
        if found is not None:
            return found.cls(fs, root, url.rstrip("/"))
    return Storage(fs, root, url.rstrip("/"))
