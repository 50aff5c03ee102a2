"""Reading a checkpoint: names, commit records and manifests (``committed``, ``parts``), chunks
checked against their digests (``read``), whole trees and leaves (``load``, ``load_leaves``),
any box of a leaf (``region``), host memory (``memory``, ``staging``), and leaves replicated
across processes read once and shared over the devices (``share_plan``: who reads what;
``share``: the reads and the collective)."""
