"""Hostile stores: every way a store can lie, and what a reader must do about it (raise a
TreestoreError, within bounded time and memory, touching nothing outside the store, running no
code the store names). See _harness.py for the guards every case runs under."""
