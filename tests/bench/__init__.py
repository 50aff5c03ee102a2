"""The benchmarks run (quick forms) and report what they claim."""
