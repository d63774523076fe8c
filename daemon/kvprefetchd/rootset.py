"""The allowed roots as the supervisor holds them: opened once, by the scout, as fds.

Each root is opened off the loop (scout.OpenRoot: a no-follow walk with ownership
checks, roots.py) and its directory fd is kept for the daemon's life: workers resolve
beneath it, respawned workers inherit it, and nothing re-resolves the path, so a later
swap of the path (a symlink planted where the root was) changes nothing. A root that
does not exist yet, or whose file system does not answer, is tried again every
RETRY_SECONDS; when it opens, the pool hands its fd to the live workers, and the log
says so. A root refused at start (a symlink, a directory another user could swap)
stops the daemon with the reason; refused later, it is logged and tried again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvprefetch.stats import RootStats
from kvprefetchd.config import Config
from kvprefetchd.native import load_native
from kvprefetchd.residency import RootRule
from kvprefetchd.scout import Failed, OpenRoot, Passed, Scout

log = logging.getLogger("kvprefetchd")

RETRY_SECONDS = 5.0


@dataclass
class RootState:
    index: int
    path: str
    residency: str  # as configured: auto, tier, pagecache, off
    fd: int = -1
    rule: RootRule | None = None  # known once open
    status: str = "opening"  # open, missing, refused, unresponsive, error
    message: str = ""
    asked: bool = False  # a task is out for it
    retry_at: float = 0.0

    @property
    def code(self) -> int:
        """The native residency rule code (KVP_RES_*); off until the rule is known."""
        rule = self.rule.rule if self.rule is not None else "off"
        return int(load_native().rule_codes[rule])


class RootSet:
    def __init__(self, config: Config, scout: Scout,
                 on_open: Callable[[RootState], None]) -> None:
        self.scout = scout
        self.on_open = on_open
        self.checks = config.root_path_checks
        self.states = [RootState(index, root, config.residency_for(root))
                       for index, root in enumerate(config.roots)]

    def open_all(self) -> None:
        for state in self.states:
            self.ask(state)

    def ask(self, state: RootState) -> None:
        if state.asked or state.fd >= 0:
            return
        state.asked = True
        task = OpenRoot(state.path, state.residency, self.checks)
        self.scout.ask(task, lambda result: self.answered(state, result))

    def answered(self, state: RootState, result: Any) -> None:
        state.asked = False
        if isinstance(result, Passed) and result.fd >= 0:
            state.fd, state.rule, state.status, state.message = result.fd, result.rule, "open", ""
            rule = result.rule
            log.info("root %s: %s file system, %s rule (%s)",
                     state.path, rule.fstype, rule.rule, rule.why)
            self.on_open(state)
            return
        assert isinstance(result, Failed)
        status = "unresponsive" if result.kind == "timeout" else result.kind
        if (status, result.message) != (state.status, state.message):
            level = logging.ERROR if status == "refused" else logging.WARNING
            what = {"missing": "does not exist (yet): its files are missing until it does",
                    "unresponsive": "does not answer: its files wait until it does"}
            log.log(level, "root %s %s (%s); trying again every %.0f s", state.path,
                    what.get(status, "cannot be opened"), result.message, RETRY_SECONDS)
        state.status, state.message = status, result.message
        state.retry_at = time.monotonic() + RETRY_SECONDS

    def settled(self) -> bool:
        """Every root answered once (opened or not): what start-up waits for."""
        return all(state.status != "opening" for state in self.states)

    def refused(self) -> list[RootState]:
        return [state for state in self.states if state.status == "refused"]

    def next_due(self, now: float) -> float | None:
        dues = [s.retry_at for s in self.states if s.fd < 0 and not s.asked and s.retry_at]
        return max(0.0, min(dues) - now) if dues else None

    def tick(self, now: float) -> None:
        for state in self.states:
            if state.fd < 0 and not state.asked and state.retry_at and now >= state.retry_at:
                self.ask(state)

    def fds(self) -> tuple[int, ...]:
        return tuple(state.fd for state in self.states)

    def codes(self) -> tuple[int, ...]:
        return tuple(state.code for state in self.states)

    def rules(self) -> list[RootRule]:
        return [state.rule for state in self.states if state.rule is not None]

    def stats(self) -> list[RootStats]:
        return [{
            "root": state.path,
            "fstype": state.rule.fstype if state.rule else "unknown",
            "rule": state.rule.rule if state.rule else "unknown",
            "why": state.rule.why if state.rule else state.message,
            "status": state.status,
        } for state in self.states]

    def close(self) -> None:
        for state in self.states:
            if state.fd >= 0:
                os.close(state.fd)
                state.fd = -1
