"""Writing a checkpoint: the one door every write enters (``writing``), the chunking of leaves
(``chunking``, ``packs``), the chunk writer and the chunks a save may trust, save options, and
the accelerator's part: transfers in a bounded window (``device_fetch``), the device memory a save
may take (``device_memory``) and the async save's device snapshot (``snapshot``)."""
