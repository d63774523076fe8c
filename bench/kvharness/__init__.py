"""What tests/ and bench/ share to drive a real daemon: no client library, no mocks.

- wire: the protocol's framing (a 4-byte big-endian length, then one msgpack value)
  and a blocking raw connection that can send anything at all, well formed or not.
- daemon: the real console entry point in a child process (a command line or a
  config file), waited for by ping, its log, stats and worker pids, stopped or killed.
- pagecache: files with real data, evicted (verified); heads pinned (mlocked) for a test;
  how much of a file the page cache holds, or held before the host reclaimed it
  (kernel_pages: the mmap, mlock, mincore and cachestat calls beneath it).

The daemon and the Python client keep their own framing: they are products with
their own distributions. This package is the third, independent implementation the
tests hold both against, and the floor the benchmarks measure them against.
Benchmarks import it from beside them (bench/ is on their path); pytest puts bench/
on sys.path through `pythonpath` in pyproject.toml.
"""
