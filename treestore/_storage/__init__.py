"""Layer 2, storage: the object contract every backend meets (``base``), one registry of URL
protocols (``registry``), and one module per implementation: local and memory (``local``), S3,
GCS and Azure (``cloud``), read-only HTTP (``http``). Of treestore it imports only the error
classes (``treestore.errors``) and the path grammar (``_format.paths``, for the names of temporary
files); ``tests/package/test_layering.py`` keeps it so."""
