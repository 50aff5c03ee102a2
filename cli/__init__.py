"""The ``treestore`` command line."""
