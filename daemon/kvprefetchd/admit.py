"""Admission: which paths of a request go to which worker, and which are turned away.

A pure function over one batch of paths: confine each (the lexical gate, confine.py),
shard it to its worker (a stable hash, so each worker's dedup memory sees every request
for a path), and take a place in that worker's queue if it has room. A full queue drops
the file rather than making anyone wait. Nothing here touches a file system, a socket or
the books: the caller books what was admitted.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from kvprefetchd.confine import Roots


def shard_of(root_index: int, relative: bytes, workers: int) -> int:
    """The worker that owns a path: crc32 is stable across processes and restarts (unlike
    Python's salted hash()) and costs well under a microsecond for a path."""
    return zlib.crc32(relative, root_index) % workers


@dataclass(slots=True)
class Admission:
    """Per worker, the admitted files as channel entries [0, root_index, relative] (the
    ticket is 0 until the books issue one); and the files turned away."""

    entries: list[list[list[Any]]]
    dropped: int = 0
    refused: list[tuple[object, str]] = field(default_factory=list)  # (path, reason)
    dropped_paths: list[object] = field(default_factory=list)  # as given, for `failures`
    room: int = 0  # files an evenly sharded request may hold after these without a drop

    @property
    def accepted(self) -> int:
        return sum(len(share) for share in self.entries)

    @property
    def rejected(self) -> int:
        return len(self.refused)


def admit(paths: list[Any], roots: Roots, room: list[int]) -> Admission:
    """Place every path; `room[i]` is how many more files worker i may take (0: none, e.g.
    a worker that is being respawned). The hot loop of the request path: kept flat."""
    workers = len(room)
    left = list(room)
    entries: list[list[list[Any]]] = [[] for _ in range(workers)]
    refused: list[tuple[object, str]] = []
    dropped_paths: list[object] = []
    place = roots.place_canonical  # every spelling of a file: one shard, one dedup key
    for path in paths:
        placed = place(path)
        if isinstance(placed, str):
            refused.append((path, placed))
            continue
        root_index, relative = placed
        index = zlib.crc32(relative, root_index) % workers  # shard_of, inlined
        if left[index] <= 0:
            dropped_paths.append(path)
            continue
        left[index] -= 1
        entries[index].append([0, root_index, relative])
    # Room as a sender can use it: paths shard evenly, so the fullest worker's room, times
    # the workers, is what the next request may hold without a drop.
    return Admission(entries, len(dropped_paths), refused, dropped_paths,
                     max(min(left), 0) * workers if workers else 0)
