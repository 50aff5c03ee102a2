"""The byte kernels below the format: the compiled part and its numpy twins, each checked against
the other, and what treestore does where the compiled part was not built."""
