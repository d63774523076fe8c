"""A worker's memory of what it is reading now and what it warmed a moment ago.

The router sends the same prefix blocks over and over (every request of a
conversation shares them), so a bounded map of recently warmed heads saves the
open and the residency syscalls; a file queued or in flight collects the tickets
of later requests instead of being read twice.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

Key = tuple[int, bytes]

# What one remembered head costs beside its path's bytes (the key tuple, the entry
# tuple, the float, the ordered dict's slot), measured with sys.getsizeof on 3.11.
ENTRY_OVERHEAD_BYTES = 200


class RecentlyWarmed:
    """Heads warmed within `ttl` seconds, at most `capacity` of them and `budget_bytes` of
    memory (oldest forgotten first): paths may be up to max_path_bytes long, so a count
    alone bounds nothing (65,536 entries of 4 KiB paths are 256 MiB)."""

    def __init__(
        self, ttl: float, capacity: int, clock: Callable[[], float] = time.monotonic,
        budget_bytes: int = 16 << 20,
    ) -> None:
        self._ttl = ttl
        self._capacity = capacity
        self._budget = budget_bytes
        self._clock = clock
        self._entries: OrderedDict[Key, tuple[float, int]] = OrderedDict()
        self.bytes = 0  # what the entries cost, by ENTRY_OVERHEAD_BYTES + path bytes

    @property
    def enabled(self) -> bool:
        """False when nothing is ever remembered (dedup_ttl_ms 0, or no entries)."""
        return self._capacity > 0 and self._ttl > 0

    def remember(self, key: Key, read_bytes: int) -> None:
        if not self.enabled:
            return
        if key not in self._entries:
            self.bytes += len(key[1]) + ENTRY_OVERHEAD_BYTES
        self._entries[key] = (self._clock() + self._ttl, read_bytes)
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity or self.bytes > self._budget:
            self._forget(next(iter(self._entries)))

    def forget(self, key: Key) -> None:
        """An evicted file: the next request for it must look again."""
        if key in self._entries:
            self._forget(key)

    def _forget(self, key: Key) -> None:
        del self._entries[key]
        self.bytes -= len(key[1]) + ENTRY_OVERHEAD_BYTES

    def covers(self, key: Key, read_bytes: int) -> bool:
        """True when `key` was warmed at least `read_bytes` deep and the memory is still fresh."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        expires, warmed = entry
        if expires < self._clock():
            self._forget(key)
            return False
        return warmed >= read_bytes

    def __len__(self) -> int:
        return len(self._entries)


class InFlight:
    """Files queued or being read, each with the tickets waiting for its outcome.

    Keyed by read_bytes too, so a request for a deeper head is never answered by
    a shallower read. Bounded by construction: the supervisor never gives a
    worker more than its queue limit of tickets, and every key here holds one.
    """

    def __init__(self) -> None:
        self._waiting: dict[tuple[int, bytes, int], list[int]] = {}

    def join(self, key: Key, read_bytes: int, ticket: int) -> bool:
        """Attach a ticket; True when the file is new and must be queued for reading."""
        tickets = self._waiting.get((*key, read_bytes))
        if tickets is not None:
            tickets.append(ticket)
            return False
        self._waiting[(*key, read_bytes)] = [ticket]
        return True

    def finish(self, key: Key, read_bytes: int) -> list[int]:
        """The file is read (or found needing no read): the tickets that waited for it."""
        return self._waiting.pop((*key, read_bytes), [])

    def tickets(self) -> list[int]:
        """Every ticket still waiting, for a worker that must fail them all."""
        return [ticket for tickets in self._waiting.values() for ticket in tickets]

    def __len__(self) -> int:
        return len(self._waiting)
