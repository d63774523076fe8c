"""Does a warm-up survive to the consumer? Asked of a root by reopening a file just warmed.

A profile (tiers.py) knows for most file systems; for the rest (rclone, JuiceFS,
gcsfuse and every FUSE file system without a profile: keep = "probe") the worker finds
out the way the consumer would: right after a file is read, it opens the file anew and
looks at its pages (kvp_inspect CHECK, a fresh open, as another process's would be).
A FUSE file system that does not set keep_cache has the kernel drop the pages at that
open: the file is cold again, and so is every file a warm-up leaves for its consumer.

One look can mislead: the host's reclaimer takes a few percent of fresh pages within a
second. So a root is called `dropped` after STRIKES cold looks in a row, over different
files, and `kept` at the first warm one; a verdict is looked at again every RECHECK
seconds (a remount with other options changes it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvprefetchd.channel import Verdict

STRIKES = 2
RECHECK_SECONDS = 600.0


@dataclass
class RootVerdict:
    verdict: str = ""  # "", "kept", "dropped"
    strikes: int = 0
    due: float = 0.0  # monotonic: when to look again


class Verdicts:
    """Per root index: what reopening a freshly warmed file found."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._roots: dict[int, RootVerdict] = {}
        self._clock = clock
        self.changed: list[Verdict] = []  # not reported yet

    def wants_look(self, index: int) -> bool:
        root = self._roots.get(index)
        return root is None or not root.verdict or self._clock() >= root.due

    def looked(self, index: int, warm: bool) -> None:
        root = self._roots.setdefault(index, RootVerdict())
        if warm:
            verdict, root.strikes = "kept", 0
        else:
            root.strikes += 1
            if root.strikes < STRIKES:
                return
            verdict = "dropped"
        root.due = self._clock() + RECHECK_SECONDS
        if verdict != root.verdict:
            root.verdict = verdict
            self.changed.append(Verdict(index, verdict))

    def dropped(self, index: int) -> bool:
        root = self._roots.get(index)
        return root is not None and root.verdict == "dropped"

    def forget(self, index: int) -> None:
        """A root reopened: its directory may be another mount with other options."""
        self._roots.pop(index, None)

    def take_changed(self) -> list[Verdict]:
        changed, self.changed = self.changed, []
        return changed
