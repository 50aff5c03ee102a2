"""Whole systems: crashes, concurrency, cloud faults, multi-process jobs, model-based runs."""
