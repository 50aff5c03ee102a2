"""The on-disk format without a store: addresses, manifests, chunk objects, bounds, the checked-in
stores of every version."""
