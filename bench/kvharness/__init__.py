"""What tests/ and bench/ share to drive a real daemon: no client library, no mocks.

- wire: the protocol's framing (a 4-byte big-endian length, then one msgpack value)
  and a blocking raw connection that can send anything at all, well formed or not.
- daemon: the real console entry point in a child process (a command line or a
  config file), waited for by ping, its log, stats and worker pids, stopped or killed.
- files: the one verified `write` (read back, size checked) and the one verified
  `evict` (DONTNEED until cachestat or mincore finds nothing), for one file or many.
- pagecache: heads pinned (mlocked) for a test; how much of a file the page cache holds,
  or held before the host reclaimed it (kernel_pages: the mmap, mlock, mincore and
  cachestat calls beneath it).
- fixtures: what test modules share beyond files (tests only: it imports pytest): the
  slow-tier simulator mounted or the test skipped, waits on state with a deadline, a
  request that must succeed, a reply whose books balance. The pytest fixtures
  themselves (`kv`, `tier_files`, `daemon_factory`) are in tests/conftest.py.

The daemon and the Python client keep their own framing: they are products with
their own distributions. This package is the third, independent implementation the
tests hold both against, and the floor the benchmarks measure them against.
Benchmarks import it from beside them (bench/ is on their path); pytest puts bench/
on sys.path through `pythonpath` in pyproject.toml.
"""
