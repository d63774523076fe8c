"""A worker: receive files, skip what is warm or already on its way, warm the rest.

Runs in a forked child that owns its engines (one per warm mode it is asked for). Its
loop waits on its channel and its engines' completions at once: it drains the channel,
answers what its memory can answer, hands the engines the rest, and reports outcomes as
they come (a Done per round: the supervisor's heartbeat of this worker).
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import time
from array import array
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvprefetchd.channel import (
    CHECK,
    EVICT_FILE,
    INSPECT_MODES,
    ChannelReader,
    Done,
    Root,
    RootTier,
    Warm,
    send_all_blocking,
)
from kvprefetchd.engines import EngineSpec, WarmEngines
from kvprefetchd.engines.base import Completion, Engine, EngineSettings, WarmItem
from kvprefetchd.engines.queue import QueueEngine
from kvprefetchd.faults import BatchFaults
from kvprefetchd.metrics.histogram import FILE_BUCKETS, Histogram
from kvprefetchd.native import load_native
from kvprefetchd.roots.tiers import WHOLE_FILE
from kvprefetchd.supervisor.books import TICKET_INDEX_BITS, TICKET_INDEX_MASK, ticket_of
from kvprefetchd.worker.dedup import InFlight, Key, RecentlyWarmed
from kvprefetchd.worker.files import Files, Tally, roots_of
from kvprefetchd.worker.holds import HoldBudget
from kvprefetchd.worker.inspection import Inspector
from kvprefetchd.worker.keeping import Keeping
from kvprefetchd.worker.probe import Prober

log = logging.getLogger("kvprefetchd.worker")

# While files are out in a queue engine, the loop wakes this often to tick it (stalled
# reads, late files) and, when nothing finished meanwhile, tells the supervisor once a
# second that it is alive: its own thread never blocks on a read there, so silence means
# the worker itself is stuck, which is what the supervisor's worker_timeout is for.
TICK_SECONDS = 0.1
HEARTBEAT_SECONDS = 1.0
QUEUE_REPORT_SECONDS = 0.5  # the queue's state in a report, at most this often


@dataclass(frozen=True)
class WorkerPlan:
    """Everything a worker needs, fixed by the supervisor before it forks."""

    index: int
    roots: tuple[str, ...]
    # Each root's directory fd as the supervisor holds it (inherited across the fork;
    # -1 while a root is not open yet: its fd comes later in a Root message), and its
    # residency rule code (KVP_RES_*).
    root_fds: tuple[int, ...]
    rules: tuple[int, ...]
    # Warm mode ("read", "advise") -> the engines to try, best first. The first mode is
    # the configured one (built at boot); another is there only when a model profile
    # chooses it and an engine of that mode can run here (built on first use).
    engines: Mapping[str, tuple[EngineSpec, ...]]
    engine_settings: EngineSettings
    dedup_ttl: float
    dedup_entries: int
    dedup_bytes: int = 16 << 20
    nice: int = 0
    batch: bool = False  # SCHED_BATCH (config.worker_batch)
    tiers: tuple[RootTier, ...] = ()  # per root, beside rules (RootTier() when not open)
    holds: HoldBudget = field(default_factory=HoldBudget)

    @property
    def warm_mode(self) -> str:
        return next(iter(self.engines))


INSPECT_AT_ONCE = 1024  # files per kvp_inspect call: one cffi array, bounded
WARM_MODES = ("read", "advise")


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
        self.outcomes: list[list[Any]] = []  # followed files not warmed, by ticket
        self.tallies: dict[tuple[int, str], Tally] = {}  # followed files warmed, per share
        self.anonymous: Counter[str] = Counter()  # outcomes of fire-and-forget files
        self.anonymous_bytes = 0
        self.latency = Histogram(FILE_BUCKETS)  # per file, since the last report
        self.counters = {
            "batches": 0, "batches_other_mode": 0, "dedup_recent": 0, "dedup_in_flight": 0,
            "probed_resident": 0, "probed_missing": 0, "checked": 0, "evicted": 0,
            "noatime_fallbacks": 0,
        }
        self.native = load_native()
        self.prober = Prober(self.native, self.root_fds, self.rules)
        self.inspector = Inspector(self.native)
        self.keeping = Keeping(self.native, plan.holds, self.inspector)
        self.depth_hinted: set[tuple[int, int]] = set()  # (queue engine, root fd) given
        self.holds = self.keeping.holds
        if self.holds.fileno() >= 0:
            self.poller.register(self.holds.fileno(), select.POLLIN)
        self.noatime_fallbacks = int(self.native.lib.kvp_noatime_fallbacks())
        self.faults = BatchFaults.from_environment()  # None unless a test injects one
        self.reported = time.monotonic()
        self.queue_reported = 0.0

    @property
    def engine(self) -> Engine:
        """The engine of the configured warm mode."""
        return self.engines.default

    def run(self) -> None:
        self.watch(self.engine)
        while True:
            self.poller.poll(self.poll_timeout_ms())
            for message in self.reader.read_available():
                if isinstance(message, Warm):
                    self.accept(message)
                elif isinstance(message, Root):
                    self.take_root(message)
                else:
                    log.warning("worker %d: unexpected %s", self.plan.index, type(message))
            if self.reader.closed:
                self.holds.close()
                return  # the supervisor is gone: nobody to report to
            if len(self.holds):
                self.holds.read_events()
                self.holds.expire()
            for mode, pending in self.pending.items():
                if pending:
                    self.hand_over(self.engine_for(mode), pending, mode)
            for engine in self.engines.built():
                for completion in engine.reap():
                    self.settle(completion)
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
        self.tiers[index] = RootTier(message.keep, message.whole, message.fs_cache,
                                     message.hold, message.depth)
        self.depth_hinted.clear()
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
        if self.keeping.holding_changed:  # the gauge is due within QUEUE_REPORT_SECONDS
            due = min(due, QUEUE_REPORT_SECONDS) if due is not None else QUEUE_REPORT_SECONDS
        return None if due is None else int(due * 1000) + 1

    def accept(self, message: Warm) -> None:
        if message.warm_mode in INSPECT_MODES:
            self.inspect(message)
            return
        files = Files.of(message)
        if files.count == 0:
            return
        received = time.monotonic()
        if self.recent.enabled or len(self.holds):
            files = self.recall(message, files)
            if files.count == 0:
                return
        if 0.0 < message.deadline < received:  # late already: no file of it is read
            self.outcomes_of(message.share, files.indexes, "expired")
            return
        if self.prober.useful and message.warm_mode in WARM_MODES:
            files = self.probe(message, files)
            if files.count == 0:
                return
        self.queue_up(message, files, received)

    def recall(self, message: Warm, files: Files) -> Files:
        """Answer what the memory of recent reads covers, and the files held open; the
        files neither does."""
        share, read_bytes = message.share, message.read_bytes
        names, root_of = files.all_names(), files.root_of
        left: list[int] = []
        recent, holds = self.recent, self.holds
        for index in files.indexes:
            key = (root_of[index], names[index])
            if key in holds or recent.covers(key, read_bytes):
                self.counters["dedup_recent"] += 1
                self.outcome(ticket_of(share, index) if share else 0, "resident", 0)
                self.latency.observe(0.0)
            else:
                left.append(index)
        return files.subset(left)

    def probe(self, message: Warm, files: Files) -> Files:
        """Settle what the probe finds resident or missing; the files it leaves."""
        share = message.share
        roots, paths = files.buffers()
        resident, missing, rest = self.prober.probe(roots, paths, files.count,
                                                    message.read_bytes)
        if resident:
            self.settle_resident(share, files, resident, message.read_bytes)
        if missing:
            self.latency.observe_many(0.0, len(missing))
            self.counters["probed_missing"] += len(missing)
            self.outcomes_of(share, [files.indexes[position] for position in missing],
                             "missing", errno.ENOENT)
        return files.subset([files.indexes[position] for position in rest])

    def settle_resident(self, share: int, files: Files, found: bytes, read_bytes: int) -> None:
        """Files the probe found warm: one tally per share, remembered when dedup is on.
        `found` holds positions in `files` (uint32, native order)."""
        positions = array("I")
        positions.frombytes(found)
        if not files.whole:
            positions = array("I", [files.indexes[i] for i in positions])
        self.counters["probed_resident"] += len(positions)
        self.latency.observe_many(0.0, len(positions))
        self.outcomes_of(share, positions, "resident")
        if self.recent.enabled:
            names, root_of = files.all_names(), files.root_of
            for index in positions:
                self.recent.remember((root_of[index], names[index]), read_bytes)

    def queue_up(self, message: Warm, files: Files, received: float) -> None:
        """Files the engines must decide: joined to one already out, or queued."""
        read_bytes, deadline, flags = message.read_bytes, message.deadline, message.flags
        share, client = message.share, message.client
        self.requests = group = self.requests % 0xFFFFFFFF + 1  # newer: later (schedule.c)
        queue = self.pending.get(message.warm_mode)
        if queue is None:
            queue = self.pending[message.warm_mode] = deque()
        names, root_of = files.all_names(), files.root_of
        hold, keeping = self.keeping.hold_flag, self.keeping
        for index in files.indexes:
            ticket = ticket_of(share, index) if share else 0
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
                for waiting in self.in_flight.settle(key, depth):
                    self.outcome(waiting, skip, 0, errno.ENOENT if skip == "missing" else 0)
                continue
            queue.append(WarmItem(root_fd, self.rules[root_index], relative, depth, key,
                                  received, deadline, flags | hold if tier.hold else flags,
                                  group, client))

    def inspect(self, message: Warm) -> None:
        """check or evict: look at each file (kvp_inspect) and report its state and
        figures, on this thread between rounds (worker_inspect.py: in parallel on a
        network or FUSE root). Only the root's own file system is asked: a file behind
        another mount beneath the root (a FUSE mount in a subdirectory, which may hang)
        comes back failed (EXDEV, `other_mount`) unlooked at; a root whose own file system
        hangs is what worker_timeout is for. A check never opens a file where an open
        would undo a warm-up: a held file is resident (holds.py), any other on a hold
        root cold, and every file of a root found futile (reopen.py) futile."""
        lib = self.native.lib
        check = message.warm_mode == CHECK
        action = (lib.KVP_INSPECT_CHECK if check
                  else lib.KVP_INSPECT_EVICT_FILE if message.warm_mode == EVICT_FILE
                  else lib.KVP_INSPECT_EVICT_HEAD)
        names, root_of = message.paths.split(b"\0"), roots_of(message)
        count = len(root_of)
        self.counters["checked" if check else "evicted"] += count
        for start in range(0, count, INSPECT_AT_ONCE):
            tickets: list[int] = []
            items: list[WarmItem] = []
            remote = False
            for index in range(start, min(count, start + INSPECT_AT_ONCE)):
                ticket = ticket_of(message.share, index)
                root_index, relative = root_of[index], names[index]
                key = (root_index, relative)
                tier = self.tiers[root_index]
                if not check:
                    self.recent.forget(key)
                    self.holds.release(key, "evicted")
                elif (known := self.keeping.known_state(
                        key, root_index, relative, tier,
                        WHOLE_FILE if tier.whole else message.read_bytes)) is not None:
                    self.outcomes.append([ticket, *known])
                    continue
                root_fd = self.root_fds[root_index]
                if root_fd < 0:  # not open yet: as a warm-up says of it
                    self.outcomes.append([ticket, "missing", 0, errno.ENOENT, 0, 0, 0])
                    continue
                remote = remote or not self.prober.local(root_index)
                tickets.append(ticket)
                items.append(WarmItem(root_fd, self.rules[root_index], relative,
                                      WHOLE_FILE if tier.whole else message.read_bytes))
            if items:
                for ticket, look in zip(tickets, self.inspector.look(action, items, remote),
                                        strict=True):
                    self.outcomes.append([ticket, look.state, 0, look.err, look.size,
                                          look.cached, look.tier])

    def hand_over(self, engine: Engine, pending: deque[WarmItem], mode: str) -> None:
        """Give the engine what waits for it: all of it (a queue) or one batch."""
        if isinstance(engine, QueueEngine):
            self.hint_depths(engine)
        if self.faults is not None:
            self.faults.apply([item.relative for item in pending])
        engine.take(pending)
        self.counters["batches"] += 1
        if mode != self.plan.warm_mode:
            self.counters["batches_other_mode"] += 1

    def hint_depths(self, engine: QueueEngine) -> None:
        """Start each FUSE or network root at the depth its profile trusts (RootTier.depth)
        in this queue, once per queue and root directory: no ramp on a slow tier."""
        for fd, tier in zip(self.root_fds, self.tiers, strict=True):
            if tier.depth and fd >= 0 and (id(engine), fd) not in self.depth_hinted:
                engine.root_depth(fd, tier.depth)
                self.depth_hinted.add((id(engine), fd))

    def engine_for(self, warm_mode: str) -> Engine:
        engine = self.engines.for_mode(warm_mode)
        self.watch(engine)
        return engine

    def watch(self, engine: Engine) -> None:
        fd = engine.fileno()
        if fd >= 0 and fd not in self.watched:
            self.poller.register(fd, select.POLLIN)
            self.watched.add(fd)

    def queue_figures(self) -> dict[str, Any]:
        """The queue engines' state, summed over warm modes; depth per root index."""
        queues = [e for e in self.engines.built() if isinstance(e, QueueEngine)]
        if not queues:
            return {}
        index_of = {fd: str(i) for i, fd in enumerate(self.root_fds) if fd >= 0}
        figures: dict[str, Any] = {"threads": 0, "running": 0, "stalled": 0, "timed_out": 0,
                                   "other_mount_threads": 0, "other_mount_stuck": 0,
                                   "other_mount_refused": 0, "depth": {}}
        for engine in queues:
            now = engine.figures()
            figures["threads"] += now.threads
            figures["running"] += now.running
            figures["stalled"] += now.stalled
            figures["timed_out"] += now.timed_out
            figures["other_mount_threads"] += now.other_mount_threads
            figures["other_mount_stuck"] += now.other_mount_stuck
            figures["other_mount_refused"] += now.other_mount_refused
            for fd, (depth, rtt_us) in now.depth.items():
                if fd in index_of:
                    figures["depth"][index_of[fd]] = [depth, rtt_us]
        return figures

    def settle(self, completion: Completion) -> None:
        item = completion.item
        outcome = completion.outcome
        if outcome == "read":
            root_index = item.key[0]
            outcome = self.keeping.judged(completion, root_index, self.tiers[root_index])
        elif outcome == "resident" and item.read_bytes == 0:
            outcome = "futile"  # a futile root's lookup (keeping.skip): nothing was read
        if outcome in ("read", "resident"):
            self.recent.remember(item.key, item.read_bytes)
        bytes_read = completion.done if completion.outcome == "read" else 0
        self.latency.observe(time.monotonic() - item.received)
        tickets = self.in_flight.settle(item.key, item.read_bytes)
        for position, ticket in enumerate(tickets):
            # Bytes are counted once per real read, not once per waiting request.
            self.outcome(ticket, outcome, bytes_read if position == 0 else 0,
                         completion.error)
        if completion.outcome == "failed":
            log.debug(
                "worker %d: %r failed: %s",
                self.plan.index,
                item.relative,
                os.strerror(completion.error) if completion.error else "unknown",
            )

    def outcome(self, ticket: int, outcome: str, nbytes: int, error: int = 0) -> None:
        """Ticket 0 is a fire-and-forget file: reported as a count, not one by one. A
        followed file that was warmed goes in its share's tally; one that was not is
        reported by ticket with its errno: the reply names it and says why."""
        if not ticket:
            self.anonymous[outcome] += 1
            self.anonymous_bytes += nbytes
        elif outcome == "read" or outcome == "resident":
            self.tally(ticket >> TICKET_INDEX_BITS, outcome).add_one(
                ticket & TICKET_INDEX_MASK, nbytes)
        else:
            self.outcomes.append([ticket, outcome, nbytes, error])

    def outcomes_of(self, share: int, indexes: Sequence[int], outcome: str,
                    error: int = 0) -> None:
        """`outcome` for these files of one message, as `outcome` says it of each file, in
        one step: a count (fire and forget), the share's tally, or by ticket. Nothing was
        read of them (no bytes)."""
        if not share:
            self.anonymous[outcome] += len(indexes)
        elif outcome == "read" or outcome == "resident":
            self.tally(share, outcome).add(indexes)
        else:
            self.outcomes.extend([ticket_of(share, index), outcome, 0, error]
                                 for index in indexes)

    def tally(self, share: int, outcome: str) -> Tally:
        tally = self.tallies.get((share, outcome))
        if tally is None:
            tally = self.tallies[(share, outcome)] = Tally()
        return tally

    def flush(self) -> None:
        """Report what was settled since the last report; with nothing settled, an empty
        report once a second while files are out, so the supervisor hears a live worker."""
        now = time.monotonic()
        queue_due = now - self.queue_reported >= QUEUE_REPORT_SECONDS
        holding_now = queue_due and self.keeping.holding_changed
        if not self.outcomes and not self.anonymous and not self.tallies \
                and not self.keeping.verdicts.changed and not holding_now:
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
        if queue_due:
            self.queue_reported = now
            queue = {**self.queue_figures(), **self.keeping.gauge()}
        send_all_blocking(self.sock, Done(
            settled=self.outcomes,
            bulk=[[share, outcome, tally.count, tally.nbytes, tally.indexes.tobytes()]
                  for (share, outcome), tally in self.tallies.items()],
            counters=counters,
            anonymous=dict(self.anonymous),
            anonymous_bytes=self.anonymous_bytes,
            latency_counts=self.latency.counts,
            latency_sum=self.latency.sum,
            queue=queue,
            verdicts=self.keeping.verdicts.take_changed(),
        ))
        self.outcomes = []
        self.tallies = {}
        self.anonymous.clear()
        self.anonymous_bytes = 0
        self.latency = Histogram(FILE_BUCKETS)
