"""Layer 0, kernels: the byte work the format's encoders and decoders call, and the runtime state
it keeps — BLAKE3 digests under an address-space limit (``digest``), zstd compressors kept per
thread (``compressors``), byte planes split and joined by the compiled part or by numpy
(``planes``), the compiled one-pass statistics of float chunks (``float_pass``), each thread's
reusable buffers (``scratch``), and the address space left under a limit (``room``), at which
the manifest decoders' loops look. ``_planes.c`` is the package's one compiled part.

What the bytes must be is the format's (treestore._format); how fast and on which thread they are
made is decided here. Imports nothing of treestore but treestore.errors."""
