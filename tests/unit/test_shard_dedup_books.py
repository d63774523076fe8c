"""Admission and sharding, the worker's dedup memory and the supervisor's books: pure logic."""

from __future__ import annotations

import os
import subprocess
import sys
from array import array
from collections import Counter
from typing import Any

from kvprefetchd.channel import UNFOLLOWED, Bulk, Settled, Share, ticket_of
from kvprefetchd.roots.confine import Roots
from kvprefetchd.supervisor.admit import admit, shard_of
from kvprefetchd.supervisor.books import Books, Waiter
from kvprefetchd.worker.dedup import InFlight, RecentlyWarmed


def test_shard_is_stable_across_processes() -> None:
    names = [f"{i:064x}.bin".encode() for i in range(50)]
    here = [shard_of(0, name, 7) for name in names]
    code = (
        "from kvprefetchd.supervisor.admit import shard_of;"
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
    assert flight.finish((0, b"a"), 4096) == [1, 2]
    assert flight.finish((0, b"a"), 8192) == [3]
    assert len(flight) == 0


def test_admit_confines_shards_and_drops_past_the_room() -> None:
    roots = Roots(("/kv",), 4096)
    paths: list[Any] = [f"/kv/{i}.bin" for i in range(10)] + ["/etc/passwd", "/kv/../x", 7]
    room = [3, 100]
    admission = admit(paths, roots, room)
    assert room == [3, 100]  # pure: the caller's figures are not touched
    assert admission.rejected == 3
    assert [reason for _, reason in admission.rejected_paths] == [
        "outside_roots", "dotdot", "not_a_path",
    ]
    expected = [sum(1 for i in range(10) if shard_of(0, f"{i}.bin".encode(), 2) == w)
                for w in (0, 1)]
    counts = [share.count if share else 0 for share in admission.shares]
    assert counts == [min(3, expected[0]), expected[1]]
    assert admission.dropped == expected[0] - min(3, expected[0])
    assert admission.accepted + admission.dropped + admission.rejected == len(paths)
    for worker, share in enumerate(admission.shares):
        assert share is not None
        assert list(share.root_indexes()) == [0] * share.count
        assert all(shard_of(0, relative, 2) == worker for relative in share.names())


def entries(n: int) -> Share:
    return Share.of([0] * n, [f"{i}.bin".encode() for i in range(n)])


def waiter() -> Waiter:
    return Waiter(1, started=0.0, deadline=None)


def balanced(request: Waiter) -> bool:
    return request.accepted == sum(request.outcome_map().values())


def settle(books: Books, worker: int, ticket: int, outcome: str, nbytes: int = 0,
           error: int = 0) -> Waiter | None:
    """One file's outcome as a worker reports it; the waiter it completed, if any."""
    settled, complete = Settled(), []
    settled.add(ticket, outcome, nbytes, error)
    books.settle(worker, settled, complete)
    assert len(complete) <= 1
    return complete[0] if complete else None


def bulk(share_id: int, outcome: str, indexes: list[int], nbytes: int = 0) -> Bulk:
    return Bulk(share_id, outcome, len(indexes), nbytes, array("I", indexes))


def test_books_complete_a_waiter_once_its_last_file_settles() -> None:
    books = Books(workers=2)
    request = waiter()
    first = books.issue(0, request, entries(1))
    second = books.issue(1, request, entries(2))
    assert first and second and first != second  # each share booked under its own id
    books.count_turned_away(request, dropped=["/kv/x", "/kv/y"], rejected=[])
    assert settle(books, 0, ticket_of(first, 0), "read", 4096) is None
    assert books.settle_bulk(1, bulk(second, "resident", [0, 1])) is request
    assert request.outcome_map()["read"] == 1 and request.dropped == 2
    assert balanced(request) and books.bytes_read == 4096
    assert request.failures == [("/kv/x", "dropped", "dropped_queue_full"),
                                ("/kv/y", "dropped", "dropped_queue_full")]


def test_books_name_why_each_waited_file_failed_up_to_the_limit() -> None:
    books = Books(workers=1)
    request = waiter()
    request.max_failures = 2
    share_id = books.issue(0, request, entries(4))
    settled, complete = Settled(), []
    settled.add_run(share_id, [0], "missing", 2)
    settled.add(ticket_of(share_id, 1), "rejected", 0, 18)
    settled.add(ticket_of(share_id, 2), "expired")
    settled.add(ticket_of(share_id, 3), "read", 4096)
    books.settle(0, settled, complete)
    assert complete == [request]
    assert request.failures == [((0, b"0.bin"), "missing", "ENOENT"),
                                ((0, b"1.bin"), "rejected", "symlink_escape")]
    assert request.failures_truncated == 1 and balanced(request)
    assert books.totals["expired"] == 1


def test_books_fail_a_dead_workers_files() -> None:
    books = Books(workers=2)
    request = waiter()
    mine = books.issue(0, request, entries(5))
    other = books.issue(1, request, entries(1))
    settle(books, 1, ticket_of(other, 0), "read", 1)
    books.settle_bulk(0, bulk(mine, "resident", [1, 3]))
    settle(books, 0, ticket_of(mine, 4), "missing", 0, 2)
    assert books.fail_worker(0) == [request]
    assert request.outcome_map()["failed"] == 2 and balanced(request)
    # The files still out are named: not the ones settled in bulk or one by one.
    assert sorted(f[0] for f in request.failures if f[2] == "worker_lost") == [
        (0, b"0.bin"), (0, b"2.bin")]
    assert books.outstanding(0) == 0
    assert settle(books, 0, ticket_of(mine, 0), "read", 1) is None  # a late answer: nothing


def test_books_expire_keeps_totals_honest() -> None:
    books = Books(workers=1)
    request = waiter()
    share_id = books.issue(0, request, entries(2))
    settle(books, 0, ticket_of(share_id, 0), "read", 10)
    books.expire(request)
    request.answered = True
    assert request.outcome_map()["expired"] == 1 and balanced(request)
    books.settle_bulk(0, bulk(share_id, "read", [1], 10))
    assert books.totals["read"] == 2 and books.outstanding(0) == 0
    assert books.waiters() == []


def test_unfollowed_files_are_counted_without_tickets() -> None:
    books = Books(workers=2)
    assert books.issue(1, None, entries(5)) == UNFOLLOWED
    assert books.outstanding(1) == 5 and books.outstanding(0) == 0
    books.settle_unfollowed(1, {"read": 2, "missing": 1}, 8192)
    assert books.outstanding(1) == 2
    assert (books.totals["read"], books.totals["missing"], books.bytes_read) == (2, 1, 8192)
    books.fail_worker(1)
    assert books.outstanding(1) == 0 and books.totals["failed"] == 2
    settled = sum(books.totals[k] for k in ("read", "missing", "failed"))
    assert books.totals["accepted"] == settled
