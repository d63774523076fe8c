"""Fault injection for tests: failures that cannot be provoked honestly from outside.

Off unless KVPREFETCHD_FAULTS names the fault (comma-separated; a fault that
takes an argument is written `name=value`), so production paths never pay more
than one environment lookup at worker start, and one `is None` test per batch.

  worker_boot_fails           the worker fails to build its engine and exits
                              EXIT_BOOT_FAILED (the supervisor must halt).
  worker_hang_on=SUBSTRING    a worker handed a batch with a path containing
                              SUBSTRING never returns from it, as a worker stuck
                              in a native call on a dead tier would (the
                              supervisor's heartbeat must kill and replace it).
  worker_batch_sleep=SECONDS  every batch takes SECONDS longer: a slow tier that
                              still makes progress (it must not be killed).
"""

from __future__ import annotations

import os
import time

WORKER_BOOT_FAILS = "worker_boot_fails"
WORKER_HANG_ON = "worker_hang_on"
WORKER_BATCH_SLEEP = "worker_batch_sleep"


def _entries() -> list[str]:
    return [entry.strip() for entry in os.environ.get("KVPREFETCHD_FAULTS", "").split(",")]


def injected(name: str) -> bool:
    return name in _entries()


def argument(name: str) -> str | None:
    """The value of `name=value` in KVPREFETCHD_FAULTS; None when that fault is not injected."""
    for entry in _entries():
        key, sep, value = entry.partition("=")
        if sep and key == name:
            return value
    return None


class BatchFaults:
    """The faults a worker applies to each batch, read once at its start.

    `BatchFaults.from_environment()` is None when none is injected, so the
    worker's hot path tests one attribute and nothing else.
    """

    def __init__(self, hang_on: bytes | None, sleep_seconds: float) -> None:
        self.hang_on = hang_on
        self.sleep_seconds = sleep_seconds

    @classmethod
    def from_environment(cls) -> BatchFaults | None:
        hang_on = argument(WORKER_HANG_ON)
        sleep = argument(WORKER_BATCH_SLEEP)
        if not hang_on and not sleep:
            return None
        return cls(os.fsencode(hang_on) if hang_on else None, float(sleep) if sleep else 0.0)

    def apply(self, relatives: list[bytes]) -> None:
        """Called with a batch's paths (relative to their roots) before the engine runs it."""
        if self.sleep_seconds:
            time.sleep(self.sleep_seconds)
        if self.hang_on is not None and any(self.hang_on in path for path in relatives):
            while True:  # wedged: nothing but a signal ends this
                time.sleep(3600)
