"""Fault injection for tests: failures that cannot be provoked honestly from outside.

Off unless KVPREFETCHD_FAULTS names the fault (comma-separated), so production
paths never pay more than one environment lookup at worker start.
"""

from __future__ import annotations

import os

WORKER_BOOT_FAILS = "worker_boot_fails"


def injected(name: str) -> bool:
    return name in os.environ.get("KVPREFETCHD_FAULTS", "").split(",")
