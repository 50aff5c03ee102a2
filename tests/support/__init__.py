"""What the tests share that is not a test: assertions, templates, damaged stores, counting and
hostile filesystems, jobs of threads, and the local object-store servers."""
