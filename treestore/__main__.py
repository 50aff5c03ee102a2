"""``python -m treestore``: the command line, as the ``treestore`` command runs it."""

from treestore_cli.main import main

raise SystemExit(main())
