"""Which worker owns a path.

A path must always land on the same worker so that each worker's dedup memory
sees every request for it; crc32 is stable across processes and restarts (unlike
Python's salted hash()) and costs well under a microsecond for a path.
"""

from __future__ import annotations

import zlib


def shard_of(root_index: int, relative: bytes, workers: int) -> int:
    return zlib.crc32(relative, root_index) % workers
