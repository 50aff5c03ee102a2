"""Layer 1, format: the on-disk records and their codecs as pure functions of bytes — addresses,
the manifest, the commit record, chunk objects, paths and names, dtype tables and
the limits every reader enforces. No I/O; imports only the kernels below it (``_kernels``: the
digests, compressors and byte planes its encoders call) and the error classes."""
