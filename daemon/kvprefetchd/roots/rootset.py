"""The allowed roots as the supervisor holds them: opened, and kept true, by the scout.

Each root is opened off the loop (tasks.OpenRoot: a no-follow walk with ownership
checks, roots.py), on a scout lane of its own, so a root whose file system hangs delays
no other. Its directory fd is what workers resolve beneath and respawned workers
inherit: nothing resolves the root's path but that walk.

The walk is repeated: every CHECK_SECONDS, at once (at most every SOON_SECONDS) when the
mount table changes (MountWatch) and, for a root not open, when a request names it. A
check compares the directory the path leads to now with the one held (tasks.
replaced_because): a root removed and made again, a file system mounted over it or
unmounted from it, a FUSE root remounted, is reopened through the same walk, and the
new fd replaces the old one in the supervisor and in every worker (under the same fd
number: dup2), logged and counted (`reopened`). What the checks decide, truthfully:

- the path leads to the directory held: `open`;
- it leads to another directory: reopened, `open`;
- it leads nowhere (seen twice, SOON_SECONDS apart, so a path swapped in two steps is
  not let go in between): `missing`, and the directory held is let go: the root is its
  path, a router names files by it, and a file whose path does not resolve is missing,
  wherever its old directory went. Its files are `missing ENOENT` until it is back;
- it is refused (a symlink planted there, a directory another user could swap):
  `refused`, and the directory held, if any, stays in force (a plant changes nothing);
- the walk does not answer within fs_timeout: `unresponsive` (its files still go to
  the directory held, where their reads time out), looked at again every RETRY_SECONDS.

A root refused at start (a symlink, a directory another user could swap) stops the
daemon with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import selectors
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvprefetch.stats import RootStats
from kvprefetchd.channel import RootTier
from kvprefetchd.config import Config
from kvprefetchd.native import load_native
from kvprefetchd.roots.residency import RootRule
from kvprefetchd.roots.scout import Scout
from kvprefetchd.roots.tasks import Failed, OpenRoot, Passed, Unchanged

log = logging.getLogger("kvprefetchd")

CHECK_SECONDS = 2.0  # every root's path is walked again this often
RETRY_SECONDS = 5.0  # ... but a root whose file system did not answer, this often
SOON_SECONDS = 0.5  # a mount change or a request asks at once, but no more often than this
# A root lane's scouts the kernel may hold at once (stuck in its file system) before its
# checks fail at once: one to learn it hangs, one more in case the first was unlucky.
LANE_MAX_STUCK = 2


class HasRoots(Protocol):
    """A share of a request (admit.Share): its files' root indexes, uint16 native order."""

    @property
    def roots(self) -> bytes: ...


