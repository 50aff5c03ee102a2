"""zstd compressors and decompressors, each thread's own and kept for its life: making one per
chunk costs more than compressing a small chunk. What a chunk object's zstd frames hold is the
format's (treestore._format.codecs)."""

from __future__ import annotations

import os
import threading

import zstandard

_tls = threading.local()


def compressor(level: int, *, spread: bool = False) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level``; with ``spread``, a new one that compresses on
    every core (zstd's own threads, in jobs of 4 MiB: smaller ones cost more than they overlap).
    That one is not kept: freeing it joins its threads, which in a process forked while it was
    kept would hang or crash (the threads are not there)."""
    cores = os.cpu_count() or 1
    if spread and cores > 1:
        return zstandard.ZstdCompressor(compression_params=_params(level, threads=cores, job_size=4 * 2**20))
    cache = getattr(_tls, "compressors", None)
    if cache is None:
        cache = _tls.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(compression_params=_params(level))
    return cache[level]


def _params(level: int, **threads: int) -> zstandard.ZstdCompressionParameters:
    # Weights have little to find by LZ matching: a tiny match search keeps the entropy coding
    # (where the gain is) at several times the speed of the level's defaults, and compresses
    # exponent planes slightly better.
    return zstandard.ZstdCompressionParameters.from_level(
        level, min_match=7, search_log=1, hash_log=6, window_log=17, write_content_size=True, **threads
    )


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor."""
    d = getattr(_tls, "decompressor", None)
    if d is None:
        d = _tls.decompressor = zstandard.ZstdDecompressor()
    return d
