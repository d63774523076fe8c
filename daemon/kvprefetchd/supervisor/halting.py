"""Stopping the workers by a deadline, however they behave."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence

from kvprefetchd.supervisor.stuck import Stuck


def reaped_by(pid: int, deadline: float) -> bool:
    """Wait for a child to exit until deadline (monotonic); True once it is gone."""
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def halt_workers(pids: Sequence[int], deadline: float, stuck: Stuck) -> None:
    """SIGTERM, half the time left, then SIGKILL; one still there after that is stuck in
    the kernel (D state dies only when its I/O returns) and is left behind, named
    (stuck.py)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)  # a stopped worker acts on SIGTERM only then
        except ProcessLookupError:
            pass
    halfway = time.monotonic() + max(0.0, deadline - time.monotonic()) / 2
    stubborn = [pid for pid in pids if not reaped_by(pid, halfway)]
    for pid in stubborn:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in stubborn:
        if not reaped_by(pid, deadline):
            stuck.add(pid, "worker", "did not exit when the daemon stopped")
