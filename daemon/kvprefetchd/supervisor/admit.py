"""Admission: which paths of a request go to which worker, and which are turned away.

Confine each path (the lexical gate, confine.py), shard it to its worker (a stable hash,
so each worker's dedup memory sees every request for a path), and take a place in that
worker's queue if it has room. A full queue drops the file rather than making anyone
wait. Nothing here touches a file system, a socket or the books: the caller books what
was admitted.

Each worker's part leaves as a `Share` (channel.py: two buffers, root indexes and
NUL-ended names), which is what its channel message carries, so no Python object is made
per path on the way. The `Admitter` does a request of plain str paths in one native call
(native/admit.c); any other request (bin paths, non-path values, a NUL inside a name)
goes through `admit`, the Python gate, which is the reference the native one is tested
against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvprefetchd.channel import Share
from kvprefetchd.native import load_native
from kvprefetchd.roots.confine import Roots

_shard = load_native().lib.kvp_shard


def shard_of(root_index: int, relative: bytes, workers: int) -> int:
    """The worker that owns a path (native/admit.c's kvp_shard): stable across processes
    and restarts, unlike Python's salted hash(), so each worker's memory of recent reads
    sees every request for its files."""
    return int(_shard(root_index, relative, len(relative), workers))


@dataclass(slots=True)
class Admission:
    """Per worker, its share of the admitted files (None: none); and the files turned
    away."""

    shares: list[Share | None]
    accepted: int = 0
    dropped: int = 0
    rejected_paths: list[tuple[object, str]] = field(default_factory=list)  # (path, reason)
    dropped_paths: list[object] = field(default_factory=list)  # as given, for `failures`
    room: int = 0  # files an evenly sharded request may hold after these without a drop

    @property
    def rejected(self) -> int:
        return len(self.rejected_paths)


def room_left(left: list[int]) -> int:
    """Room as a sender can use it: paths shard evenly, so the fullest worker's room,
    times the workers, is what the next request may hold without a drop."""
    return max(min(left), 0) * len(left) if left else 0


def admit(paths: list[Any], roots: Roots, room: list[int]) -> Admission:
    """Place every path; `room[i]` is how many more files worker i may take (0: none, e.g.
    a worker that is being respawned). The Python gate: any request, every reason."""
    workers = len(room)
    left = list(room)
    names: list[list[bytes]] = [[] for _ in range(workers)]
    indexes: list[list[int]] = [[] for _ in range(workers)]
    refused: list[tuple[object, str]] = []
    dropped_paths: list[object] = []
    place = roots.place_canonical  # every spelling of a file: one shard, one dedup key
    for path in paths:
        placed = place(path)
        if isinstance(placed, str):
            refused.append((path, placed))
            continue
        root_index, relative = placed
        index = shard_of(root_index, relative, workers)
        if left[index] <= 0:
            dropped_paths.append(path)
            continue
        left[index] -= 1
        names[index].append(relative)
        indexes[index].append(root_index)
    shares = [Share.of(indexes[w], names[w]) if names[w] else None for w in range(workers)]
    accepted = sum(len(share) for share in names)
    return Admission(shares, accepted, len(dropped_paths), refused, dropped_paths,
                     room_left(left))


class Admitter:
    """Admission for one daemon's roots and workers: native where it can be."""

    def __init__(self, roots: Roots, workers: int) -> None:
        self.roots = roots
        self._native = load_native()
        ffi, lib = self._native.ffi, self._native.lib
        prefixes = roots.prefixes()
        blob = b"".join(prefix + b"\0" for prefix, _ in prefixes)
        order = ffi.new("uint16_t[]", [index for _, index in prefixes] or [0])
        admission = lib.kvp_admission_new(blob, order, len(prefixes), roots.max_path_bytes,
                                          workers)
        if admission == ffi.NULL:
            raise MemoryError("kvp_admission_new")
        self._admission = ffi.gc(admission, lib.kvp_admission_free)
        self._reasons = {getattr(lib, name): name.removeprefix("KVP_ADMIT_").lower()
                         for name in dir(lib) if name.startswith("KVP_ADMIT_")}
        self._paths = ffi.new("char **")
        self._paths_len = ffi.new("size_t *")
        self._share_roots = ffi.new("uint16_t **")
        self.native_requests = 0  # requests admitted natively, for tests and stats

    def admit(self, paths: list[Any], room: list[int]) -> Admission:
        if not paths:
            return Admission([None] * len(room), room=room_left(room))
        try:
            blob = "\0".join(paths).encode()
        except (TypeError, UnicodeEncodeError):
            return admit(paths, self.roots, room)  # bin paths or non-path values
        ffi, lib = self._native.ffi, self._native.lib
        left = ffi.new("int64_t[]", room)
        status = bytearray(len(paths))
        accepted = lib.kvp_admit(self._admission, blob, len(blob), len(paths), left,
                                 ffi.from_buffer(status))
        if accepted < 0:
            return admit(paths, self.roots, room)  # a NUL inside a name; out of memory
        self.native_requests += 1
        shares: list[Share | None] = []
        for worker in range(len(room)):
            count = lib.kvp_admission_share(self._admission, worker, self._paths,
                                            self._paths_len, self._share_roots)
            shares.append(Share(ffi.buffer(self._share_roots[0], Share.roots_size(count))[:],
                                ffi.buffer(self._paths[0], self._paths_len[0])[:])
                          if count else None)
        admission = Admission(shares, accepted, room=room_left(list(left)))
        if accepted < len(paths):
            dropped = lib.KVP_ADMIT_DROPPED
            for index, code in enumerate(status):
                if code == dropped:
                    admission.dropped_paths.append(paths[index])
                elif code:
                    admission.rejected_paths.append((paths[index], self._reasons[code]))
            admission.dropped = len(admission.dropped_paths)
        return admission
