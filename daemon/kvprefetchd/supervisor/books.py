"""The supervisor's books: every file accepted gets exactly one outcome, per request and in total.

Pure bookkeeping, no sockets: each worker's share of a followed request (a Waiter) is
booked once, with its worker (so a dead worker's files can be failed) and its waiter (so
the reply can be sent once the last outcome is in, or the deadline passes). A file is
named by its ticket (channel.ticket_of: the share's id and its index in it), which a
worker reports it with when it was not warmed (channel.Settled, channel.Looked); warmed
files come back as counts per share (channel.Bulk), so a request's books cost nothing
per warm file. Unfollowed files (a fire-and-forget request's) need no share: a worker
reports their outcomes as counts. To settle a file is to book its one outcome.
Invariant, checked by tests: accepted = read + resident + missing + rejected + failed +
expired, per request and in total.
"""

from __future__ import annotations

import itertools
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvprefetchd.channel import (
    UNFOLLOWED,
    Bulk,
    Done,
    Looked,
    Settled,
    Share,
    index_of,
    share_id_of,
)
from kvprefetchd.protocol import DEFAULT_MAX_FAILURES, OUTCOMES
from kvprefetchd.reasons import reason_of, turned_away

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
    max_failures: int = DEFAULT_MAX_FAILURES
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


@dataclass(slots=True, eq=False)
class Booked:
    """A followed request's share as one worker got it: its files are named by index
    (the worker settles each by its ticket, or a run of them in bulk)."""

    waiter: Waiter
    share: Share
    outstanding: int
    # What was settled, for a worker that dies with the rest: tickets' indexes one by
    # one, and the bulk reports' index arrays as they came.
    settled_one: set[int] = field(default_factory=set)
    settled_bulk: list[array[int]] = field(default_factory=list)
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
            done.update(indexes)
        return [index for index in range(self.share.count) if index not in done]


