"""The supervisor's books: every file accepted gets exactly one outcome, per request and in total.

Pure bookkeeping, no sockets: each worker's share of a followed request (a Waiter) is
booked once, with its worker (so a dead worker's files can be failed) and its waiter (so
the reply can be sent once the last outcome is in, or the deadline passes). A file is
named by its ticket (the share's id and its index in it), which a worker reports it
with when it was not warmed; warmed files come back as counts per share, so a request's
books cost nothing per warm file. Fire-and-forget files need no share: a worker reports
their outcomes as counts.
Invariant, checked by tests: accepted = read + resident + missing + rejected + failed +
expired, per request and in total.
"""

from __future__ import annotations

import itertools
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvprefetchd.protocol import OUTCOMES
from kvprefetchd.reasons import reason_of, refusals
from kvprefetchd.supervisor.admit import Share

if TYPE_CHECKING:
    from kvprefetchd.kv import Profile


class ReplySink(Protocol):
    """Where a waiter's reply goes (a client connection); the books never touch it."""

    def send(self, message: dict[str, Any]) -> None: ...

    @property
    def client(self) -> int:
        """Who sent the request, as the queue engines tell clients apart."""


@dataclass(slots=True, eq=False)
class Waiter:
    """A request the supervisor follows until its files are settled or its deadline passes.

    `reply_to` is set for a `wait` request (the connection that waits); `profile` and
    `fingerprint` for a KV request, whose outcomes feed the stale-profile detector even
    when nobody waits for them. Answered once, in one place (ops.Ops.answer).
    """

    request_id: int
    started: float
    deadline: float | None
    reply_to: ReplySink | None = None
    reply_fields: dict[str, Any] = field(default_factory=dict)  # e.g. prefetch_blocks' files
    profile: Profile | None = None
    fingerprint: str = ""
    accepted: int = 0
    dropped: int = 0
    rejected: int = 0
    outstanding: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    answered: bool = False
    # The files that were not warmed, for the reply's `failures`: (where, outcome,
    # reason), where is the caller's path as str or bytes (refused by the supervisor)
    # or a tuple (root_index, relative) (settled by a worker). At most max_failures;
    # the rest are counted.
    max_failures: int = 100  # protocol.DEFAULT_MAX_FAILURES
    failures: list[tuple[Any, str, str]] = field(default_factory=list)
    failures_truncated: int = 0
    inspection: Inspection | None = None  # a check or evict request's figures

    def outcome_map(self) -> dict[str, int]:
        return {name: self.outcomes.get(name, 0) for name in OUTCOMES}

    def fail(self, where: Any, outcome: str, reason: str) -> None:
        if len(self.failures) < self.max_failures:
            self.failures.append((where, outcome, reason))
        else:
            self.failures_truncated += 1


@dataclass(slots=True, eq=False)
class Inspection:
    """What check and evict add up: files by state, bytes, and with `details` each file's
    [where, state, size, cached, tier, reason] (where as in Waiter.failures)."""

    details: bool
    evict: bool = False  # the reply counts evicted files
    states: Counter[str] = field(default_factory=Counter)
    size_bytes: int = 0
    resident_bytes: int = 0
    results: list[list[Any]] = field(default_factory=list)

    def add(self, where: Any, state: str, size: int, cached: int, tier: int,
            reason: str) -> None:
        self.states[state] += 1
        self.size_bytes += size
        self.resident_bytes += cached
        if self.details:
            self.results.append([where, state, size, cached, tier, reason])


# A ticket names one file of a followed request: its share's id in the high bits, its
# index in that share in the low ones. max_paths_per_request (at most 10^7) fits.
TICKET_INDEX_BITS = 24
TICKET_INDEX_MASK = (1 << TICKET_INDEX_BITS) - 1


def ticket_of(share_id: int, index: int) -> int:
    return share_id << TICKET_INDEX_BITS | index


@dataclass(slots=True, eq=False)
class Booked:
    """A followed request's share as one worker got it: its files are named by index
    (the worker settles each by its ticket, or a run of them in bulk)."""

    waiter: Waiter
    share: Share
    outstanding: int
    # What was settled, for a worker that dies with the rest: tickets' indexes one by
    # one, and the bulk reports' index arrays (uint32) as they came.
    settled_one: set[int] = field(default_factory=set)
    settled_bulk: list[bytes] = field(default_factory=list)
    _names: list[bytes] | None = None
    _roots: array[int] | None = None

    def where(self, index: int) -> tuple[int, bytes]:
        """(root_index, relative) of a file, for a failure or a check result."""
        if self._names is None:
            self._names = self.share.names()
            self._roots = self.share.root_indexes()
        assert self._roots is not None
        return (self._roots[index], self._names[index])

    def unsettled(self) -> list[int]:
        done = set(self.settled_one)
        for indexes in self.settled_bulk:
            done.update(array("I", indexes))
        return [index for index in range(self.share.count) if index not in done]


