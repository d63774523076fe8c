"""The supervisor's books: every file accepted gets exactly one outcome, per request and in total.

Pure bookkeeping, no sockets: a ticket per accepted file of a followed request (a
Waiter), remembered with its worker (so a dead worker's files can be failed) and its
waiter (so the reply can be sent once the last outcome is in, or the deadline passes).
Fire-and-forget files need no ticket: a worker reports their outcomes as counts.
Invariant, checked by tests: accepted = read + resident + missing + rejected + failed +
expired, per request and in total.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvprefetchd.protocol import OUTCOMES
from kvprefetchd.reasons import reason_of, refusals

if TYPE_CHECKING:
    from kvprefetchd.kv import Profile


class ReplySink(Protocol):
    """Where a waiter's reply goes (a client connection); the books never touch it."""

    def send(self, message: dict[str, Any]) -> None: ...


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


class Books:
    def __init__(self, workers: int) -> None:
        self._tickets = itertools.count(1)
        # ticket -> its waiter and its channel entry [ticket, root_index, relative] (the
        # file's name, should it fail), kept per worker.
        self.open: list[dict[int, tuple[Waiter, list[Any]]]] = [{} for _ in range(workers)]
        # Fire-and-forget files need no ticket of their own: the worker reports their
        # outcomes as counts, and the books keep one number per worker. This halves
        # the supervisor's cost per file on the router's hot path.
        self.anonymous: list[int] = [0] * workers
        self.totals: Counter[str] = Counter()
        self.bytes_read = 0

    def outstanding(self, worker: int) -> int:
        return len(self.open[worker]) + self.anonymous[worker]

    def in_flight(self) -> int:
        return sum(self.outstanding(worker) for worker in range(len(self.open)))

    def waiters(self) -> list[Waiter]:
        """Every waiter with a file still out (once each), for a drain."""
        seen = {id(w): w for tickets in self.open for w, _ in tickets.values()}
        return list(seen.values())

    def issue(self, worker: int, waiter: Waiter | None, entries: list[list[Any]]) -> None:
        """Book a worker's share of a request: entries are [ticket, root, relative] with
        ticket 0, given real tickets when a waiter follows them. A check or evict is no
        warm-up: its files are not in the totals."""
        if waiter is None:
            self.totals["accepted"] += len(entries)
            self.anonymous[worker] += len(entries)
            return
        if waiter.inspection is None:
            self.totals["accepted"] += len(entries)
        tickets = self.open[worker]
        for entry in entries:
            ticket = next(self._tickets)
            entry[0] = ticket
            tickets[ticket] = (waiter, entry)
        waiter.accepted += len(entries)
        waiter.outstanding += len(entries)

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

    def settle(self, worker: int, record: list[Any]) -> Waiter | None:
        """Record one outcome, [ticket, outcome, bytes] or, for a file not warmed,
        [ticket, outcome, bytes, errno] (a check or evict: [ticket, state, 0, errno,
        size, cached, tier]); returns the waiter if this was its last outstanding file."""
        try:
            waiter, entry = self.open[worker].pop(record[0])
        except KeyError:
            return None  # already failed when its worker died; a late answer changes nothing
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
            inspection.add((entry[1], entry[2]), outcome, size, cached, tier,
                           reason_of(outcome, err) if err or outcome == "failed" else "")
        else:
            waiter.outcomes[outcome] += 1
            if outcome != "read" and outcome != "resident":
                waiter.fail((entry[1], entry[2]), outcome,
                            reason_of(outcome, record[3] if len(record) > 3 else 0))
        waiter.outstanding -= 1
        return waiter if waiter.outstanding == 0 else None

    def fail_worker(self, worker: int) -> list[Waiter]:
        """A worker died: its files are `failed`, never forgotten. Returns waiters now complete."""
        self.totals["failed"] += self.anonymous[worker]
        self.anonymous[worker] = 0
        done = []
        for ticket in list(self.open[worker]):
            waiter = self.settle(worker, [ticket, "failed", 0])
            if waiter is not None:
                done.append(waiter)
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
