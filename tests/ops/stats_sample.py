"""A `stats` reply as the daemon shapes it, for the metrics tests (a module, not a conftest:
tests/conftest.py is imported as `conftest` by the tests that start a real daemon).

Typed by the one stats schema (kvprefetch.stats), so mypy and the test of its keys below
catch a fixture that drifts from what the daemon produces.
"""

from __future__ import annotations

from kvprefetch.stats import Stats
from kvprefetchd.metrics.histogram import (
    ACK_BUCKETS,
    FILE_BUCKETS,
    WAIT_BUCKETS,
    Histogram,
    Histograms,
)


def realistic_stats() -> Stats:
    """The shape of a real `stats` reply, with figures a test can predict."""
    ack = Histograms(ACK_BUCKETS)
    for value in (0.00004, 0.00009, 0.0003):
        ack.observe("prefetch", value)
    ack.observe("ping", 0.00002)
    wait = Histogram(WAIT_BUCKETS)
    wait.observe(0.004)
    wait.observe(0.7)
    files = Histogram(FILE_BUCKETS)
    for value in (0.00003, 0.002, 0.002, 3.0):
        files.observe(value)
    return {
        "uptime_s": 12.5,
        "version": "0.1.0",
        "engine": "io_uring",
        "warm_mode": "read",
        "requests": {
            "ping:ok": 3, "prefetch:ok": 10, "prefetch_blocks:ok": 2, "stats:ok": 1,
            "none:error_bad_request": 1, "unknown:error_unknown_op": 2, "none:error_too_large": 1,
            "prefetch:error_overloaded": 2,
        },
        "events": {"connections_refused": 4, "reload_refused": 1, "reloads": 2},
        "files": {
            "accepted": 40, "dropped": 5, "rejected_by_supervisor": 2, "read": 20,
            "resident": 10, "missing": 6, "rejected": 1, "failed": 1, "expired": 0, "futile": 0,
            "expired_replies": 3,
            "in_flight": 2,
        },
        "bytes_read": 20 * 1048576,
        "kv": {
            "profiles": ["llama", "qwen3-8b"],
            "resolved_requests": 7,
            "resolve_ms_total": 12.5,
            "stale": {
                "qwen3-8b": {"fingerprint": "07d7b166f256", "missing": 300, "present": 0,
                             "missing_streak": 300, "stale": True,
                             "likely_fingerprint": "aaaaaaaaaaaa",
                             "sibling_fingerprints": ["aaaaaaaaaaaa"], "own_folder": False,
                             "hint": "the last 300 files under 07d7b166f256 were all missing"},
            },
        },
        "latency": {
            "ack_seconds": ack.snapshot(),
            "wait_seconds": wait.snapshot(),
            "file_seconds": files.snapshot(),
        },
        "worker_restarts": 1,
        "workers_killed_wedged": 1,
        "supervisor": {"pid": 100, "rss_bytes": 25_000_000, "cpu_seconds": 0.25, "open_fds": 13},
        "connections": 2,
        "bounds": {
            "connections": {"size": 2, "limit": 1040},
            "input_pool_bytes": {"size": 0, "limit": 33554432},
            "input_bytes": {"size": 120, "limit": 101711872},
            "output_bytes": {"size": 0, "limit": 17448304640},
            "deadlines": {"size": 1, "limit": 32832},
            "stale_profiles": {"size": 1, "limit": 1024},
            "discovered_fingerprints": {"size": 0, "limit": 1024},
        },
        "roots": [{"root": "/mnt/kv", "fstype": "gpfs", "rule": "tier", "why": "...",
                   "status": "open", "reopened": 1, "extent": "head", "keep": "pagecache",
                   "futile": False},
                  {"root": "/mnt/later", "fstype": "unknown", "rule": "unknown",
                   "why": "root /mnt/later: /mnt/later does not exist", "status": "missing",
                   "reopened": 0, "extent": "unknown", "keep": "unknown", "futile": False}],
        "scout": {"tasks": 5, "timeouts": 1, "restarts": 1},
        "stuck": [{"pid": 103, "role": "worker", "why": "wedged: silent 60 s", "for_s": 12.5}],
        "workers": [
            {"rss_bytes": 18_000_000, "cpu_seconds": 1.5, "open_fds": 6, "index": 0,
             "pid": 101, "ready": True, "engine": "io_uring", "queue_depth": 3,
             "queue_limit": 8192, "restarts": 1, "silent_s": 2.5, "batches": 9,
             "batches_other_mode": 0, "dedup_recent": 4, "dedup_in_flight": 1,
             "probed_resident": 7, "probed_missing": 2, "held_total": 0, "hold_refused": 0,
             "hold_released": dict.fromkeys(("opened", "expired", "budget", "deleted",
                                             "replaced", "evicted", "closed"), 0),
             "queue": {"threads": 24, "running": 3, "stalled": 1, "timed_out": 0,
                       "other_mount_threads": 4, "other_mount_stuck": 2,
                       "other_mount_refused": 5, "standby_reads": 7,
                       "depth": {"0": [64, 1200, 80]}}},
            {"rss_bytes": 19_000_000, "cpu_seconds": 0.5, "open_fds": 7, "index": 1,
             "pid": 102, "ready": False, "engine": "", "queue_depth": 0,
             "queue_limit": 8192, "restarts": 0, "silent_s": 0.0, "batches": 0,
             "batches_other_mode": 0, "dedup_recent": 0, "dedup_in_flight": 0,
             "probed_resident": 0, "probed_missing": 0, "held_total": 0, "hold_refused": 0,
             "hold_released": dict.fromkeys(("opened", "expired", "budget", "deleted",
                                             "replaced", "evicted", "closed"), 0),
             "queue": {}},
        ],
    }
