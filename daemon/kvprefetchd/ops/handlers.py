"""The ops: one handler per request op, and the one place a followed request is answered.

`handle_frame` decodes a frame (protocol.py), looks its op up in a table and runs the
handler; any RequestError becomes that error's reply and a bug costs one `internal`
reply, never the daemon. The warm ops go: admit (confine, shard, room) -> ack ->
the pool books and sends each worker its share; a `wait` (or a KV request, whose
outcomes feed the stale-profile detector) is followed by a Waiter, answered in
`answer` once its last file is settled or its deadline passes.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import kvprefetchd
from kvprefetch.stats import Stats
from kvprefetchd.channel import CHECK, EVICT_FILE, EVICT_HEAD
from kvprefetchd.config import Config
from kvprefetchd.metrics.histogram import ACK_BUCKETS, WAIT_BUCKETS, Histogram, Histograms
from kvprefetchd.native import load_native
from kvprefetchd.ops.kvservice import DiscoveryPending, KVService
from kvprefetchd.protocol import (
    CHECK_STATES,
    FORBIDDEN,
    INTERNAL,
    OPS,
    OVERLOADED,
    PROTOCOL_VERSION,
    TOO_LARGE,
    Limits,
    Request,
    RequestError,
    decode_payload,
    error_reply,
    ok_reply,
    parse_request,
    request_id_of,
)
from kvprefetchd.reasons import turned_away
from kvprefetchd.request_fields import (
    WarmOptions,
    parse_inspect_options,
    parse_paths,
    parse_warm_options,
)
from kvprefetchd.roots.confine import Roots
from kvprefetchd.supervisor.admit import Admission, Admitter
from kvprefetchd.supervisor.books import Books, Inspection, ReplySink, Waiter
from kvprefetchd.supervisor.pool import WorkerPool

log = logging.getLogger("kvprefetchd")

Handler = Callable[[ReplySink, Request], None]


def request_limits(config: Config) -> Limits:
    """What a peer may make the supervisor decode, from the (possibly reloaded) config."""
    return Limits(
        config.max_frame_bytes,
        config.max_paths_per_request,
        config.max_path_bytes,
        config.max_tokens,
        config.max_nesting_depth,
        config.max_request_containers,
        config.max_request_items,
    )


class Ops:
    def __init__(
        self, config: Config, books: Books, pool: WorkerPool, kv: KVService,
        stats: Callable[[], Stats], doctor: Callable[[], dict[str, Any]],
    ) -> None:
        self.config = config
        self.limits = request_limits(config)
        self.roots = Roots(config.roots, config.max_path_bytes)
        self.admitter = Admitter(self.roots, config.worker_count)
        self.books = books
        self.pool = pool
        self.kv = kv
        self.build_stats = stats
        self.diagnose = doctor
        self.draining = False
        self.requests: Counter[str] = Counter()  # "op:ok", "op:error_CODE"
        self.ack_latency = Histograms(ACK_BUCKETS)
        self.wait_latency = Histogram(WAIT_BUCKETS)
        # Waiters with a deadline, earliest first. One answered before its deadline stays
        # in the heap until then (a `timeout_ms` of years: for ever), so the heap is
        # rebuilt once those outnumber the rest: it holds at most twice the open waiters.
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._answered_early = 0
        self._sequence = itertools.count()
        # One handler per op of protocol.OPS, the method of the op's own name: the op list
        # is written once, and an op without a method stops the daemon at its start.
        self.handlers: dict[str, Handler] = {op: getattr(self, op) for op in OPS}
        self.noatime_flag = int(load_native().lib.KVP_ITEM_NOATIME)

    def apply(self, config: Config) -> None:
        """A reload: new limits and KV profiles for the next request."""
        self.config = config
        self.limits = request_limits(config)
        self.kv.reconfigure(config)

    # ---- frames ----------------------------------------------------------------------------

    def handle_frame(self, connection: ReplySink, payload: bytes) -> None:
        started = time.perf_counter()
        op = "none"  # a label for requests whose op could not be read
        request: Request | None = None
        try:
            message = decode_payload(payload, self.limits)
            raw_op = message.get("op")
            op = raw_op if isinstance(raw_op, str) and raw_op in self.handlers else "unknown"
            try:
                request = parse_request(message)
            except RequestError as error:
                self.refuse(connection, op, error, request_id_of(message))
        except RequestError as error:
            self.refuse(connection, op, error, None)
        if request is not None:
            self.run(connection, request)
        self.ack_latency.observe(op, time.perf_counter() - started)

    def run(self, connection: ReplySink, request: Request) -> None:
        """Run a parsed request's handler; again, when a parked request's wait is over."""
        op = request.op
        try:
            if self.draining:
                raise RequestError(OVERLOADED, "the daemon is shutting down", request.request_id)
            self.handlers[op](connection, request)
            self.requests[f"{op}:ok"] += 1
        except DiscoveryPending as pending:
            # Parked until the scout has looked (kvservice.py); counted once it ends.
            try:
                self.kv.park(pending.profile, lambda: self.run(connection, request))
            except RequestError as error:
                self.refuse(connection, op, error, request.request_id)
        except RequestError as error:
            self.refuse(connection, op, error, request.request_id)
        except Exception as error:  # a bug must cost one reply, never the daemon
            log.exception("internal error handling a request")
            self.requests[f"{op}:error_{INTERNAL}"] += 1
            connection.send(error_reply(request.request_id, INTERNAL,
                                        f"{type(error).__name__}: {error}"))

    def refuse(self, connection: ReplySink, op: str, error: RequestError,
               request_id: int | None) -> None:
        self.requests[f"{op}:error_{error.code}"] += 1
        rid = error.request_id if error.request_id is not None else request_id
        connection.send(error_reply(rid, error.code, error.message))

    # ---- the handlers ----------------------------------------------------------------------

    def ping(self, connection: ReplySink, request: Request) -> None:
        connection.send(ok_reply(
            request.request_id,
            version=kvprefetchd.__version__,
            protocol=PROTOCOL_VERSION,
            engine=self.pool.engine_name,
            workers=len(self.pool.workers),
        ))

    def stats(self, connection: ReplySink, request: Request) -> None:
        connection.send(ok_reply(request.request_id, stats=self.build_stats()))

    def doctor(self, connection: ReplySink, request: Request) -> None:
        connection.send(ok_reply(request.request_id, **self.diagnose()))

    def prefetch(self, connection: ReplySink, request: Request) -> None:
        options = self.warm_options(request)
        waiter = self.follow(connection, request, options)
        self.warm(connection, request, parse_paths(request), options, waiter,
                  self.config.warm_mode)

    def prefetch_blocks(self, connection: ReplySink, request: Request) -> None:
        options = self.warm_options(request)
        profile, resolution = self.kv.resolve(request.body, request.request_id, for_prefetch=True)
        # Followed even without `wait`: its outcomes feed the stale-profile detector.
        waiter = self.follow(connection, request, options, force=True)
        assert waiter is not None
        waiter.profile, waiter.fingerprint = profile, resolution.fingerprint
        waiter.reply_fields["files"] = len(resolution.paths)
        mode = self.config.model_warm_modes.get(profile.name, self.config.warm_mode)
        self.warm(connection, request, resolution.paths, options, waiter, mode)

    def resolve(self, connection: ReplySink, request: Request) -> None:
        _, resolution = self.kv.resolve(request.body, request.request_id, for_prefetch=False)
        connection.send(ok_reply(
            request.request_id,
            block_hashes=resolution.block_hashes_hex(),
            paths=resolution.paths,
            fingerprint=resolution.fingerprint,
        ))

    # ---- warming ---------------------------------------------------------------------------

    def check(self, connection: ReplySink, request: Request) -> None:
        self.inspect(connection, request, CHECK)

    def evict(self, connection: ReplySink, request: Request) -> None:
        if not self.config.allow_evict:
            raise RequestError(
                FORBIDDEN, "evict is off on this daemon (allow_evict = false in its config): "
                "it would take cache from every user of the host", request.request_id)
        self.inspect(connection, request,
                     EVICT_FILE if request.body.get("whole") is True else EVICT_HEAD)

    def inspect(self, connection: ReplySink, request: Request, mode: str) -> None:
        """check or evict: the files go to their workers like a warm-up's (same gates, same
        shards, same queue room), which look at them instead of reading them."""
        options = parse_inspect_options(request, self.config.read_bytes,
                                        self.config.max_read_bytes)
        paths = parse_paths(request)
        self.check_count(paths, request)
        now = time.monotonic()
        deadline = now + options.timeout_ms / 1000.0 if options.timeout_ms is not None else None
        waiter = Waiter(request.request_id, now, deadline, reply_to=connection,
                        inspection=Inspection(options.details, evict=mode != CHECK))
        admission = self.admitter.admit(paths, self.pool.room())
        self.books.count_turned_away(waiter, dropped=admission.dropped_paths,
                                 rejected=admission.rejected_paths)
        self.pool.inspect(admission.shares, waiter, options.read_bytes, mode)
        self.follow_up(waiter)

    def warm_options(self, request: Request) -> WarmOptions:
        config = self.config
        return parse_warm_options(request, config.read_bytes, config.max_read_bytes,
                                  default_deadline_ms=config.default_deadline_ms,
                                  max_failures_listed=config.max_failures_listed)

    def follow(
        self, connection: ReplySink, request: Request, options: WarmOptions, *, force: bool = False
    ) -> Waiter | None:
        """A waiter for a request whose outcomes someone wants: its client (`wait`), or the
        daemon itself (`force`); None for a plain fire-and-forget prefetch."""
        if not (options.wait or force):
            return None
        now = time.monotonic()
        timeout_ms = options.timeout_ms if options.wait else None
        deadline = now + timeout_ms / 1000.0 if timeout_ms is not None else None
        return Waiter(request.request_id, now, deadline,
                      reply_to=connection if options.wait else None,
                      max_failures=options.max_failures)

    def warm(
        self, connection: ReplySink, request: Request, paths: list[Any], options: WarmOptions,
        waiter: Waiter | None, warm_mode: str,
    ) -> None:
        """Queue the files; ack now (fire and forget) or answer once they are settled."""
        self.check_count(paths, request)
        admission = self.admitter.admit(paths, self.pool.room())
        if admission.rejected_paths and log.isEnabledFor(logging.DEBUG):
            for path, reason in admission.rejected_paths:
                log.debug("rejected %r: %s", path, reason)
        self.books.count_turned_away(waiter, dropped=admission.dropped_paths,
                                 rejected=admission.rejected_paths)
        if not options.wait:
            # The ack goes out before the workers hear of the files: once they wake they
            # take both CPUs of a small host, and the caller must not wait behind them.
            fields = waiter.reply_fields if waiter is not None else {}
            reply = ok_reply(
                request.request_id, accepted=admission.accepted, dropped=admission.dropped,
                rejected=admission.rejected, room=admission.room, **fields,
            )
            if admission.rejected_paths or admission.dropped:
                self.list_turned_away(reply, admission, options.max_failures)
            connection.send(reply)
        flags = self.noatime_flag if self.config.preserve_atime else 0
        self.pool.dispatch(admission.shares, waiter, options.read_bytes, warm_mode,
                           options.deadline, flags, connection.client)
        if waiter is not None:
            self.follow_up(waiter)

    def check_count(self, paths: list[Any], request: Request) -> None:
        if len(paths) > self.config.max_paths_per_request:
            raise RequestError(
                TOO_LARGE,
                f"paths: {len(paths)} exceeds the limit of {self.config.max_paths_per_request}",
                request.request_id,
            )

    def follow_up(self, waiter: Waiter) -> None:
        """Answer a waiter with nothing out now, or watch its deadline."""
        if waiter.outstanding == 0:
            self.answer(waiter)
        elif waiter.deadline is not None:
            heapq.heappush(self._deadlines, (waiter.deadline, next(self._sequence), waiter))

    def list_turned_away(self, reply: dict[str, Any], admission: Admission, limit: int) -> None:
        """An ack's `failures`: the files turned away at once (none of them was queued)."""
        listed = itertools.islice(
            turned_away(admission.rejected_paths, admission.dropped_paths), limit)
        failures = [self.failure(*failure) for failure in listed]
        reply["failures"] = failures
        reply["failures_truncated"] = admission.rejected + admission.dropped - len(failures)

    def path_of(self, where: Any) -> Any:
        """A failure's or a result's path: the caller's own (refused by the supervisor),
        or the canonical one for (root_index, relative) (settled by a worker)."""
        return self.roots.path_of(*where) if type(where) is tuple else where

    def failure(self, where: Any, outcome: str, reason: str) -> dict[str, Any]:
        """One entry of `failures`."""
        return {"path": self.path_of(where), "outcome": outcome, "reason": reason}

    def answer(self, waiter: Waiter) -> None:
        """The one place a followed request ends: feed the stale detector, then reply."""
        if waiter.answered:
            return
        waiter.answered = True
        if waiter.deadline is not None and waiter.deadline > time.monotonic():
            self._forget_deadline()  # answered before its deadline: its heap entry is stale
        if waiter.profile is not None:
            self.kv.record(waiter.profile, waiter.fingerprint, waiter.outcomes)
        if waiter.reply_to is None:
            return
        elapsed = time.monotonic() - waiter.started
        if waiter.inspection is not None:
            waiter.reply_to.send(self.inspection_reply(waiter, waiter.inspection, elapsed))
            return
        self.wait_latency.observe(elapsed)
        reply = ok_reply(
            waiter.request_id,
            accepted=waiter.accepted,
            dropped=waiter.dropped,
            rejected=waiter.rejected,
            outcomes=waiter.outcome_map(),
            elapsed_us=int(elapsed * 1e6),
            **waiter.reply_fields,
        )
        if waiter.failures or waiter.failures_truncated:
            reply["failures"] = [self.failure(*entry) for entry in waiter.failures]
            reply["failures_truncated"] = waiter.failures_truncated
        waiter.reply_to.send(reply)

    def inspection_reply(self, waiter: Waiter, inspection: Inspection,
                         elapsed: float) -> dict[str, Any]:
        states = {name: inspection.states.get(name, 0) for name in CHECK_STATES}
        reply = ok_reply(
            waiter.request_id,
            files=sum(states.values()),
            resident_files=states["resident"],
            size_bytes=inspection.size_bytes,
            resident_bytes=inspection.resident_bytes,
            states=states,
            elapsed_us=int(elapsed * 1e6),
        )
        if inspection.evict:
            reply["evicted_files"] = states["resident"] + states["cold"]
        if inspection.details:
            results = []
            for where, state, size, cached, tier, reason in inspection.results:
                result = {
                    "path": self.path_of(where),
                    "state": state, "size": size, "resident_bytes": cached, "tier_bytes": tier,
                }
                if reason:
                    result["reason"] = reason
                results.append(result)
            reply["results"] = results
        return reply

    # ---- deadlines -------------------------------------------------------------------------

    def _forget_deadline(self) -> None:
        self._answered_early += 1
        if self._answered_early > 64 and 2 * self._answered_early > len(self._deadlines):
            self._deadlines = [entry for entry in self._deadlines if not entry[2].answered]
            heapq.heapify(self._deadlines)
            self._answered_early = 0

    @property
    def deadlines(self) -> int:
        """Entries in the deadline heap (the `bounds` stats section)."""
        return len(self._deadlines)

    def next_due(self, now: float) -> float | None:
        return max(0.0, self._deadlines[0][0] - now) if self._deadlines else None

    def expire(self, now: float) -> None:
        """Answer every waiter whose deadline passed with what it has; the rest `expired`."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, waiter = heapq.heappop(self._deadlines)
            self.expire_waiter(waiter)

    def expire_waiter(self, waiter: Waiter) -> None:
        if not waiter.answered:
            self.books.expire(waiter)
            self.answer(waiter)
