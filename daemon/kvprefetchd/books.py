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

    def outcome_map(self) -> dict[str, int]:
        return {name: self.outcomes.get(name, 0) for name in OUTCOMES}


class Books:
    def __init__(self, workers: int) -> None:
        self._tickets = itertools.count(1)
        # ticket -> its waiter, kept per worker.
        self.open: list[dict[int, Waiter]] = [{} for _ in range(workers)]
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
        seen = {id(w): w for tickets in self.open for w in tickets.values()}
        return list(seen.values())

    def issue(self, worker: int, waiter: Waiter | None, entries: list[list[Any]]) -> None:
        """Book a worker's share of a request: entries are [ticket, root, relative] with
        ticket 0, given real tickets when a waiter follows them."""
        self.totals["accepted"] += len(entries)
        if waiter is None:
            self.anonymous[worker] += len(entries)
            return
        tickets = self.open[worker]
        for entry in entries:
            ticket = next(self._tickets)
            entry[0] = ticket
            tickets[ticket] = waiter
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

    def count_refused(self, waiter: Waiter | None, *, dropped: int, rejected: int) -> None:
        """Files dropped (queue full) or rejected before queuing: settled on the spot."""
        self.totals["dropped"] += dropped
        self.totals["rejected_by_supervisor"] += rejected
        if waiter is not None:
            waiter.dropped += dropped
            waiter.rejected += rejected

    def settle(self, worker: int, ticket: int, outcome: str, nbytes: int) -> Waiter | None:
        """Record one outcome; returns the waiter if this was its last outstanding file."""
        try:
            waiter = self.open[worker].pop(ticket)
        except KeyError:
            return None  # already failed when its worker died; a late answer changes nothing
        self.totals[outcome] += 1
        self.bytes_read += nbytes
        if waiter.answered:
            return None
        waiter.outcomes[outcome] += 1
        waiter.outstanding -= 1
        return waiter if waiter.outstanding == 0 else None

    def fail_worker(self, worker: int) -> list[Waiter]:
        """A worker died: its files are `failed`, never forgotten. Returns waiters now complete."""
        self.totals["failed"] += self.anonymous[worker]
        self.anonymous[worker] = 0
        done = []
        for ticket in list(self.open[worker]):
            waiter = self.settle(worker, ticket, "failed", 0)
            if waiter is not None:
                done.append(waiter)
        return done

    def expire(self, waiter: Waiter) -> None:
        """The deadline passed: what is still out is `expired` for this request.

        The tickets stay open so the totals still get their real outcome later;
        the waiter is answered and no longer counts them.
        """
        waiter.outcomes["expired"] += waiter.outstanding
        self.totals["expired_replies"] += waiter.outstanding
        waiter.outstanding = 0
