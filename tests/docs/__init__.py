"""The documentation's examples and the ecosystems' day-one programs run as written."""