@dataclass
class RootState:
    index: int
    path: str
    residency: str  # as configured: auto, tier, pagecache, off
    extent: str = "auto"  # warm_extent as configured: auto, head, whole
    workers: int = 1  # the workers a FUSE mount's max_background is shared by
    fd: int = -1
    rule: RootRule | None = None  # known once open
    status: str = "opening"  # one of kvprefetch.stats.ROOT_STATUSES
    message: str = ""  # why it is not open (or what is wrong with its path)
    asked: bool = False  # a task is out for it
    asked_at: float = -math.inf  # when the last task went out (monotonic)
    due: float = 0.0  # when to walk its path again (monotonic)
    opened: int = 0  # times a directory was opened for it: the first, then each reopen
    vanished: bool = False  # its path led nowhere once while a directory is held
    unchecked: str = ""  # why the last look could not be made (out of fds), once logged
    # What the workers' reopens found (worker.Verdicts): "kept", "dropped", "" not yet.
    # "dropped" on a root whose profile neither holds nor caches: warming it is futile.
    verdict: str = ""

    @property
    def tier(self) -> RootTier:
        if self.rule is None:
            return RootTier()
        return RootTier(self.rule.keep, self.rule.whole, self.rule.fs_cache, self.rule.hold,
                        -(-self.rule.start_depth // self.workers), self.rule.gauge)

    @property
    def futile(self) -> bool:
        return self.verdict == "dropped"

    @property
    def code(self) -> int:
        """The native residency rule code (KVP_RES_*); off until the rule is known."""
        rule = self.rule.name if self.rule is not None else "off"
        return int(load_native().rule_codes[rule])

    @property
    def lane(self) -> str:
        return f"root {self.path}"

    @property
    def reopened(self) -> int:
        return max(0, self.opened - 1)

    @property
    def pattern(self) -> bytes:
        """Its index as a share's root buffer holds it (a misaligned match in a buffer
        costs one early check, nothing more)."""
        return array("H", [self.index]).tobytes()


class MountWatch:
    """Calls `changed` when the mount table changes, from the supervisor's selector.

    /proc/self/mountinfo is always readable; on a change of the mount namespace the
    kernel also raises EPOLLERR|EPOLLPRI once per open file (fs/proc_namespace.c,
    mounts_poll; proc(5)). epoll always reports EPOLLERR, so the file is registered for
    EVENT_WRITE, which it never is: it wakes the loop on a change only. Nothing is read
    and nothing touches a file system that could hang.
    """

    PATH = "/proc/self/mountinfo"

    def __init__(self, selector: selectors.BaseSelector, fd: int) -> None:
        self.selector = selector
        self.fd = fd

    @classmethod
    def open(cls, selector: selectors.BaseSelector,
             changed: Callable[[], None]) -> MountWatch | None:
        try:
            fd = os.open(cls.PATH, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            log.info("mount changes are not watched (%s: %s): the roots are checked every "
                     "%.0f s", cls.PATH, error.strerror, CHECK_SECONDS)
            return None
        selector.register(fd, selectors.EVENT_WRITE, lambda _events: changed())
        return cls(selector, fd)

    def close(self) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self.fd)
        os.close(self.fd)


class RootSet:
    def __init__(self, config: Config, scout: Scout,
                 on_change: Callable[[RootState], None]) -> None:
        """`on_change(state)`: a root was opened, reopened (its fd now names the new
        directory) or let go (fd -1); the live workers must hear of it."""
        self.scout = scout
        self.on_change = on_change
        self.checks = config.root_path_checks
        self.states = [RootState(index, root, config.residency_for(root),
                                 config.warm_extent_for(root), config.worker_count)
                       for index, root in enumerate(config.roots)]
        self.mounts: MountWatch | None = None
        self.mount_changes = 0
        self.started = False  # nothing is looked at before open_all
        for state in self.states:
            scout.lane(state.lane, LANE_MAX_STUCK)

    # ---- asking the scout --------------------------------------------------------------

    def watch_mounts(self, selector: selectors.BaseSelector) -> None:
        self.mounts = MountWatch.open(selector, self.mounts_changed)

    def open_all(self) -> None:
        self.started = True
        for state in self.states:
            self.ask(state)

    def ask(self, state: RootState) -> None:
        """Walk the root's path now (with the directory held, to compare)."""
        if state.asked:
            return
        state.asked, state.asked_at = True, time.monotonic()
        task = OpenRoot(state.path, state.residency, self.checks, state.extent)
        held = (state.fd,) if state.fd >= 0 else ()
        self.scout.ask(task, functools.partial(self.answered, state), lane=state.lane,
                       fds=held)

    def soon(self, state: RootState, now: float) -> None:
        """Walk the root's path now, or once SOON_SECONDS have passed since the last walk."""
        if state.asked or not self.started:
            return
        state.due = min(state.due, state.asked_at + SOON_SECONDS)
        if now >= state.due:
            self.ask(state)

    def mounts_changed(self) -> None:
        self.mount_changes += 1
        now = time.monotonic()
        for state in self.states:
            self.soon(state, now)

    def wanted(self, shares: Sequence[HasRoots | None]) -> None:
        """A request's shares: a root they name that is not open is looked at now."""
        closed = [state for state in self.states if state.fd < 0 and not state.asked]
        if not closed or not self.started:
            return
        now = time.monotonic()
        for state in closed:
            pattern = state.pattern
            if any(share is not None and pattern in share.roots for share in shares):
                self.soon(state, now)

    # ---- the scout's answers -----------------------------------------------------------

    def answered(self, state: RootState, result: Any) -> None:
        state.asked = False
        now = time.monotonic()
        state.due = now + CHECK_SECONDS
        if isinstance(result, Passed) and result.fd < 0:  # its fd lost: out of fds here
            result = Failed("unavailable", "the root's fd could not be received")
        if isinstance(result, Failed) and result.kind == "unavailable":
            # Nothing was looked at: the root is what it was; look again later.
            if not state.unchecked:
                log.warning("root %s: not checked (%s); trying again every %.0f s",
                            state.path, result.message, CHECK_SECONDS)
            state.unchecked = result.message
            return
        state.unchecked = ""
        if isinstance(result, Unchanged):
            state.vanished = False
            self.set_status(state, "open", "")
        elif isinstance(result, Passed) and result.fd >= 0:
            self.opened(state, result)
        elif isinstance(result, Failed):
            self.failed(state, result, now)
        else:
            self.failed(state, Failed("error", f"root {state.path}: {result!r}"), now)

    def opened(self, state: RootState, result: Passed) -> None:
        state.vanished = False
        rule = result.rule
        held = state.fd >= 0
        if held:
            # Under the same number, so new workers inherit the new directory. The old one
            # is an O_PATH fd: letting it go asks its file system nothing (no release), so
            # this never waits on a hung mount.
            os.dup2(result.fd, state.fd, inheritable=False)
            os.close(result.fd)
            log.warning("root %s was replaced (%s): reopened, %s file system, %s rule; its "
                        "files are served from the directory it leads to now",
                        state.path, result.replaced, rule.fstype, rule.name)
        else:
            state.fd = result.fd
            if state.status == "opening":
                log.info("root %s: %s file system, %s rule (%s)",
                         state.path, rule.fstype, rule.name, rule.why)
            else:
                log.info("root %s is open now: its files are served (%s file system, %s "
                         "rule)", state.path, rule.fstype, rule.name)
        state.opened += 1
        state.rule = rule
        state.status, state.message = "open", ""
        self.on_change(state)

    def failed(self, state: RootState, result: Failed, now: float) -> None:
        status = "unresponsive" if result.kind == "timeout" else result.kind
        message = result.message
        if status == "unresponsive":
            state.due = now + RETRY_SECONDS
        if status == "missing" and state.fd >= 0:
            if not state.vanished:
                state.vanished = True  # seen once: look again shortly before letting go
                state.due = now + SOON_SECONDS
                return
            self.let_go(state, message)
        state.vanished = False
        if state.fd >= 0:
            message += ("; the directory opened earlier stays in force" if status == "refused"
                        else "; its files still go to the directory held")
        self.set_status(state, status, message)

    def let_go(self, state: RootState, why: str) -> None:
        """The path leads nowhere: the directory held is no longer the root."""
        log.warning("root %s vanished (%s): the directory held is let go; its files are "
                    "missing until it is back", state.path, why)
        os.close(state.fd)
        state.fd, state.rule = -1, None
        state.status, state.message = "missing", why
        self.on_change(state)

    def set_status(self, state: RootState, status: str, message: str) -> None:
        if (status, message) != (state.status, state.message):
            if status == "open":
                log.info("root %s answers again: the directory held is still its root",
                         state.path)
            else:
                what = {"missing": "does not exist (yet): its files are missing until it does",
                        "unresponsive": "does not answer: its files wait until it does"}
                every = RETRY_SECONDS if status == "unresponsive" else CHECK_SECONDS
                log.log(logging.ERROR if status == "refused" else logging.WARNING,
                        "root %s %s (%s); looked at again every %.0f s", state.path,
                        what.get(status, "cannot be opened"), message, every)
        state.status, state.message = status, message

    # ---- the loop's side ---------------------------------------------------------------

    def all_answered(self) -> bool:
        """Every root answered once (opened or not): what start-up waits for."""
        return all(state.status != "opening" for state in self.states)

    def refused(self) -> list[RootState]:
        return [state for state in self.states if state.status == "refused"]

    def next_due(self, now: float) -> float | None:
        if not self.started:
            return None
        dues = [state.due for state in self.states if not state.asked]
        return max(0.0, min(dues) - now) if dues else None

    def tick(self, now: float) -> None:
        if not self.started:
            return
        for state in self.states:
            if not state.asked and now >= state.due:
                self.ask(state)

    def fds(self) -> tuple[int, ...]:
        return tuple(state.fd for state in self.states)

    def codes(self) -> tuple[int, ...]:
        return tuple(state.code for state in self.states)

    def tiers(self) -> tuple[RootTier, ...]:
        return tuple(state.tier for state in self.states)

    def verdict(self, index: int, verdict: str) -> None:
        """A worker reopened a warmed file of root `index` and found it `verdict`."""
        if not 0 <= index < len(self.states):
            return
        state = self.states[index]
        if state.verdict == verdict:
            return
        state.verdict = verdict
        if verdict == "dropped":
            log.warning("root %s (%s): a warmed file is cold again when reopened: the file "
                        "system drops its cache at open, so warming it is futile (files "
                        "settle `futile`). %s", state.path, state.rule.fstype if state.rule
                        else "unknown", (state.rule.profile.fix if state.rule else "")
                        or "kvprefetch doctor explains the root")
        else:
            log.info("root %s: a warmed file is still warm when reopened", state.path)

    def rules(self) -> list[RootRule]:
        return [state.rule for state in self.states if state.rule is not None]

    def stats(self) -> list[RootStats]:
        return [{
            "root": state.path,
            "fstype": state.rule.fstype if state.rule else "unknown",
            "rule": state.rule.name if state.rule else "unknown",
            "why": state.message if state.message or not state.rule else state.rule.why,
            "status": state.status,
            "reopened": state.reopened,
            "extent": state.rule.extent if state.rule else "unknown",
            "keep": state.rule.keep if state.rule else "unknown",
            "futile": state.futile,
        } for state in self.states]

    def close(self) -> None:
        if self.mounts is not None:
            self.mounts.close()
            self.mounts = None
        for state in self.states:
            if state.fd >= 0:
                os.close(state.fd)
                state.fd = -1