class Books:
    def __init__(self, workers: int) -> None:
        self._share_ids = itertools.count(1)
        # Per worker, share id -> its booked share, and the files still out in them.
        self.open: list[dict[int, Booked]] = [{} for _ in range(workers)]
        self.open_files: list[int] = [0] * workers
        # Unfollowed files need no ticket of their own: the worker reports their
        # outcomes as counts, and the books keep one number per worker. This halves
        # the supervisor's cost per file on the router's hot path.
        self.unfollowed: list[int] = [0] * workers
        self.totals: Counter[str] = Counter()
        self.bytes_read = 0

    def outstanding(self, worker: int) -> int:
        return self.open_files[worker] + self.unfollowed[worker]

    def in_flight(self) -> int:
        return sum(self.outstanding(worker) for worker in range(len(self.open)))

    def waiters(self) -> list[Waiter]:
        """Every waiter with a file still out (once each), for a drain."""
        seen = {id(b.waiter): b.waiter for shares in self.open for b in shares.values()}
        return list(seen.values())

    def issue(self, worker: int, waiter: Waiter | None, share: Share) -> int:
        """Book a worker's share of a request; its share id (UNFOLLOWED when nobody
        follows it: the worker reports its files as counts). A check or evict is no
        warm-up: its files are not in the totals."""
        if waiter is None:
            self.totals["accepted"] += share.count
            self.unfollowed[worker] += share.count
            return UNFOLLOWED
        if waiter.inspection is None:
            self.totals["accepted"] += share.count
        share_id = next(self._share_ids)
        self.open[worker][share_id] = Booked(waiter, share, share.count)
        self.open_files[worker] += share.count
        waiter.accepted += share.count
        waiter.outstanding += share.count
        return share_id

    def settle_unfollowed(self, worker: int, outcomes: dict[str, int], nbytes: int) -> None:
        """Outcomes of unfollowed files, counted by the worker."""
        settled = 0
        for outcome, n in outcomes.items():
            self.totals[outcome] += n
            settled += n
        self.unfollowed[worker] = max(0, self.unfollowed[worker] - settled)
        self.bytes_read += nbytes

    def count_turned_away(self, waiter: Waiter | None, *, dropped: list[object],
                      rejected: list[tuple[object, str]]) -> None:
        """Files dropped (queue full) or rejected before queuing: settled on the spot."""
        if waiter is not None and waiter.inspection is not None:
            for path, state, reason in turned_away(rejected, dropped):
                waiter.inspection.add(path, state, 0, 0, 0, reason)
            return
        self.totals["dropped"] += len(dropped)
        self.totals["rejected_by_supervisor"] += len(rejected)
        if waiter is not None:
            waiter.dropped += len(dropped)
            waiter.rejected += len(rejected)
            for failure in turned_away(rejected, dropped):
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

    def settle_report(self, worker: int, report: Done, complete: list[Waiter]) -> None:
        """Every file a worker's report settles; a waiter whose last file was among them
        goes in `complete`."""
        if report.settled:
            self.settle(worker, report.settled, complete)
        if report.looked:
            self.settle_looked(worker, report.looked, complete)
        for bulk in report.bulk:
            waiter = self.settle_bulk(worker, bulk)
            if waiter is not None:
                complete.append(waiter)
        self.settle_unfollowed(worker, report.unfollowed, report.unfollowed_bytes)

    def settle_bulk(self, worker: int, bulk: Bulk) -> Waiter | None:
        """Files of one share settled `read` or `resident` at once; the waiter if they
        were its last."""
        count, outcome = bulk.count, bulk.outcome
        booked = self._take(worker, bulk.share_id, count)
        if booked is None:
            return None
        booked.settled_bulk.append(bulk.indexes)
        waiter = booked.waiter
        self.totals[outcome] += count
        self.bytes_read += bulk.nbytes
        if waiter.answered:
            return None
        waiter.outcomes[outcome] += count
        waiter.outstanding -= count
        return waiter if waiter.outstanding == 0 else None

    def settle(self, worker: int, settled: Settled, complete: list[Waiter]) -> None:
        """Followed files not warmed, each with its outcome and errno; a waiter whose
        last file this was goes in `complete`."""
        for ticket, outcome, nbytes, error in zip(settled.tickets, settled.outcomes,
                                                  settled.nbytes, settled.errnos, strict=True):
            waiter = self._settle_one(worker, share_id_of(ticket), index_of(ticket), outcome,
                                      nbytes, error)
            if waiter is not None:
                complete.append(waiter)

    def settle_looked(self, worker: int, looked: Looked, complete: list[Waiter]) -> None:
        """Files a check or an evict looked at, each in its state with its figures."""
        for ticket, state, error, size, cached, tier in zip(
                looked.tickets, looked.states, looked.errnos, looked.sizes, looked.cached,
                looked.tiers, strict=True):
            waiter = self._settle_one(worker, share_id_of(ticket), index_of(ticket), state, 0,
                                      error, size, cached, tier)
            if waiter is not None:
                complete.append(waiter)

    def _settle_one(self, worker: int, share_id: int, index: int, outcome: str, nbytes: int,
                    error: int, size: int = 0, cached: int = 0, tier: int = 0) -> Waiter | None:
        """Book one file's outcome (a check or evict's: its state and figures); the waiter
        if this was its last outstanding file."""
        booked = self._take(worker, share_id, 1)
        if booked is None:
            return None
        booked.settled_one.add(index)
        waiter = booked.waiter
        inspection = waiter.inspection
        if inspection is None:
            self.totals[outcome] += 1
            self.bytes_read += nbytes
        if waiter.answered:
            return None
        if inspection is not None:
            inspection.add(booked.where(index), outcome, size, cached, tier,
                           reason_of(outcome, error) if error or outcome == "failed" else "")
        else:
            waiter.outcomes[outcome] += 1
            if outcome != "read" and outcome != "resident":
                waiter.fail(booked.where(index), outcome, reason_of(outcome, error))
        waiter.outstanding -= 1
        return waiter if waiter.outstanding == 0 else None

    def fail_worker(self, worker: int) -> list[Waiter]:
        """A worker died: its files are `failed`, never forgotten. Returns waiters now complete."""
        self.totals["failed"] += self.unfollowed[worker]
        self.unfollowed[worker] = 0
        done = []
        for share_id, booked in list(self.open[worker].items()):
            for index in booked.unsettled():
                waiter = self._settle_one(worker, share_id, index, "failed", 0, 0)
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
