"""Reading a checkpoint: names, commit records and manifests (``committed``, ``parts``), chunks
checked against their digests (``read``), whole trees and leaves (``load``, ``load_leaves``),
any box of a leaf (``region``), and host memory (``memory``, ``staging``)."""
