"""Sharding, the worker's dedup memory and the supervisor's books: pure logic."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

from kvprefetchd.books import Books, PendingRequest
from kvprefetchd.dedup import InFlight, RecentlyWarmed
from kvprefetchd.shard import shard_of


def test_shard_is_stable_across_processes() -> None:
    names = [f"{i:064x}.bin".encode() for i in range(50)]
    here = [shard_of(0, name, 7) for name in names]
    code = (
        "from kvprefetchd.shard import shard_of;"
        f"print([shard_of(0, n, 7) for n in {names!r}])"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert str(here) == there.strip()


def test_shard_spreads_paths_evenly() -> None:
    counts = Counter(shard_of(0, f"a/{i:x}.bin".encode(), 4) for i in range(40_000))
    assert set(counts) == {0, 1, 2, 3}
    assert max(counts.values()) < 1.05 * min(counts.values())


def test_recently_warmed_expires_and_is_bounded() -> None:
    now = [100.0]
    recent = RecentlyWarmed(ttl=1.0, capacity=3, clock=lambda: now[0])
    recent.remember((0, b"a"), 4096)
    assert recent.covers((0, b"a"), 4096)
    assert not recent.covers((0, b"a"), 8192)  # a deeper head than was warmed
    now[0] += 1.5
    assert not recent.covers((0, b"a"), 4096)
    for name in (b"b", b"c", b"d", b"e"):
        recent.remember((0, name), 1)
    assert len(recent) == 3 and not recent.covers((0, b"b"), 1)


def test_recently_warmed_disabled_by_zero_ttl() -> None:
    recent = RecentlyWarmed(ttl=0, capacity=10)
    recent.remember((0, b"a"), 1)
    assert not recent.covers((0, b"a"), 1)


def test_in_flight_collects_tickets_per_depth() -> None:
    flight = InFlight()
    assert flight.join((0, b"a"), 4096, 1)
    assert not flight.join((0, b"a"), 4096, 2)
    assert flight.join((0, b"a"), 8192, 3)  # deeper: its own read
    assert sorted(flight.tickets()) == [1, 2, 3]
    assert flight.settle((0, b"a"), 4096) == [1, 2]
    assert flight.settle((0, b"a"), 8192) == [3]
    assert len(flight) == 0


def pending(replies: list[PendingRequest]) -> PendingRequest:
    return PendingRequest(1, replies.append, started=0.0, deadline=None)


def balanced(request: PendingRequest) -> bool:
    return request.accepted == sum(request.outcome_map().values())


def test_books_answer_a_request_once_its_last_file_settles() -> None:
    books = Books(workers=2)
    replies: list[PendingRequest] = []
    request = pending(replies)
    t1, t2 = books.issue(0, request), books.issue(1, request)
    books.count_refused("dropped", request, 2)
    assert books.settle(0, t1, "read", 4096) is None
    assert books.settle(1, t2, "resident", 0) is request
    assert request.outcome_map()["read"] == 1 and request.dropped == 2
    assert balanced(request) and books.bytes_read == 4096


def test_books_fail_a_dead_workers_files() -> None:
    books = Books(workers=2)
    request = pending([])
    tickets = [books.issue(0, request) for _ in range(3)] + [books.issue(1, request)]
    books.settle(1, tickets[-1], "read", 1)
    assert books.fail_worker(0) == [request]
    assert request.outcome_map()["failed"] == 3 and balanced(request)
    assert books.outstanding(0) == 0
    assert books.settle(0, tickets[0], "read", 1) is None  # a late answer changes nothing


def test_books_expire_keeps_totals_honest() -> None:
    books = Books(workers=1)
    request = pending([])
    tickets = [books.issue(0, request) for _ in range(2)]
    books.settle(0, tickets[0], "read", 10)
    books.expire(request)
    request.answered = True
    assert request.outcome_map()["expired"] == 1 and balanced(request)
    books.settle(0, tickets[1], "read", 10)
    assert books.totals["read"] == 2 and books.outstanding(0) == 0


def test_fire_and_forget_files_are_counted_without_tickets() -> None:
    books = Books(workers=2)
    assert [books.issue(1, None) for _ in range(5)] == [0] * 5
    assert books.outstanding(1) == 5 and books.outstanding(0) == 0
    books.settle_anonymous(1, {"read": 2, "missing": 1}, 8192)
    assert books.outstanding(1) == 2
    assert (books.totals["read"], books.totals["missing"], books.bytes_read) == (2, 1, 8192)
    books.fail_worker(1)
    assert books.outstanding(1) == 0 and books.totals["failed"] == 2
    settled = sum(books.totals[k] for k in ("read", "missing", "failed"))
    assert books.totals["accepted"] == settled
