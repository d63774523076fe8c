"""Children killed but not yet gone: tracked until the kernel lets them go.

A process blocked in a file system that does not answer (a FUSE request already read
by its server, a hard NFS mount) sleeps uninterruptibly: SIGKILL is delivered only
when the request returns, which may be never. Such a child cannot be waited for, so
the supervisor does not wait: it records the pid here, reaps it whenever it exits,
shows the list in stats, caps how many it lets pile up before it stops replacing
them (each one holds its memory and threads), and names every one still there when
the daemon exits, so none outlives it silently.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvprefetch.stats import StuckProcess

log = logging.getLogger("kvprefetchd")


@dataclass(frozen=True)
class StuckChild:
    pid: int
    role: str  # "worker" or "scout"
    why: str
    since: float  # monotonic


class Stuck:
    def __init__(self) -> None:
        self.children: dict[int, StuckChild] = {}
        self.reaped = 0

    def add(self, pid: int, role: str, why: str) -> None:
        self.children[pid] = StuckChild(pid, role, why, time.monotonic())

    def exited(self, pid: int) -> bool:
        """A reaped pid: True when it was one of these (now gone for good)."""
        if self.children.pop(pid, None) is None:
            return False
        self.reaped += 1
        return True

    def count(self, role: str) -> int:
        return sum(1 for child in self.children.values() if child.role == role)

    def report(self) -> list[StuckProcess]:
        now = time.monotonic()
        return [{"pid": c.pid, "role": c.role, "why": c.why, "for_s": round(now - c.since, 1)}
                for c in self.children.values()]

    def say_left_behind(self) -> None:
        """At exit: every child still stuck, by pid, with how long and why."""
        now = time.monotonic()
        for child in self.children.values():
            log.warning("%s pid %d is still stuck in the kernel after %.0f s (%s): left "
                        "behind; it exits when its file system answers",
                        child.role, child.pid, now - child.since, child.why)