class Books:
    def __init__(self, workers: int) -> None:
        self._share_ids = itertools.count(1)
        # Per worker, share id -> its booked share, and the files still out in them.
        self.open: list[dict[int, Booked]] = [{} for _ in range(workers)]
        self.open_files: list[int] = [0] * workers
        # Fire-and-forget files need no ticket of their own: the worker reports their
        # outcomes as counts, and the books keep one number per worker. This halves
        # the supervisor's cost per file on the router's hot path.
        self.anonymous: list[int] = [0] * workers
        self.totals: Counter[str] = Counter()
        self.bytes_read = 0

    def outstanding(self, worker: int) -> int:
        return self.open_files[worker] + self.anonymous[worker]

    def in_flight(self) -> int:
        return sum(self.outstanding(worker) for worker in range(len(self.open)))

    def waiters(self) -> list[Waiter]:
        """Every waiter with a file still out (once each), for a drain."""
        seen = {id(b.waiter): b.waiter for shares in self.open for b in shares.values()}
        return list(seen.values())

    def issue(self, worker: int, waiter: Waiter | None, share: Share) -> int:
        """Book a worker's share of a request; its share id (0: fire and forget, whose
        files the worker reports as counts). A check or evict is no warm-up: its files
        are not in the totals."""
        if waiter is None:
            self.totals["accepted"] += share.count
            self.anonymous[worker] += share.count
            return 0
        if waiter.inspection is None:
            self.totals["accepted"] += share.count
        share_id = next(self._share_ids)
        self.open[worker][share_id] = Booked(waiter, share, share.count)
        self.open_files[worker] += share.count
        waiter.accepted += share.count
        waiter.outstanding += share.count
        return share_id

    def settle_anonymous(self, worker: int, outcomes: dict[str, int], nbytes: int) -> None:
        """Outcomes of fire-and-forget files, counted by the worker."""
        settled = 0
        for outcome, n in outcomes.items():
            self.totals[outcome] += n
            settled += n
        self.anonymous[worker] = max(0, self.anonymous[worker] - settled)
        self.bytes_read += nbytes

    def count_refused(self, waiter: Waiter | None, *, dropped: list[object],
                      rejected: list[tuple[object, str]]) -> None:
        """Files dropped (queue full) or rejected before queuing: settled on the spot."""
        if waiter is not None and waiter.inspection is not None:
            for path, state, reason in refusals(rejected, dropped):
                waiter.inspection.add(path, state, 0, 0, 0, reason)
            return
        self.totals["dropped"] += len(dropped)
        self.totals["rejected_by_supervisor"] += len(rejected)
        if waiter is not None:
            waiter.dropped += len(dropped)
            waiter.rejected += len(rejected)
            for failure in refusals(rejected, dropped):
                waiter.fail(*failure)

    def _take(self, worker: int, share_id: int, count: int) -> Booked | None:
        """`count` files of a share are settled: the share, or None when it is gone (its
        worker died and its files were failed: a late answer changes nothing)."""
        booked = self.open[worker].get(share_id)
        if booked is None:
            return None
        booked.outstanding -= count
        self.open_files[worker] -= count
        if booked.outstanding <= 0:
            del self.open[worker][share_id]
        return booked

    def settle_bulk(self, worker: int, share_id: int, outcome: str, count: int, nbytes: int,
                    indexes: bytes) -> Waiter | None:
        """`count` files of one share settled `read` or `resident` at once (their indexes
        as uint32, native order); the waiter if they were its last."""
        booked = self._take(worker, share_id, count)
        if booked is None:
            return None
        booked.settled_bulk.append(indexes)
        waiter = booked.waiter
        self.totals[outcome] += count
        self.bytes_read += nbytes
        if waiter.answered:
            return None
        waiter.outcomes[outcome] += count
        waiter.outstanding -= count
        return waiter if waiter.outstanding == 0 else None

    def settle(self, worker: int, record: list[Any]) -> Waiter | None:
        """Record one outcome, [ticket, outcome, bytes] or, for a file not warmed,
        [ticket, outcome, bytes, errno] (a check or evict: [ticket, state, 0, errno,
        size, cached, tier]); returns the waiter if this was its last outstanding file."""
        ticket = record[0]
        index = ticket & TICKET_INDEX_MASK
        booked = self._take(worker, ticket >> TICKET_INDEX_BITS, 1)
        if booked is None:
            return None
        booked.settled_one.add(index)
        waiter = booked.waiter
        outcome = record[1]
        inspection = waiter.inspection
        if inspection is None:
            self.totals[outcome] += 1
            self.bytes_read += record[2]
        if waiter.answered:
            return None
        if inspection is not None:
            err = record[3] if len(record) > 3 else 0
            size, cached, tier = record[4:7] if len(record) > 6 else (0, 0, 0)
            inspection.add(booked.where(index), outcome, size, cached, tier,
                           reason_of(outcome, err) if err or outcome == "failed" else "")
        else:
            waiter.outcomes[outcome] += 1
            if outcome != "read" and outcome != "resident":
                waiter.fail(booked.where(index), outcome,
                            reason_of(outcome, record[3] if len(record) > 3 else 0))
        waiter.outstanding -= 1
        return waiter if waiter.outstanding == 0 else None

    def fail_worker(self, worker: int) -> list[Waiter]:
        """A worker died: its files are `failed`, never forgotten. Returns waiters now complete."""
        self.totals["failed"] += self.anonymous[worker]
        self.anonymous[worker] = 0
        done = []
        for share_id, booked in list(self.open[worker].items()):
            for index in booked.unsettled():
                waiter = self.settle(worker, [ticket_of(share_id, index), "failed", 0])
                if waiter is not None:
                    done.append(waiter)
        self.open[worker].clear()
        self.open_files[worker] = 0
        return done

    def expire(self, waiter: Waiter) -> None:
        """The deadline passed: what is still out is `expired` for this request.

        The tickets stay open so the totals still get their real outcome later;
        the waiter is answered and no longer counts them.
        """
        waiter.outcomes["expired"] += waiter.outstanding
        if waiter.inspection is None:
            self.totals["expired_replies"] += waiter.outstanding
        else:
            waiter.inspection.states["expired"] += waiter.outstanding
        waiter.failures_truncated += waiter.outstanding  # still out: no path to list
        waiter.outstanding = 0
