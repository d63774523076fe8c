"""Prometheus figures: latency histograms, the exposition of `stats`, and a tiny HTTP responder.

Three parts, each usable alone:

- `Histogram` (and `Histograms`, one per label value): fixed buckets, pure
  arithmetic, cheap enough to observe every acknowledgement. The supervisor
  keeps them and puts their `snapshot()` in `stats["latency"]`.
- `render(stats)`: the Prometheus text format (0.0.4) of a `stats` reply, built
  with prometheus_client from a custom collector over a private registry, so the
  page says exactly what the `stats` op says, no second set of books.
- `MetricsServer`: an HTTP/1.0 responder for `GET /metrics`, driven by the
  supervisor's own `selectors` loop: no threads (forking stays safe), no
  http.server. Each client is bounded (8 KiB of request header, 2 s from accept
  to close, at most 32 at once); anything else gets 404/405/400/431 and is closed.

Snapshot format (what `Histogram.snapshot()` returns and `render` reads)::

    {"buckets": [0.001, 0.01, 0.1],   # finite upper bounds, increasing
     "counts":  [5, 2, 0, 1],         # per bucket, NOT cumulative; the last is > max bound
     "sum": 0.123, "count": 8}

Integration in the supervisor (about fifteen lines)::

    from kvprefetchd import metrics

    # __init__ / run(), once the selector exists (before or after forking: workers
    # close every inherited fd they do not own):
    self.metrics = None
    if self.config.metrics:
        self.metrics = metrics.MetricsServer.open(
            self.config.metrics, lambda: metrics.render(self.stats()))
        self.metrics.attach(self.selector)

    # run_once(), in the dispatch on key.data:
    elif self.metrics is not None and self.metrics.handles(data):
        self.metrics.on_event(key, events)
    # ... and after the dispatch loop:
    if self.metrics is not None:
        self.metrics.expire(time.monotonic())

    # next_timeout(): never sleep past a client's deadline
    if self.metrics is not None:
        due = self.metrics.next_timeout(time.monotonic())
        if due is not None:
            timeout = due if timeout is None else min(timeout, due)

    # halt():
    if self.metrics is not None:
        self.metrics.close()
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import math
import os
import selectors
import socket
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvprefetchd.protocol import OPS
from kvprefetchd.server import ACCEPT_REST, accept_ready, listen_unix, out_of_fds

log = logging.getLogger("kvprefetchd.metrics")

# The exposition format generate_latest() writes (prometheus_client 0.20+ also
# knows 1.0.0, but 0.0.4 is what every scraper parses and what we emit).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# ---- histograms ------------------------------------------------------------------------------

# Acknowledgements are the daemon's promise (microseconds for a fire-and-forget
# prefetch, tens of ms for 100k paths), so the ack buckets start at 10 us.
ACK_BUCKETS: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)
# A file's latency (queued -> outcome): page-cache hits in tens of us, a recall
# from a remote tier in seconds.
FILE_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
# A `wait` request's elapsed time: at most its timeout_ms, usually under a second.
WAIT_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)


class Histogram:
    """Counts of observations per bucket (`value <= bound`, as Prometheus' `le`), sum, count."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = ACK_BUCKETS) -> None:
        bounds = tuple(float(b) for b in bounds)
        if not bounds:
            raise ValueError("a histogram needs at least one bucket bound")
        if any(not math.isfinite(b) for b in bounds):
            raise ValueError("bucket bounds must be finite (+Inf is implicit)")
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError("bucket bounds must increase strictly")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if value != value:  # NaN: a bug upstream must not poison the sum
            return
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def merge(self, counts: Sequence[int], total: float) -> None:
        """Add another histogram's bucket counts and sum (same bounds), e.g. a worker's."""
        if len(counts) != len(self.counts):
            raise ValueError("histograms with different buckets cannot be merged")
        for index, n in enumerate(counts):
            self.counts[index] += n
        self.count += sum(counts)
        self.sum += total

    def snapshot(self) -> dict[str, Any]:
        return {
            "buckets": list(self.bounds),
            "counts": list(self.counts),
            "sum": self.sum,
            "count": self.count,
        }

    def quantile(self, q: float) -> float | None:
        """An estimate as PromQL's histogram_quantile makes it (linear within a bucket)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError("q must be within [0, 1]")
        if self.count == 0:
            return None
        rank = q * self.count
        seen = 0
        for index, n in enumerate(self.counts):
            if n and seen + n >= rank:
                if index == len(self.bounds):  # beyond the last bound: all we know is the bound
                    return self.bounds[-1]
                low = self.bounds[index - 1] if index else 0.0
                high = self.bounds[index]
                return low + (high - low) * (rank - seen) / n
            seen += n
        return self.bounds[-1]


class Histograms:
    """One Histogram per label value (e.g. per op), created on first use."""

    def __init__(self, bounds: Sequence[float] = ACK_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.by_label: dict[str, Histogram] = {}

    def observe(self, label: str, value: float) -> None:
        histogram = self.by_label.get(label)
        if histogram is None:
            histogram = self.by_label[label] = Histogram(self.bounds)
        histogram.observe(value)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {label: h.snapshot() for label, h in sorted(self.by_label.items())}


def _cumulative_buckets(snapshot: Mapping[str, Any]) -> tuple[list[tuple[str, float]], float]:
    """Prometheus' cumulative (le, count) pairs from a snapshot; ValueError if malformed."""
    bounds = [float(b) for b in snapshot["buckets"]]
    counts = [int(c) for c in snapshot["counts"]]
    if len(counts) != len(bounds) + 1:
        raise ValueError(f"{len(counts)} counts for {len(bounds)} bounds (want bounds + 1)")
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip([*bounds, math.inf], counts, strict=True):
        running += n
        buckets.append(("+Inf" if bound == math.inf else _float_text(bound), float(running)))
    return buckets, float(snapshot.get("sum", 0.0))


def _float_text(value: float) -> str:
    # repr() is the shortest exact text ("0.0001", "1e-05"); Prometheus parses both.
    return repr(float(value))


# ---- the exposition of `stats` ---------------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


class StatsCollector(Collector):
    """Turns one `stats` dict into metric families (a fresh collector per scrape)."""

    def __init__(self, stats: Mapping[str, Any]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        for family in itertools.chain(
            self._identity(stats),
            self._requests(stats.get("requests") or {}),
            self._files(stats),
            self._workers(stats),
            self._kv(stats.get("kv") or {}),
            self._latency(stats.get("latency") or {}),
        ):
            if family.samples:  # a family with nothing to say is left out, not sent empty
                yield family

    # -- one group per stats section --

    def _identity(self, stats: Mapping[str, Any]) -> Iterator[Metric]:
        build = InfoMetricFamily("kvprefetchd_build", "The daemon's version.")
        build.add_metric([], {"version": str(stats.get("version", ""))})
        yield build
        engine = InfoMetricFamily(
            "kvprefetchd_engine", "The I/O engine the workers run and the warm mode."
        )
        engine.add_metric([], {k: str(stats.get(k, "")) for k in ("engine", "warm_mode")})
        yield engine
        if (uptime := _number(stats.get("uptime_s"))) is not None:
            yield GaugeMetricFamily(
                "kvprefetchd_uptime_seconds", "Seconds since the supervisor started.", value=uptime
            )
        if (connections := _number(stats.get("connections"))) is not None:
            yield GaugeMetricFamily(
                "kvprefetchd_connections", "Client connections open now.", value=connections
            )
        roots = InfoMetricFamily(
            "kvprefetchd_root", "An allowed root, its file system and its residency rule."
        )
        for root in stats.get("roots") or []:
            roots.add_metric(
                [], {k: str(root.get(k, "")) for k in ("root", "fstype", "rule")}
            )
        yield roots
        supervisor = stats.get("supervisor") or {}
        yield from self._process("kvprefetchd_supervisor", "The supervisor", [], [supervisor])

    def _requests(self, requests: Mapping[str, Any]) -> Iterator[Metric]:
        """{op: n, "error_CODE": n, "op:result": n, other events} -> requests_total{op,result}.

        A bare op counts every request of that op the daemon parsed (result
        "received"); `error_CODE` counts errors whose op is not recorded (op
        "unknown"); an "op:result" key is rendered exactly. Other keys
        (connections_refused, reload_refused, ...) are events_total{event}.
        """
        by_pair: dict[tuple[str, str], float] = {}
        events: dict[str, float] = {}
        for key, raw in requests.items():
            value = _number(raw)
            if value is None:
                continue
            key = str(key)
            if ":" in key:
                op, _, result = key.partition(":")
                pair = (op, result.removeprefix("error_"))
            elif key in OPS:
                pair = (key, "received")
            elif key.startswith("error_"):
                pair = ("unknown", key.removeprefix("error_"))
            elif key == "too_large":  # an oversized frame: refused before it had an op
                pair = ("unknown", "too_large")
            else:
                events[key] = events.get(key, 0.0) + value
                continue
            by_pair[pair] = by_pair.get(pair, 0.0) + value
        family = CounterMetricFamily(
            "kvprefetchd_requests",
            "Requests by op and result (received: parsed and dispatched; otherwise an error "
            "code; op unknown when the request never parsed).",
            labels=["op", "result"],
        )
        for (op, result), value in sorted(by_pair.items()):
            family.add_metric([op, result], value)
        yield family
        other = CounterMetricFamily(
            "kvprefetchd_events", "Other counted events (refused connections, reloads).",
            labels=["event"],
        )
        for event, value in sorted(events.items()):
            other.add_metric([event], value)
        yield other

    def _files(self, stats: Mapping[str, Any]) -> Iterator[Metric]:
        files = stats.get("files") or {}
        outcomes = CounterMetricFamily(
            "kvprefetchd_files",
            "Files by outcome (protocol v1 outcomes; rejected counts the supervisor's and the "
            "workers' refusals).",
            labels=["outcome"],
        )
        merged: dict[str, float] = {}
        for key, outcome in (
            ("read", "read"), ("resident", "resident"), ("missing", "missing"),
            ("rejected", "rejected"), ("rejected_by_supervisor", "rejected"),
            ("failed", "failed"), ("dropped", "dropped"),
        ):
            if (value := _number(files.get(key))) is not None:
                merged[outcome] = merged.get(outcome, 0.0) + value
        for outcome, value in merged.items():
            outcomes.add_metric([outcome], value)
        yield outcomes
        for key, name, kind, doc in (
            ("accepted", "kvprefetchd_files_accepted", "counter",
             "Files queued to a worker."),
            ("dropped", "kvprefetchd_dropped", "counter",
             "Files dropped because their worker's queue was full."),
            ("expired_replies", "kvprefetchd_expired_replies", "counter",
             "Wait requests answered at their timeout before every file had an outcome."),
            ("in_flight", "kvprefetchd_files_in_flight", "gauge",
             "Files queued or being read now."),
        ):
            if (value := _number(files.get(key))) is not None:
                yield _single(name, doc, kind, value)
        if (value := _number(stats.get("bytes_read"))) is not None:
            yield _single(
                "kvprefetchd_bytes_read", "Bytes read to warm files.", "counter", value
            )
        if (value := _number(stats.get("worker_restarts"))) is not None:
            yield _single(
                "kvprefetchd_worker_restarts",
                "Workers respawned after dying or being killed as wedged.", "counter", value,
            )
        if (value := _number(stats.get("workers_killed_wedged"))) is not None:
            yield _single(
                "kvprefetchd_workers_killed_wedged",
                "Workers killed (and replaced) for owing outcomes and saying nothing for "
                "worker_timeout.", "counter", value,
            )

    def _workers(self, stats: Mapping[str, Any]) -> Iterator[Metric]:
        workers = [w for w in stats.get("workers") or [] if isinstance(w, Mapping)]
        labels = [str(w.get("index", i)) for i, w in enumerate(workers)]
        depth = GaugeMetricFamily(
            "kvprefetchd_queue_depth", "Files outstanding per worker.", labels=["worker"]
        )
        ready = GaugeMetricFamily(
            "kvprefetchd_worker_ready", "1 once a worker has booted.", labels=["worker"]
        )
        batches = CounterMetricFamily(
            "kvprefetchd_worker_batches", "Engine batches run, per worker (since it started).",
            labels=["worker"],
        )
        silent = GaugeMetricFamily(
            "kvprefetchd_worker_silent_seconds",
            "Seconds since a worker that owes outcomes last reported (0 when it owes none); "
            "at worker_timeout it is killed as wedged.",
            labels=["worker"],
        )
        dedup = CounterMetricFamily(
            "kvprefetchd_worker_dedup",
            "Files skipped as duplicates, per worker (recent: warmed within dedup_ttl_ms; "
            "in_flight: already being read).",
            labels=["worker", "kind"],
        )
        limits = set()
        for label, worker in zip(labels, workers, strict=True):
            if (value := _number(worker.get("queue_depth"))) is not None:
                depth.add_metric([label], value)
            if (value := _number(worker.get("ready"))) is not None:
                ready.add_metric([label], value)
            if (value := _number(worker.get("silent_s"))) is not None:
                silent.add_metric([label], value)
            batches.add_metric([label], _number(worker.get("batches")) or 0.0)
            for kind in ("recent", "in_flight"):
                dedup.add_metric([label, kind], _number(worker.get(f"dedup_{kind}")) or 0.0)
            if (value := _number(worker.get("queue_limit"))) is not None:
                limits.add(value)
        yield depth
        if limits:
            yield GaugeMetricFamily(
                "kvprefetchd_queue_limit",
                "Files a worker may have outstanding before new ones are dropped.",
                value=max(limits),
            )
        yield ready
        yield silent
        yield batches
        yield dedup
        yield from self._process("kvprefetchd_worker", "A worker", ["worker"], workers, labels)

    @staticmethod
    def _process(
        prefix: str,
        who: str,
        label_names: list[str],
        rows: Sequence[Mapping[str, Any]],
        label_values: Sequence[str] | None = None,
    ) -> Iterator[Metric]:
        """rss_bytes, cpu_seconds and open_fds (psutil figures) of one or more processes."""
        rss = GaugeMetricFamily(
            f"{prefix}_rss_bytes", f"{who}'s resident set size.", labels=label_names
        )
        cpu = CounterMetricFamily(
            f"{prefix}_cpu_seconds", f"{who}'s user and system CPU time.", labels=label_names
        )
        fds = GaugeMetricFamily(
            f"{prefix}_open_fds", f"{who}'s open file descriptors.", labels=label_names
        )
        values = label_values or [""] * len(rows)
        for label, row in zip(values, rows, strict=True):
            key = [label] if label_names else []
            if (value := _number(row.get("rss_bytes"))) is not None:
                rss.add_metric(key, value)
            if (value := _number(row.get("cpu_seconds"))) is not None:
                cpu.add_metric(key, value)
            if (value := _number(row.get("open_fds"))) is not None:
                fds.add_metric(key, value)
        for family in (rss, cpu, fds):
            if family.samples:
                yield family

    def _kv(self, kv: Mapping[str, Any]) -> Iterator[Metric]:
        if (value := _number(kv.get("resolved_requests"))) is not None:
            yield _single(
                "kvprefetchd_kv_resolved_requests",
                "KV requests (prefetch_blocks, resolve) mapped to paths.", "counter", value,
            )
        if (value := _number(kv.get("resolve_ms_total"))) is not None:
            yield _single(
                "kvprefetchd_kv_resolve_seconds",
                "Time spent hashing and mapping KV requests to paths.", "counter", value / 1e3,
            )
        stale_report = kv.get("stale") or {}
        profiles = sorted({str(p) for p in kv.get("profiles") or []} | set(map(str, stale_report)))
        stale = GaugeMetricFamily(
            "kvprefetchd_kv_profile_stale",
            "1 when a model profile's fingerprint looks stale (its files keep missing while "
            "another folder of the model exists).",
            labels=["profile"],
        )
        streak = GaugeMetricFamily(
            "kvprefetchd_kv_profile_missing_streak",
            "Consecutive missing files under a model profile's fingerprint.",
            labels=["profile"],
        )
        for profile in profiles:
            entry = stale_report.get(profile) or {}
            stale.add_metric([profile], 1.0 if entry.get("stale") else 0.0)
            if (value := _number(entry.get("missing_streak"))) is not None:
                streak.add_metric([profile], value)
        yield stale
        yield streak

    def _latency(self, latency: Mapping[str, Any]) -> Iterator[Metric]:
        ack = HistogramMetricFamily(
            "kvprefetchd_request_ack_seconds",
            "Time from a request's frame to its acknowledgement being queued, per op.",
            labels=["op"],
        )
        for op, snapshot in sorted((latency.get("ack_seconds") or {}).items()):
            _add_histogram(ack, [str(op)], snapshot)
        yield ack
        for key, name, doc in (
            ("wait_seconds", "kvprefetchd_wait_seconds",
             "Elapsed time of wait requests, until every file had an outcome or the timeout."),
            ("file_seconds", "kvprefetchd_file_seconds",
             "Time from a file being queued to its outcome."),
        ):
            family = HistogramMetricFamily(name, doc)
            if key in latency:
                _add_histogram(family, [], latency[key])
            yield family


def _single(name: str, doc: str, kind: str, value: float) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, doc, value=value)
    return GaugeMetricFamily(name, doc, value=value)


def _add_histogram(family: HistogramMetricFamily, labels: list[str], snapshot: Any) -> None:
    try:
        buckets, total = _cumulative_buckets(snapshot)
    except (KeyError, TypeError, ValueError) as error:
        log.debug("skipping malformed histogram %s%s: %s", family.name, labels, error)
        return
    family.add_metric(labels, buckets, total)


def render(stats: Mapping[str, Any]) -> bytes:
    """The Prometheus text exposition (format 0.0.4) of a `stats` reply."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    return generate_latest(registry)


# ---- where to listen -------------------------------------------------------------------------


class MetricsAddressError(ValueError):
    """The `metrics` setting is not "HOST:PORT", "[IPV6]:PORT" or "unix:/PATH"."""


@dataclass(frozen=True)
class MetricsAddress:
    family: socket.AddressFamily
    host: str = ""  # an IP literal (TCP)
    port: int = 0
    path: str = ""  # AF_UNIX

    def __str__(self) -> str:
        if self.family == socket.AF_UNIX:
            return f"unix:{self.path}"
        if self.family == socket.AF_INET6:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"


_FORMS = '"127.0.0.1:9464", "[::1]:9464" or "unix:/run/kvprefetchd/metrics.sock"'


def parse_metrics_address(text: str) -> MetricsAddress:
    """Parse (and validate, without binding) the `metrics` setting.

    Only IP literals (and "localhost", meaning 127.0.0.1): resolving a name at
    start would make the listening address depend on DNS.
    """
    if not isinstance(text, str) or not text:
        raise MetricsAddressError(f"metrics: expected {_FORMS}")
    if text.startswith(("unix:", "/")):
        path = text.removeprefix("unix:")
        if not path.startswith("/"):
            raise MetricsAddressError(f"metrics: {text!r}: a Unix socket path must be absolute")
        if len(os.fsencode(path)) > 107:  # sun_path is 108 bytes with its NUL
            raise MetricsAddressError(f"metrics: {text!r}: path longer than 107 bytes")
        return MetricsAddress(socket.AF_UNIX, path=path)
    if text.startswith("["):
        host, sep, port_text = text[1:].partition("]:")
        if not sep:
            raise MetricsAddressError(f"metrics: {text!r}: expected {_FORMS}")
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise MetricsAddressError(
                f"metrics: {text!r}: expected {_FORMS} (say 0.0.0.0:PORT for every interface)"
            )
        if ":" in host:
            raise MetricsAddressError(f"metrics: {text!r}: write an IPv6 address in brackets")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise MetricsAddressError(f"metrics: {text!r}: {host!r} is not an IP address") from None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise MetricsAddressError(f"metrics: {text!r}: {port_text!r} is not a port number")
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    return MetricsAddress(family, host=str(ip), port=int(port_text))


def open_metrics_listener(
    address: str | MetricsAddress, *, mode: int = 0o660, backlog: int = 64
) -> socket.socket:
    """A non-blocking listening socket for the `metrics` setting (port 0: any free port).

    A Unix socket is bound like the main one (umask around bind, a stale file
    replaced, a live one refused: kvprefetchd.server.listen_unix).
    """
    where = address if isinstance(address, MetricsAddress) else parse_metrics_address(address)
    if where.family == socket.AF_UNIX:
        return listen_unix(where.path, mode, backlog)
    sock = socket.socket(where.family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((where.host, where.port))
        sock.listen(backlog)
    except OSError as error:
        sock.close()
        raise OSError(error.errno, error.strerror, f"metrics {where.host}:{where.port}") from error
    sock.setblocking(False)
    return sock


# ---- the HTTP responder ----------------------------------------------------------------------

MAX_HEADER_BYTES = 8 * 1024
CLIENT_DEADLINE = 2.0  # seconds from accept to close, whatever the client does
MAX_CLIENTS = 32
_READING, _WRITING, _DRAINING = "reading", "writing", "draining"
_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
}


class _Client:
    __slots__ = ("deadline", "inbound", "outbound", "server", "sock", "state")

    def __init__(self, server: MetricsServer, sock: socket.socket, deadline: float) -> None:
        self.server = server
        self.sock = sock
        self.deadline = deadline
        self.inbound = bytearray()
        self.outbound = b""
        self.state = _READING


class MetricsServer:
    """GET /metrics over HTTP/1.0, one response per connection, on the caller's selector.

    Every selector key it registers carries itself or one of its clients as
    `data`; `handles(data)` tells the supervisor's dispatch which keys are its.
    After the response it shuts its side down and reads until the client closes
    (or the deadline), so unread request bytes never turn the close into a reset
    that could cut the response short.
    """

    def __init__(
        self,
        listener: socket.socket,
        get_body: Callable[[], bytes],
        *,
        unlink_path: str | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        deadline: float = CLIENT_DEADLINE,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        listener.setblocking(False)
        self.listener = listener
        self.get_body = get_body
        self.unlink_path = unlink_path
        self.max_header_bytes = max_header_bytes
        self.deadline = deadline
        self.max_clients = max_clients
        self.clock = clock
        self.selector: selectors.BaseSelector | None = None
        self.clients: dict[int, _Client] = {}
        self.counts = {"served": 0, "not_found": 0, "bad": 0, "refused": 0, "expired": 0}
        self.resting_until: float | None = None  # out of fds: the listener is not watched
        self.out_of_fds = False  # logged once per episode, not once per rest

    @classmethod
    def open(
        cls, address: str | MetricsAddress, get_body: Callable[[], bytes], **options: Any
    ) -> MetricsServer:
        """Bind `address` (the `metrics` setting) and serve it; a Unix socket goes on close."""
        where = address if isinstance(address, MetricsAddress) else parse_metrics_address(address)
        listener = open_metrics_listener(where)
        unlink = where.path if where.family == socket.AF_UNIX else None
        return cls(listener, get_body, unlink_path=unlink, **options)

    # -- the loop's side --

    def attach(self, selector: selectors.BaseSelector) -> None:
        self.selector = selector
        selector.register(self.listener, selectors.EVENT_READ, self)

    def handles(self, data: object) -> bool:
        return data is self or (isinstance(data, _Client) and data.server is self)

    def on_event(self, key: selectors.SelectorKey, events: int) -> None:
        data = key.data
        if data is self:
            self._accept()
        elif isinstance(data, _Client):
            if events & selectors.EVENT_READ:
                self._read(data)
            if events & selectors.EVENT_WRITE and data.state == _WRITING:
                self._write(data)

    def next_timeout(self, now: float) -> float | None:
        """Seconds until the earliest client deadline or the end of a rest (None: neither)."""
        dues = [c.deadline for c in self.clients.values()]
        if self.resting_until is not None:
            dues.append(self.resting_until)
        return max(0.0, min(dues) - now) if dues else None

    def expire(self, now: float) -> int:
        """Close every client past its deadline (slow or silent ones); returns how many.

        Also puts a resting listener (see _accept) back in the selector once its rest is over.
        """
        if self.resting_until is not None and now >= self.resting_until:
            self.resting_until = None
            if self.selector is not None:
                self.selector.register(self.listener, selectors.EVENT_READ, self)
        late = [c for c in self.clients.values() if c.deadline <= now]
        for client in late:
            if client.state != _DRAINING:
                self.counts["expired"] += 1
            self._close(client)
        return len(late)

    def close(self) -> None:
        for client in list(self.clients.values()):
            self._close(client)
        if self.selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.listener)
        self.listener.close()
        if self.unlink_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unlink_path)
            self.unlink_path = None

    # -- the work --

    def _accept(self) -> None:
        try:
            self._accept_ready()
        except OSError as error:
            if not out_of_fds(error) or self.selector is None:
                raise
            # Rest instead of spinning on a listener that stays readable (server.ACCEPT_REST).
            if not self.out_of_fds:
                self.out_of_fds = True
                log.warning("metrics: cannot accept connections: %s; pausing accept %.1f s",
                            error.strerror, ACCEPT_REST)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.listener)
            self.resting_until = self.clock() + ACCEPT_REST
            return
        self.out_of_fds = False

    def _accept_ready(self) -> None:
        for sock in accept_ready(self.listener, "metrics"):
            if len(self.clients) >= self.max_clients or self.selector is None:
                self.counts["refused"] += 1
                sock.close()
                continue
            client = _Client(self, sock, self.clock() + self.deadline)
            self.clients[sock.fileno()] = client
            self.selector.register(sock, selectors.EVENT_READ, client)

    def _read(self, client: _Client) -> None:
        try:
            data = client.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client closed (or reset): nothing more to say to it
            self._close(client)
            return
        if client.state != _READING:
            return  # draining (or a pipelined extra request): discarded
        client.inbound += data
        end = _header_end(client.inbound)
        if end < 0:
            if len(client.inbound) > self.max_header_bytes:
                self._respond(client, 431, b"request header too large\n")
            return
        if end > self.max_header_bytes:
            self._respond(client, 431, b"request header too large\n")
            return
        self._answer(client, bytes(client.inbound[:end]))

    def _answer(self, client: _Client, head: bytes) -> None:
        line = head.split(b"\n", 1)[0].rstrip(b"\r")
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            self.counts["bad"] += 1
            self._respond(client, 400, b"bad request\n")
            return
        method, target = parts[0], parts[1]
        if method not in (b"GET", b"HEAD"):
            self.counts["bad"] += 1
            self._respond(client, 405, b"only GET\n", extra=b"Allow: GET, HEAD\r\n")
            return
        # urlsplit copes with the query and with the absolute form (RFC 9112 3.2.2).
        if urlsplit(target.decode("latin-1")).path != "/metrics":
            self.counts["not_found"] += 1
            self._respond(client, 404, b"not found: try /metrics\n")
            return
        try:
            body = self.get_body()
        except Exception:  # a bug in the figures must cost one scrape, never the daemon
            log.exception("metrics: rendering failed")
            self._respond(client, 500, b"rendering the metrics failed; see the daemon's log\n")
            return
        self.counts["served"] += 1
        self._respond(
            client, 200, body, content_type=CONTENT_TYPE.encode(), head_only=method == b"HEAD"
        )

    def _respond(
        self,
        client: _Client,
        code: int,
        body: bytes,
        *,
        content_type: bytes = b"text/plain; charset=utf-8",
        extra: bytes = b"",
        head_only: bool = False,
    ) -> None:
        header = (
            b"HTTP/1.0 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
            b"Cache-Control: no-store\r\nConnection: close\r\n%s\r\n"
            % (code, _REASONS[code].encode(), content_type, len(body), extra)
        )
        client.outbound = header if head_only else header + body
        client.inbound.clear()
        client.state = _WRITING
        self._write(client)

    def _write(self, client: _Client) -> None:
        try:
            sent = client.sock.send(client.outbound)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(client)
            return
        client.outbound = client.outbound[sent:]
        if client.outbound:
            self._watch(client, selectors.EVENT_WRITE)
            return
        # All sent: half-close, then wait for the client's EOF (bounded by the deadline).
        client.state = _DRAINING
        try:
            client.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(client)
            return
        self._watch(client, selectors.EVENT_READ)

    def _watch(self, client: _Client, events: int) -> None:
        if self.selector is not None:
            self.selector.modify(client.sock, events, client)

    def _close(self, client: _Client) -> None:
        fd = client.sock.fileno()
        if fd >= 0 and self.clients.get(fd) is client:
            del self.clients[fd]
            if self.selector is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(client.sock)
        with contextlib.suppress(OSError):
            client.sock.close()


def _header_end(buffer: bytearray) -> int:
    """Index just past the blank line ending the header, or -1 (CRLF or bare LF)."""
    crlf = buffer.find(b"\r\n\r\n")
    lf = buffer.find(b"\n\n")
    ends = [i + n for i, n in ((crlf, 4), (lf, 2)) if i >= 0]
    return min(ends) if ends else -1
