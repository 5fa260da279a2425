"""Tools for testing phalanx itself: hosts made of network namespaces
(:mod:`phalanx.testing.netns`), shared by the multi-host tests and
``bench/partitions.py``. Nothing in the library imports this package."""
