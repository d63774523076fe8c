"""Workers run SCHED_BATCH at worker_nice (config.worker_batch): woken by new files they
never preempt the supervisor or the client its ack just woke. Real daemon, real forked
workers; every thread of a worker (the queue engine's too) carries the policy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvharness.daemon import start_config


def policies(pid: int) -> set[tuple[int, int]]:
    """(policy, nice) of every thread of a process."""
    return {(os.sched_getscheduler(int(tid)), os.getpriority(os.PRIO_PROCESS, int(tid)))
            for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.parametrize("batch", [True, False])
def test_workers_run_batch_at_their_nice_unless_told_not_to(tmp_path: Path, batch: bool) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    (root / "a.bin").write_bytes(b"x" * 4096)
    daemon = start_config(tmp_path, {"roots": [str(root)], "workers": 2, "engine": "pread",
                                     "worker_batch": batch})
    try:
        with daemon.connect() as connection:  # its threads exist once a file was read
            reply = connection.call_ok("prefetch", paths=[str(root / "a.bin")], wait=True)
            assert reply["accepted"] == 1
        want = {(os.SCHED_BATCH if batch else os.SCHED_OTHER, 19)}
        for pid in daemon.worker_pids():
            assert policies(pid) == want, pid
        assert os.sched_getscheduler(daemon.process.pid) == os.SCHED_OTHER
    finally:
        daemon.stop()
