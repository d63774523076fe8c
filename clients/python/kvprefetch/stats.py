"""The schema of a `stats` reply: one set of types for the daemon that builds it, the
Prometheus exposition that renders it, the CLI that prints it and the tests that fake it.

It lives in the client package because the client is the wire contract's Python side and
must not import the daemon; the daemon imports it from here. Every key is always present
except the process figures, which psutil may fail to read for a process that just ended.
docs/protocol.md ("The `stats` reply") describes each section.
"""

from __future__ import annotations

from typing import TypedDict


class HistogramSnapshot(TypedDict):
    """Fixed buckets: `counts` per bucket (NOT cumulative), one more than `buckets`, the last
    counting what lies above every bound (Prometheus' +Inf)."""

    buckets: list[float]
    counts: list[int]
    sum: float
    count: int


class ProcessFigures(TypedDict, total=False):
    """What psutil reads of a process; empty when the process is already gone."""

    rss_bytes: int
    cpu_seconds: float
    open_fds: int


class SupervisorStats(ProcessFigures):
    pid: int


class WorkerStats(ProcessFigures):
    index: int
    pid: int
    ready: bool
    engine: str
    queue_depth: int  # files outstanding on this worker
    queue_limit: int  # beyond it new files are dropped
    restarts: int
    silent_s: float  # seconds without a report while owing outcomes (the heartbeat)
    batches: int  # engine batches run since the worker started
    batches_other_mode: int  # of those, batches in a model profile's other warm mode
    dedup_recent: int  # files answered from the memory of heads warmed a moment ago
    dedup_in_flight: int  # files that joined a read already queued or running
    probed_resident: int  # files its fast path found resident (native/probe.c)
    probed_missing: int  # files its fast path found missing (a negative dentry)
    # Hold-open warming since start: files taken, and let go by why: opened (by their
    # consumer), expired (hold_seconds), budget (hold_max_files/bytes), deleted, replaced,
    # evicted, closed; refused: larger than the whole byte budget.
    held_total: int
    hold_released: dict[str, int]
    hold_refused: int
    queue: QueueStats  # the asynchronous queue's state, as last reported


class QueueStats(TypedDict, total=False):
    """The worker's queue engines (native/queue.c), empty before the first report."""

    threads: int  # threads now (grown on demand up to max_in_flight)
    running: int  # reads in flight
    stalled: int  # reads running past the stall time (holding threads, not depth)
    timed_out: int  # files settled `failed` at file_timeout since the worker started
    # root index -> [reads in flight allowed, service time us, requests a second its tier
    # answers as the FUSE connection's gauge learned (0: no gauge)]
    depth: dict[str, list[int]]
    # The lane for files behind another mount beneath their root (other_mount_threads):
    other_mount_threads: int  # its threads now
    other_mount_stuck: int  # of them, held by a read past its stall time
    other_mount_refused: int  # files failed `mount_unresponsive` since the worker started
    # Files refused on arrival (their tier's queue would make them late) and read later,
    # into a slot the tier had free before their consumer could get to them.
    standby_reads: int
    # Hold-open warming (docs/tiers.md): files held open for their consumer now, and
    # their bytes (st_size); only where holding is on.
    held_files: int
    held_bytes: int


class FileCounts(TypedDict):
    """Files by fate, daemon-wide since start: accepted = read + resident + missing +
    rejected + failed + expired + futile + in_flight (expired: past its deadline, never read;
    expired_replies counts answers a wait timeout cut short, not fates)."""

    accepted: int
    dropped: int
    rejected_by_supervisor: int
    read: int
    resident: int
    missing: int
    rejected: int
    failed: int
    expired: int
    # read, but where the consumer cannot find it: the root's file system drops what a
    # warm-up left at the next open (docs/tiers.md)
    futile: int
    expired_replies: int
    in_flight: int


class StaleProfile(TypedDict):
    """A model profile whose files keep coming back `missing` (discover.StaleDetector)."""

    fingerprint: str
    missing: int
    present: int
    missing_streak: int
    stale: bool
    likely_fingerprint: str | None
    sibling_fingerprints: list[str]
    own_folder: bool | None
    hint: str | None


class KVStats(TypedDict):
    profiles: list[str]
    resolved_requests: int
    resolve_ms_total: float
    stale: dict[str, StaleProfile]


class LatencyStats(TypedDict):
    ack_seconds: dict[str, HistogramSnapshot]  # per op
    wait_seconds: HistogramSnapshot
    file_seconds: HistogramSnapshot


# A root's states (RootStats.status), in the order a scrape lists them.
ROOT_STATUSES = ("opening", "open", "missing", "refused", "unresponsive", "error")


class RootStats(TypedDict):
    root: str
    fstype: str  # "unknown" until the root is open
    rule: str  # the residency rule: tier, pagecache or off ("unknown" until open)
    why: str  # why that rule; why the root is not open (or what is wrong with its path)
    # opening (not answered yet), open, missing (its path leads nowhere: no directory
    # held, its files are missing), refused (its path is refused; a directory opened
    # earlier stays in force), unresponsive (its file system does not answer) or error
    status: str
    reopened: int  # times opened again: replaced (removed, mounted over), or back after missing
    extent: str  # what a warm-up reads: head or whole ("unknown" until open; docs/tiers.md)
    # how a warm-up survives to the consumer: pagecache, hold, fs_cache or probe
    keep: str
    futile: bool  # a warmed file was found cold when reopened: its files settle `futile`


class StuckProcess(TypedDict):
    """A child killed (or gone) whose exit the kernel holds back: blocked in a file
    system that does not answer. Reaped, and dropped from the list, when it exits."""

    pid: int
    role: str  # worker or scout
    why: str
    for_s: float


class ScoutStats(TypedDict):
    """The helper process that touches file systems for the supervisor (roots, KV
    discovery and scans), each task with a deadline."""

    tasks: int
    timeouts: int
    restarts: int


class BoundStats(TypedDict):
    """One bounded buffer or per-key map of the supervisor: what it holds now, and the most
    it may (docs/protocol.md lists each by name)."""

    size: int
    limit: int


class Stats(TypedDict):
    uptime_s: float
    version: str
    engine: str
    warm_mode: str
    # "op:ok" or "op:error_CODE" -> count; op "none" for frames that never parsed.
    requests: dict[str, int]
    # Other counted events: reloads, reload_refused, connections_refused, peers_forbidden,
    # peers_revoked, connections_closed_idle, connections_closed_slow, input_waits,
    # replies_too_large, accept_paused; tls_refused, tls_handshake_timeouts,
    # tls_reload_refused (the TCP listener); from the workers: files_checked, files_evicted,
    # noatime_fallbacks (reads preserve_atime could not keep from updating atime).
    events: dict[str, int]
    files: FileCounts
    bytes_read: int
    kv: KVStats
    latency: LatencyStats
    worker_restarts: int
    workers_killed_wedged: int
    supervisor: SupervisorStats
    connections: int
    # Name -> its size and limit: connections, input_pool_bytes, input_bytes, output_bytes,
    # deadlines, stale_profiles, discovered_fingerprints.
    bounds: dict[str, BoundStats]
    roots: list[RootStats]
    scout: ScoutStats
    stuck: list[StuckProcess]
    workers: list[WorkerStats]
