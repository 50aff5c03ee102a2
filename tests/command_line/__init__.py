"""The treestore command."""
