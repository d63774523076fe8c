"""The supervisor's books: every file accepted gets exactly one outcome, per request and in total.

Pure bookkeeping, no sockets: a ticket per accepted file, remembered with its
worker (so a dead worker's files can be failed) and its waiting request (so the
reply can be sent once the last outcome is in, or the deadline passes).
Invariant, checked by tests: accepted = read + resident + missing + rejected +
failed + expired, per request and in total.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from kvprefetchd.protocol import OUTCOMES


@dataclass
class PendingRequest:
    """A `wait` request whose reply is held until its files are settled or it times out."""

    request_id: int
    reply_to: Callable[[PendingRequest], None]
    started: float
    deadline: float | None
    accepted: int = 0
    dropped: int = 0
    rejected: int = 0
    outstanding: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    answered: bool = False
    extra: dict[str, object] = field(default_factory=dict)

    def outcome_map(self) -> dict[str, int]:
        return {name: self.outcomes.get(name, 0) for name in OUTCOMES}


class Books:
    def __init__(self, workers: int) -> None:
        self._tickets = itertools.count(1)
        # ticket -> waiting request (None for fire-and-forget), kept per worker.
        self.open: list[dict[int, PendingRequest]] = [{} for _ in range(workers)]
        # Fire-and-forget files need no ticket of their own: the worker reports their
        # outcomes as counts, and the books keep one number per worker. This halves
        # the supervisor's cost per file on the router's hot path.
        self.anonymous: list[int] = [0] * workers
        self.totals: Counter[str] = Counter()
        self.bytes_read = 0

    def outstanding(self, worker: int) -> int:
        return len(self.open[worker]) + self.anonymous[worker]

    def issue(self, worker: int, request: PendingRequest | None) -> int:
        """A ticket for a file of a waiting request; 0 for a fire-and-forget one."""
        self.totals["accepted"] += 1
        if request is None:
            self.anonymous[worker] += 1
            return 0
        ticket = next(self._tickets)
        self.open[worker][ticket] = request
        request.accepted += 1
        request.outstanding += 1
        return ticket

    def issue_anonymous(self, worker: int, n: int) -> None:
        """n fire-and-forget files at once (what `issue(worker, None)` does n times)."""
        self.totals["accepted"] += n
        self.anonymous[worker] += n

    def settle_anonymous(self, worker: int, outcomes: dict[str, int], nbytes: int) -> None:
        """Outcomes of fire-and-forget files, counted by the worker."""
        settled = 0
        for outcome, n in outcomes.items():
            self.totals[outcome] += n
            settled += n
        self.anonymous[worker] = max(0, self.anonymous[worker] - settled)
        self.bytes_read += nbytes

    def count_refused(self, kind: str, request: PendingRequest | None, n: int = 1) -> None:
        """Files dropped (queue full) or rejected before queuing: settled on the spot."""
        self.totals["rejected_by_supervisor" if kind == "rejected" else kind] += n
        if request is not None:
            setattr(request, kind, getattr(request, kind) + n)

    def settle(self, worker: int, ticket: int, outcome: str, nbytes: int) -> PendingRequest | None:
        """Record one outcome; returns the request if this was its last outstanding file."""
        try:
            request = self.open[worker].pop(ticket)
        except KeyError:
            return None  # already failed when its worker died; a late answer changes nothing
        self.totals[outcome] += 1
        self.bytes_read += nbytes
        if request.answered:
            return None
        request.outcomes[outcome] += 1
        request.outstanding -= 1
        return request if request.outstanding == 0 else None

    def fail_worker(self, worker: int) -> list[PendingRequest]:
        """A worker died: its files are `failed`, never forgotten. Returns requests now complete."""
        self.totals["failed"] += self.anonymous[worker]
        self.anonymous[worker] = 0
        tickets = list(self.open[worker])
        done = []
        for ticket in tickets:
            request = self.settle(worker, ticket, "failed", 0)
            if request is not None:
                done.append(request)
        return done

    def expire(self, request: PendingRequest) -> None:
        """The deadline passed: what is still out is `expired` for this request.

        The tickets stay open so the totals still get their real outcome later;
        the request is marked answered and no longer counts them.
        """
        request.outcomes["expired"] += request.outstanding
        self.totals["expired_replies"] += request.outstanding
        request.outstanding = 0
