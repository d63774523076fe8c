"""A worker's loop: receive files, skip what is warm or already on its way, warm the rest.

Runs in a forked child that owns its engines (one per warm mode it is asked for). Its
loop waits on its channel and its engines' completions at once: it drains the channel,
answers what its memory can answer, hands the engines the rest, and reports outcomes as
they come (report.py: a Done per round, the supervisor's heartbeat of this worker).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import time
from array import array
from collections import deque
from typing import Any

from kvprefetchd.channel import (
    UNFOLLOWED,
    ChannelReader,
    Check,
    Evict,
    Root,
    RootTier,
    Warm,
    ticket_of,
)
from kvprefetchd.engines import WarmEngines
from kvprefetchd.engines.base import Completion, Engine, WarmItem
from kvprefetchd.engines.queue import QueueEngine
from kvprefetchd.faults import BatchFaults
from kvprefetchd.native import load_native
from kvprefetchd.roots.tiers import WHOLE_FILE
from kvprefetchd.worker.dedup import InFlight, Key, RecentlyWarmed
from kvprefetchd.worker.files import Files
from kvprefetchd.worker.inspection import Inspector
from kvprefetchd.worker.keeping import Keeping
from kvprefetchd.worker.plan import WorkerPlan
from kvprefetchd.worker.probe import Prober
from kvprefetchd.worker.report import Report, queue_figures, send_all_blocking

log = logging.getLogger("kvprefetchd.worker")

# While files are out in a queue engine, the loop wakes this often to tick it (stalled
# reads, late files) and, when nothing finished meanwhile, tells the supervisor once a
# second that it is alive: its own thread never blocks on a read there, so silence means
# the worker itself is stuck, which is what the supervisor's worker_timeout is for.
TICK_SECONDS = 0.1
HEARTBEAT_SECONDS = 1.0
QUEUE_REPORT_SECONDS = 0.5  # the queue's state in a report, at most this often
INSPECT_AT_ONCE = 1024  # files per kvp_inspect call: one cffi array, bounded


class Worker:
    def __init__(self, plan: WorkerPlan, sock: socket.socket, engines: WarmEngines) -> None:
        self.plan = plan
        self.sock = sock
        self.engines = engines
        self.reader = ChannelReader(sock)
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self.watched: set[int] = set()  # engine fds in the poller
        self.root_fds = list(plan.root_fds)  # never a path: a root swapped later is not seen
        self.rules = list(plan.rules)
        self.tiers = list(plan.tiers) or [RootTier()] * len(plan.rules)
        self.retired: dict[int, int] = {}  # root index -> fd let go, closed once idle
        self.recent = RecentlyWarmed(plan.dedup_ttl, plan.dedup_entries,
                                     budget_bytes=plan.dedup_bytes)
        self.in_flight = InFlight()
        self.pending: dict[str, deque[WarmItem]] = {plan.warm_mode: deque()}  # per warm mode
        self.requests = 0  # Warm messages queued: each one's number is its files' group
        self.report = Report()  # what was settled since the last Done
        self.counters = {
            "batches": 0, "batches_other_mode": 0, "dedup_recent": 0, "dedup_in_flight": 0,
            "probed_resident": 0, "probed_missing": 0, "checked": 0, "evicted": 0,
            "noatime_fallbacks": 0,
        }
        self.native = load_native()
        self.prober = Prober(self.native, self.root_fds, self.rules,
                             check_before_open=plan.check_before_open)
        if self.prober.mounts_fd >= 0:  # POLLPRI at every mount or unmount: views go stale
            self.poller.register(self.prober.mounts_fd, select.POLLPRI)
        self.inspector = Inspector(self.native)
        self.keeping = Keeping(self.native, plan.holds, self.inspector)
        self.tiers_hinted: set[tuple[int, int]] = set()  # (queue engine, root fd) given
        self.holds = self.keeping.holds
        if self.holds.fileno() >= 0:
            self.poller.register(self.holds.fileno(), select.POLLIN)
        self.noatime_fallbacks = int(self.native.lib.kvp_noatime_fallbacks())
        self.faults = BatchFaults.from_environment()  # None unless a test injects one
        self.reported = time.monotonic()
        self.queue_reported = 0.0
        # A report went out without the queue's figures (they are sent at most every
        # QUEUE_REPORT_SECONDS): the last ones the supervisor has are older than its outcomes.
        self.queue_stale = False

    @property
    def engine(self) -> Engine:
        """The engine of the configured warm mode."""
        return self.engines.default

    def run(self) -> None:
        self.watch(self.engine)
        while True:
            for fd, _ in self.poller.poll(self.poll_timeout_ms()):
                if fd == self.prober.mounts_fd:
                    self.prober.remount()
            for message in self.reader.read_available():
                if isinstance(message, Warm):
                    self.accept(message)
                elif isinstance(message, Check | Evict):
                    self.inspect(message)
                elif isinstance(message, Root):
                    self.take_root(message)
                else:
                    log.warning("worker %d: unexpected %s", self.plan.index, type(message))
            if self.reader.closed:
                self.holds.close()
                self.prober.close()
                return  # the supervisor is gone: nobody to report to
            if len(self.holds):
                self.holds.read_events()
                self.holds.expire()
            for mode, pending in self.pending.items():
                if pending:
                    self.hand_over(self.engine_for(mode), pending, mode)
            for engine in self.engines.built():
                for completion in engine.reap():
                    self.judge(completion)
                if engine.outstanding:
                    engine.tick()
            if self.retired:
                self.close_retired()
            self.flush()

    def take_root(self, message: Root) -> None:
        """A root opened, reopened or let go (rootset.py). A reopened root's new directory
        takes the number the old one had (dup2): what is queued or in flight under it
        resolves beneath the new directory from now on, and the engines' per-root state
        (kept by fd) stays the root's. A root let go keeps its number aside, open, until
        nothing is out that may use it (close_retired), so no file is ever resolved
        beneath whatever would reuse that number."""
        index, fd = message.index, message.fd
        held = self.root_fds[index]
        if held < 0:
            held = self.retired.pop(index, -1)
        if fd >= 0 and held >= 0:
            os.dup2(fd, held, inheritable=False)
            os.close(fd)
            fd = held
        elif held >= 0:
            self.retired[index] = held
        if held >= 0:  # what was warmed under the old directory says nothing of the new
            plan = self.plan
            self.recent = RecentlyWarmed(plan.dedup_ttl, plan.dedup_entries,
                                         budget_bytes=plan.dedup_bytes)
        self.root_fds[index], self.rules[index] = fd, message.rule
        self.tiers[index] = message.tier
        self.tiers_hinted.clear()
        self.keeping.verdicts.forget(index)
        self.prober.set_root(index, fd, message.rule)

    def close_retired(self) -> None:
        """Close the fds of roots let go once no file is queued or out in an engine."""
        if any(self.pending.values()) or any(e.outstanding for e in self.engines.built()):
            return
        for fd in self.retired.values():
            os.close(fd)
        self.retired.clear()

    def poll_timeout_ms(self) -> int | None:
        """No wait while a batch engine has files to take; a tick while files are out;
        else until the oldest held file's time is up."""
        if any(self.pending.values()):
            return 0
        if any(engine.outstanding for engine in self.engines.built()):
            return int(TICK_SECONDS * 1000)
        due = self.holds.next_due()
        if self.keeping.holding_changed or self.queue_stale:  # due within QUEUE_REPORT_SECONDS
            due = min(due, QUEUE_REPORT_SECONDS) if due is not None else QUEUE_REPORT_SECONDS
        return None if due is None else int(due * 1000) + 1

    def accept(self, message: Warm) -> None:
        files = Files.of(message.files)
        if files.count == 0:
            return
        received = time.monotonic()
        if self.recent.enabled or len(self.holds):
            files = self.recall(message, files)
            if files.count == 0:
                return
        if 0.0 < message.deadline < received:  # late already: no file of it is read
            self.report.settle_all(message.share_id, files.indexes, "expired")
            return
        if self.prober.useful:
            files = self.probe(message, files)
            if files.count == 0:
                return
        self.queue_up(message, files, received)

    def recall(self, message: Warm, files: Files) -> Files:
        """Answer what the memory of recent reads covers, and the files held open; the
        files neither does. On a hold root only a held file: one read and let go (its
        consumer opened it) is warm in the page cache, but an open of it costs what a
        hold spares (holds.py), so it is looked at, and held, again."""
        share_id, read_bytes = message.share_id, message.read_bytes
        names, root_of, tiers = files.all_names(), files.root_of, self.tiers
        left: list[int] = []
        recent, holds, report = self.recent, self.holds, self.report
        for index in files.indexes:
            key = (root_of[index], names[index])
            if key in holds or (recent.covers(key, read_bytes)
                                and not tiers[key[0]].hold):
                self.counters["dedup_recent"] += 1
                report.settle(ticket_of(share_id, index) if share_id != UNFOLLOWED else UNFOLLOWED,
                              "resident", 0)
                report.latency.observe(0.0)
            else:
                left.append(index)
        return files.subset(left)

    def probe(self, message: Warm, files: Files) -> Files:
        """Settle what the probe finds resident or missing; the files it leaves."""
        share_id, probed = message.share_id, files.as_share()
        resident, missing, rest = self.prober.probe(probed.roots, probed.paths, probed.count,
                                                    message.read_bytes)
        if resident:
            self.settle_resident(share_id, files, resident, message.read_bytes)
        if missing:
            self.report.latency.observe_many(0.0, len(missing))
            self.counters["probed_missing"] += len(missing)
            self.report.settle_all(share_id, [files.indexes[position] for position in missing],
                                   "missing", errno.ENOENT)
        return files.subset([files.indexes[position] for position in rest])

    def settle_resident(self, share_id: int, files: Files, found: bytes,
                        read_bytes: int) -> None:
        """Files the probe found warm: one bulk record per share, remembered when dedup is on.
        `found` holds positions in `files` (uint32, native order)."""
        positions = array("I")
        positions.frombytes(found)
        if not files.whole:
            positions = array("I", [files.indexes[i] for i in positions])
        self.counters["probed_resident"] += len(positions)
        self.report.latency.observe_many(0.0, len(positions))
        self.report.settle_all(share_id, positions, "resident")
        if self.recent.enabled:
            names, root_of = files.all_names(), files.root_of
            for index in positions:
                self.recent.remember((root_of[index], names[index]), read_bytes)

    def queue_up(self, message: Warm, files: Files, received: float) -> None:
        """Files the engines must decide: joined to one already out, or queued."""
        read_bytes, deadline, flags = message.read_bytes, message.deadline, message.flags
        share_id, client = message.share_id, message.client
        self.requests = group = self.requests % 0xFFFFFFFF + 1  # newer: later (schedule.c)
        queue = self.pending.get(message.warm_mode)
        if queue is None:
            queue = self.pending[message.warm_mode] = deque()
        names, root_of = files.all_names(), files.root_of
        hold, keeping = self.keeping.hold_flag, self.keeping
        for index in files.indexes:
            ticket = ticket_of(share_id, index) if share_id != UNFOLLOWED else UNFOLLOWED
            root_index, relative = root_of[index], names[index]
            key: Key = (root_index, relative)
            tier = self.tiers[root_index]
            depth = WHOLE_FILE if tier.whole else read_bytes
            skip = keeping.skip(root_index, tier, relative, depth) \
                if tier.keep != "pagecache" else ""
            if skip == "metadata":  # a futile root: a lookup and no read (read_bytes 0)
                depth = 0
            if not self.in_flight.join(key, depth, ticket):
                self.counters["dedup_in_flight"] += 1
                continue
            root_fd = self.root_fds[root_index]
            if root_fd < 0:  # not open yet (missing at start, or its tier not answering)
                skip = "missing"
            if skip in ("missing", "resident"):  # or held, or in the file system's cache
                for waiting in self.in_flight.finish(key, depth):
                    self.report.settle(waiting, skip, 0,
                                       errno.ENOENT if skip == "missing" else 0)
                continue
            queue.append(WarmItem(root_fd, self.rules[root_index], relative, depth, key,
                                  received, deadline, flags | hold if tier.hold else flags,
                                  group, client, position=index))

    def inspect(self, message: Check | Evict) -> None:
        """check or evict: look at each file (kvp_inspect) and report its state and
        figures, on this thread between rounds (inspection.py: in parallel on a
        network or FUSE root). Only the root's own file system is asked: a file behind
        another mount beneath the root (a FUSE mount in a subdirectory, which may hang)
        comes back failed (EXDEV, `other_mount`) unlooked at; a root whose own file system
        hangs is what worker_timeout is for. A check never opens a file where an open
        would undo a warm-up: a held file is resident (holds.py), any other on a hold
        root cold, and every file of a root found futile (reopen.py) futile."""
        lib = self.native.lib
        check = isinstance(message, Check)
        action = (lib.KVP_INSPECT_CHECK if check
                  else lib.KVP_INSPECT_EVICT_FILE if isinstance(message, Evict) and message.whole
                  else lib.KVP_INSPECT_EVICT_HEAD)
        names, root_of = message.files.paths.split(b"\0"), message.files.root_indexes()
        count, looked = len(root_of), self.report.looked
        self.counters["checked" if check else "evicted"] += count
        for start in range(0, count, INSPECT_AT_ONCE):
            tickets: list[int] = []
            items: list[WarmItem] = []
            remote = False
            for index in range(start, min(count, start + INSPECT_AT_ONCE)):
                ticket = ticket_of(message.share_id, index)
                root_index, relative = root_of[index], names[index]
                key = (root_index, relative)
                tier = self.tiers[root_index]
                if not check:
                    self.recent.forget(key)
                    self.holds.release(key, "evicted")
                elif (known := self.keeping.known_state(
                        key, root_index, relative, tier,
                        WHOLE_FILE if tier.whole else message.read_bytes)) is not None:
                    looked.add(ticket, known.state, known.err, known.size, known.cached,
                               known.tier)
                    continue
                root_fd = self.root_fds[root_index]
                if root_fd < 0:  # not open yet: as a warm-up says of it
                    looked.add(ticket, "missing", errno.ENOENT)
                    continue
                remote = remote or not self.prober.local(root_index)
                tickets.append(ticket)
                items.append(WarmItem(root_fd, self.rules[root_index], relative,
                                      WHOLE_FILE if tier.whole else message.read_bytes))
            if items:
                for ticket, look in zip(tickets, self.inspector.look(action, items, remote),
                                        strict=True):
                    looked.add(ticket, look.state, look.err, look.size, look.cached, look.tier)

    def hand_over(self, engine: Engine, pending: deque[WarmItem], mode: str) -> None:
        """Give the engine what waits for it: all of it (a queue) or one batch."""
        if isinstance(engine, QueueEngine):
            self.hint_tiers(engine)
        if self.faults is not None:
            self.faults.apply([item.relative for item in pending])
        engine.take(pending)
        self.counters["batches"] += 1
        if mode != self.plan.warm_mode:
            self.counters["batches_other_mode"] += 1

    def hint_tiers(self, engine: QueueEngine) -> None:
        """Start each FUSE or network root at the depth its profile trusts (RootTier.depth)
        in this queue, once per queue and root directory: no ramp on a slow tier. And
        where the tier counts its requests (RootTier.gauge), admission judges by the
        count: a root's own reads tell the tier's queue only a read late."""
        for fd, tier in zip(self.root_fds, self.tiers, strict=True):
            if fd < 0 or (id(engine), fd) in self.tiers_hinted:
                continue
            if tier.depth:
                engine.root_depth(fd, tier.depth)
            if tier.gauge and self.plan.admit_by_tier_count:
                # not readable (fusectl not mounted, another user's mount): the reads'
                # own times judge, and the worker's stats show no rate for the root
                engine.root_gauge(fd, tier.gauge)
            self.tiers_hinted.add((id(engine), fd))

    def engine_for(self, warm_mode: str) -> Engine:
        engine = self.engines.for_mode(warm_mode)
        self.watch(engine)
        return engine

    def watch(self, engine: Engine) -> None:
        fd = engine.fileno()
        if fd >= 0 and fd not in self.watched:
            self.poller.register(fd, select.POLLIN)
            self.watched.add(fd)

    def judge(self, completion: Completion) -> None:
        """An engine is done with a file: judge what it did (keeping.py) and settle every
        ticket that waited for it."""
        item = completion.item
        outcome = completion.outcome
        if outcome == "read":
            root_index = item.key[0]
            outcome = self.keeping.judged(completion, root_index, self.tiers[root_index])
        elif outcome == "resident" and item.read_bytes == 0:
            outcome = "futile"  # a futile root's lookup (keeping.skip): nothing was read
        elif completion.held_fd >= 0:  # found warm on a hold root: held all the same
            self.keeping.found_warm(completion)
        if outcome in ("read", "resident"):
            self.recent.remember(item.key, item.read_bytes)
        bytes_read = completion.done if completion.outcome == "read" else 0
        self.report.latency.observe(time.monotonic() - item.received)
        tickets = self.in_flight.finish(item.key, item.read_bytes)
        for position, ticket in enumerate(tickets):
            # Bytes are counted once per real read, not once per waiting request.
            self.report.settle(ticket, outcome, bytes_read if position == 0 else 0,
                               completion.error)
        if completion.outcome == "failed":
            log.debug(
                "worker %d: %r failed: %s",
                self.plan.index,
                item.relative,
                os.strerror(completion.error) if completion.error else "unknown",
            )

    def flush(self) -> None:
        """Report what was settled since the last report; with nothing settled, an empty
        report once a second while files are out, so the supervisor hears a live worker."""
        now = time.monotonic()
        queue_due = now - self.queue_reported >= QUEUE_REPORT_SECONDS
        holding_now = queue_due and (self.keeping.holding_changed or self.queue_stale)
        if not self.report.owed and not self.keeping.verdicts.changed and not holding_now:
            busy = any(engine.outstanding for engine in self.engines.built())
            if not busy or now - self.reported < HEARTBEAT_SECONDS:
                return
        self.reported = now
        fallbacks = int(self.native.lib.kvp_noatime_fallbacks())
        self.counters.update(self.holds.report())
        self.counters["noatime_fallbacks"] += fallbacks - self.noatime_fallbacks
        self.noatime_fallbacks = fallbacks
        counters = {k: v for k, v in self.counters.items() if v}
        self.counters = dict.fromkeys(self.counters, 0)
        queue: dict[str, Any] = {}
        self.queue_stale = not queue_due
        if queue_due:
            self.queue_reported = now
            queue = {**queue_figures(self.engines.built(), self.root_fds),
                     **self.keeping.gauge()}
        send_all_blocking(self.sock, self.report.done(
            counters, queue, self.keeping.verdicts.take_changed()))
