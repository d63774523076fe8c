"""What a worker owes the supervisor: every file's outcome since its last report.

A followed file that was warmed goes in its share's Bulk (a count and an index), one
that was not in the Settled columns with its errno (the reply names it and says why), a
file a check or evict looked at in the Looked columns, and an unfollowed file only in a
count per outcome. `done` turns it all into one Done and starts afresh; a worker sends
it, and all it sends, with `send_all_blocking`.
"""

from __future__ import annotations

import select
import socket
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from kvprefetchd.channel import (
    UNFOLLOWED,
    Bulk,
    Done,
    Looked,
    Message,
    Settled,
    Verdict,
    encode,
    index_of,
    share_id_of,
)
from kvprefetchd.engines.base import Engine
from kvprefetchd.engines.queue import QueueEngine
from kvprefetchd.metrics.histogram import FILE_BUCKETS, Histogram

WARM = ("read", "resident")  # the outcomes reported in bulk


class Report:
    def __init__(self) -> None:
        self.settled = Settled()
        self.looked = Looked()
        self.bulk: dict[tuple[int, str], Bulk] = {}  # by (share id, outcome)
        self.unfollowed: Counter[str] = Counter()
        self.unfollowed_bytes = 0
        self.latency = Histogram(FILE_BUCKETS)  # per file

    @property
    def owed(self) -> bool:
        """Whether any file was settled since the last Done."""
        return bool(self.settled or self.looked or self.bulk or self.unfollowed)

    def settle(self, ticket: int, outcome: str, nbytes: int, error: int = 0) -> None:
        """One file's outcome, by its ticket (UNFOLLOWED: a count)."""
        if ticket == UNFOLLOWED:
            self.unfollowed[outcome] += 1
            self.unfollowed_bytes += nbytes
        elif outcome in WARM:
            self.bulk_of(share_id_of(ticket), outcome).add_one(index_of(ticket), nbytes)
        else:
            self.settled.add(ticket, outcome, nbytes, error)

    def settle_all(self, share_id: int, indexes: Sequence[int], outcome: str,
                   error: int = 0) -> None:
        """`outcome` for these files of one share, in one step; nothing was read of them."""
        if share_id == UNFOLLOWED:
            self.unfollowed[outcome] += len(indexes)
        elif outcome in WARM:
            self.bulk_of(share_id, outcome).add(indexes)
        else:
            self.settled.add_run(share_id, indexes, outcome, error)

    def bulk_of(self, share_id: int, outcome: str) -> Bulk:
        bulk = self.bulk.get((share_id, outcome))
        if bulk is None:
            bulk = self.bulk[(share_id, outcome)] = Bulk(share_id, outcome)
        return bulk

    def done(self, counters: dict[str, int], queue: dict[str, Any],
             verdicts: list[Verdict]) -> Done:
        """Everything owed, as one Done; owed nothing after."""
        done = Done(self.settled, self.looked, list(self.bulk.values()), counters,
                    dict(self.unfollowed), self.unfollowed_bytes, self.latency.counts,
                    self.latency.sum, queue, verdicts)
        self.settled, self.looked, self.bulk = Settled(), Looked(), {}
        self.unfollowed, self.unfollowed_bytes = Counter(), 0
        self.latency = Histogram(FILE_BUCKETS)
        return done


def queue_figures(engines: Iterable[Engine], root_fds: Sequence[int]) -> dict[str, Any]:
    """The queue engines' state, summed over warm modes; depth per root index."""
    queues = [e for e in engines if isinstance(e, QueueEngine)]
    if not queues:
        return {}
    index_of_fd = {fd: str(i) for i, fd in enumerate(root_fds) if fd >= 0}
    figures: dict[str, Any] = {"threads": 0, "running": 0, "stalled": 0, "timed_out": 0,
                               "other_mount_threads": 0, "other_mount_stuck": 0,
                               "other_mount_refused": 0, "standby_reads": 0, "depth": {}}
    for engine in queues:
        now = engine.figures()
        figures["threads"] += now.threads
        figures["running"] += now.running
        figures["stalled"] += now.stalled
        figures["timed_out"] += now.timed_out
        figures["other_mount_threads"] += now.other_mount_threads
        figures["other_mount_stuck"] += now.other_mount_stuck
        figures["other_mount_refused"] += now.other_mount_refused
        figures["standby_reads"] += now.standby_reads
        for fd, (depth, rtt_us, served) in now.depth.items():
            if fd in index_of_fd:
                figures["depth"][index_of_fd[fd]] = [depth, rtt_us, served]
    return figures


def send_all_blocking(sock: socket.socket, message: Message) -> None:
    """Write a whole message, waiting when the supervisor is behind: a worker has
    nothing better to do than report."""
    view = memoryview(encode(message))
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLOUT)
            poller.poll(1000)
            continue
        view = view[sent:]
