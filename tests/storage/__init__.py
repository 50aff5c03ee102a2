"""The storage layer on every backend (real servers on 127.0.0.1): the object contract, its faults,
store URLs."""
