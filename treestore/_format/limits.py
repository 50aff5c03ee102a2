"""Every bound a reader enforces, defined once; writers check the same bounds before writing, so
a save can never commit what a load refuses (SPEC.md, "Limits")."""

from __future__ import annotations

MiB = 2**20

MAX_RECORD_BYTES = 2 * MiB  # a commit record
MAX_MANIFEST_BYTES = 256 * MiB  # a manifest
MAX_METADATA_BYTES = 1 * MiB  # user metadata, encoded
MAX_CHUNK_BYTES = 256 * MiB  # raw bytes of one chunk (and of one pack)
CHUNK_HEADER_BYTES = 16  # the fixed header of a chunk object
MAX_PLANE_WIDTH = 8  # bytes per element a byte-plane chunk may split into planes
# The most a chunk object may exceed its raw size: the header, one stored length per plane, and
# the overhead of zstd frames that did not pay (writers store such planes raw).
CHUNK_SLACK = CHUNK_HEADER_BYTES + 8 * MAX_PLANE_WIDTH + 64
MAX_NDIM = 64  # dimensions of an array leaf
MAX_DIM = 2**48  # one dimension (and a piece's start)
LEAF_BYTES_END = 2**63  # an array leaf's nonzero dimensions times its element size stay below this
MAX_DEPTH = 500  # depth of a tree node, the root at 0
# Characters of one node's address (its keys' segments joined by "/"), and of every node's
# addresses together: what a reader may build from a manifest of shared segments.
MAX_ADDRESS_CHARS = 1 << 14
MAX_ADDRESSES_CHARS = 1 << 28
MAX_PIECES = 65536  # pieces of one sharded leaf
MAX_GRID_CELLS = 1 << 22  # cells of the grid the pieces of a leaf span
# An int leaf or int dict key in [INT_START, INT_END) is stored as a msgpack int; an int leaf
# outside it as canonical decimal text of at most MAX_INT_DIGITS characters, a sign included
# (Python's own int/str conversion limit is 4300 digits).
INT_START = -(2**63)
INT_END = 2**64
MAX_INT_DIGITS = 4300
MAX_INDEX = 2**31  # a sequence or flattened index in a key (jax holds 32-bit indices)
MAX_NAME = 200  # characters of a checkpoint name
MAX_PART_BYTES = 1 << 28  # a part of a manifest stored in parts (one process's pieces)
MAX_PARTS = 65536  # parts of one manifest (processes of a multi-process save)
MAX_PARTS_BYTES = MAX_MANIFEST_BYTES  # every part of one manifest together
MAX_OUTCOME_BYTES = 1 << 16  # the outcome record of a multi-process save
MAX_LOCK_BYTES = 4096  # a lock record; a bigger object is not read (it ages by its mtime)
