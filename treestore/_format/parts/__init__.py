"""Manifests in parts (multi-process saves): each process's part (``part``), the primary's merge
(``merge``) and what it explains when a merge fails (``explain``), and the check that pieces
cover their leaves (``coverage``)."""
