"""The scout: a helper process that touches file systems so the supervisor never does.

The supervisor's one thread must never wait on a file system: on a hung mount a
directory listing or a stat sleeps uninterruptibly (no replies, no signals acted on,
not even SIGKILL until the tier answers). So every such touch (opening and
revalidating a root, KV fingerprint discovery, the stale-profile scan) is a task the
supervisor hands to a scout, a forked child that runs one task at a time and answers
over a socketpair. The supervisor waits for no answer: each task carries a callback and
a deadline. A scout that misses a deadline is presumed stuck in the kernel: it is
SIGKILLed and replaced, and it is tracked (stuck.py) until the kernel lets it go; tasks
behind it fail with the reason, and the callers answer their clients with it.

Scouts run in lanes, each its own process and queue: the KV tasks share one (MAIN), and
each root has its own (rootset.py), so a root whose file system hangs holds only its
own lane, and every other root opens and is checked at once whatever it does.

Tasks and results are pickled: both ends are this program, forked, and what a task
carries (a parsed profile, a path) was built by the supervisor, never unpickled from
a client's bytes. An fd travels beside a task or a result (SCM_RIGHTS): the root a
revalidation compares with, the root an OpenRoot opened. This module is the supervisor's
side (the lanes); the tasks are in tasks.py, the child's loop and the frames in
scout_child.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import os
import pickle
import selectors
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvprefetchd.roots.scout_child import HEADER, MAX_FDS, MAX_REPLY_BYTES, scout_main, send_message
from kvprefetchd.roots.tasks import Failed, Passed, Task
from kvprefetchd.supervisor.stuck import Stuck

log = logging.getLogger("kvprefetchd.scout")

MAIN = "main"  # the lane of every task not given one (the KV service's)


@dataclass
class Pending:
    number: int
    task: Task
    callback: Callable[[Any], None]
    fds: tuple[int, ...] = ()  # the task's own copies, closed once sent (or failed)
    deadline: float = 0.0  # set when sent

    def close_fds(self) -> None:
        fds, self.fds = self.fds, ()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class ScoutProcess:
    pid: int
    sock: socket.socket
    buffer: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)


class Lane:
    """One scout process and the tasks waiting for it, sent one at a time; each answered
    through its callback.

    A task not answered within `timeout` seconds is answered Failed("timeout"), and so
    is every task queued behind it; the stuck scout is killed, tracked, and replaced. At
    most `max_stuck` of this lane's scouts may be stuck at once: beyond that, its tasks
    fail at once (the file system it touches is not answering), so a dead tier cannot
    make the daemon fork without end.
    """

    def __init__(self, name: str, selector: selectors.BaseSelector, stuck: Stuck,
                 timeout: float, max_stuck: int, counts: dict[str, int]) -> None:
        self.name = name
        self.selector = selector
        self.stuck = stuck
        self.timeout = timeout
        self.max_stuck = max_stuck
        self.counts = counts  # shared by every lane: the stats' `scout`
        self.process: ScoutProcess | None = None
        self.queue: deque[Pending] = deque()
        self.current: Pending | None = None
        self.stuck_pids: set[int] = set()  # this lane's scouts the kernel still holds

    @property
    def busy(self) -> bool:
        return self.current is not None or bool(self.queue)

    def stuck_count(self) -> int:
        self.stuck_pids = {pid for pid in self.stuck_pids if pid in self.stuck.children}
        return len(self.stuck_pids)

    def add(self, pending: Pending) -> None:
        self.queue.append(pending)
        self.pump()

    def pump(self) -> None:
        """Send the next task when the scout is free (starting one if need be)."""
        if self.current is not None or not self.queue:
            return
        if self.process is None:
            stuck = self.stuck_count()
            if stuck >= self.max_stuck:
                self.fail_all(f"{stuck} scouts are stuck in the kernel: a file system "
                              f"{'under the roots' if self.name == MAIN else 'of ' + self.name} "
                              "is not answering")
                return
            try:
                self.spawn()
            except OSError as error:  # out of fds or processes: nothing is looked at now
                self.fail_all(f"cannot start a scout: {error.strerror}", "unavailable")
                return
        assert self.process is not None
        pending = self.queue.popleft()
        pending.deadline = time.monotonic() + self.timeout if self.timeout else math.inf
        self.current = pending
        try:
            send_message(self.process.sock, (pending.number, pending.task), pending.fds)
        except OSError:
            self.lost("the scout went away")
        finally:
            pending.close_fds()

    def spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:  # pragma: no cover - the child never returns here
            ours.close()
            scout_main(theirs, "kvprefetchd: scout" if self.name == MAIN
                       else f"kvprefetchd: scout ({self.name})")
        theirs.close()
        ours.setblocking(False)
        self.process = ScoutProcess(pid, ours)
        self.selector.register(ours, selectors.EVENT_READ,
                               functools.partial(self.on_event, self.process))

    def on_event(self, process: ScoutProcess, _events: int) -> None:
        while True:
            try:
                chunk, fds, _, _ = socket.recv_fds(process.sock, 1 << 16, MAX_FDS)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            process.fds.extend(fds)
            if not chunk:
                if process is self.process:
                    self.lost("the scout exited")
                return
            process.buffer += chunk
        self.take_replies(process)

    def take_replies(self, process: ScoutProcess) -> None:
        while len(process.buffer) >= HEADER.size:
            (length,) = HEADER.unpack_from(process.buffer)
            if length > MAX_REPLY_BYTES:
                self.lost(f"a reply of {length} bytes from the scout")
                return
            if len(process.buffer) < HEADER.size + length:
                return
            number, result = pickle.loads(bytes(process.buffer[HEADER.size:HEADER.size + length]))
            del process.buffer[:HEADER.size + length]
            if isinstance(result, Passed) and result.fd >= 0:
                result = dataclasses.replace(
                    result, fd=process.fds.pop(0) if process.fds else -1)
            current = self.current
            if current is None or current.number != number:
                if isinstance(result, Passed) and result.fd >= 0:
                    os.close(result.fd)  # the answer to a task given up on
                continue
            self.current = None
            current.callback(result)
        self.pump()

    def lost(self, why: str) -> None:
        """The scout died or hangs: fail what it had, track it, start afresh later."""
        process, self.process = self.process, None
        if process is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(process.sock)
            process.sock.close()
            for fd in process.fds:
                os.close(fd)
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            self.stuck.add(process.pid, "scout", why if self.name == MAIN
                           else f"{self.name}: {why}")
            self.stuck_pids.add(process.pid)
            self.counts["restarts"] += 1
        current, self.current = self.current, None
        if current is not None:
            current.callback(Failed("timeout", why))
        self.pump()

    def fail_all(self, why: str, kind: str = "timeout") -> None:
        while self.queue:
            pending = self.queue.popleft()
            pending.close_fds()
            pending.callback(Failed(kind, why))

    def next_due(self, now: float) -> float | None:
        if self.current is None or self.current.deadline == math.inf:
            return None
        return max(0.0, self.current.deadline - now)

    def tick(self, now: float) -> None:
        if self.current is not None and now >= self.current.deadline:
            self.counts["timeouts"] += 1
            what = type(self.current.task).__name__
            log.warning("the scout%s did not finish %s within %.0f s (a file system is not "
                        "answering); it is replaced",
                        "" if self.name == MAIN else f" of {self.name}", what, self.timeout)
            self.lost(f"no answer within {self.timeout:.0f} s (the file system may hang)")

    def child_exited(self, pid: int) -> bool:
        if self.process is not None and self.process.pid == pid:
            self.lost("the scout exited")
            return True
        return False

    def stop(self) -> None:
        for pending in self.queue:
            pending.close_fds()
        self.queue.clear()
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(process.sock)
        process.sock.close()  # an idle scout reads EOF and exits (reaped with the others)
        for fd in process.fds:
            os.close(fd)
        if self.current is not None:  # it may be stuck in a file system: killed, tracked
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            self.stuck.add(process.pid, "scout", "stopping")


class Scout:
    """The scout lanes, made on first use: MAIN for the KV service's tasks, one per root
    (rootset.py). Each answers its tasks in turn; no lane waits for another."""

    def __init__(self, selector: selectors.BaseSelector, stuck: Stuck, timeout: float,
                 max_stuck: int = 4) -> None:
        self.selector = selector
        self.stuck = stuck
        self.timeout = timeout
        self.max_stuck = max_stuck
        self.lanes: dict[str, Lane] = {}
        self.numbers = itertools.count(1)
        self.counts = {"tasks": 0, "timeouts": 0, "restarts": 0}

    def lane(self, name: str = MAIN, max_stuck: int | None = None) -> Lane:
        """The lane `name`, made now if need be (with `max_stuck`, else the scout's)."""
        lane = self.lanes.get(name)
        if lane is None:
            lane = self.lanes[name] = Lane(
                name, self.selector, self.stuck, self.timeout,
                self.max_stuck if max_stuck is None else max_stuck, self.counts)
        return lane

    def ask(self, task: Task, callback: Callable[[Any], None], *, lane: str = MAIN,
            fds: Sequence[int] = ()) -> None:
        """Run `task` on `lane`, with copies of `fds` beside it; `callback` gets the
        result (or Failed)."""
        self.counts["tasks"] += 1
        pending = Pending(next(self.numbers), task, callback)
        try:
            for fd in fds:  # copies, ours until sent: the caller's may be closed meanwhile
                pending.fds += (os.dup(fd),)
        except OSError as error:
            pending.close_fds()
            callback(Failed("unavailable", f"cannot pass an fd to a scout: {error.strerror}"))
            return
        self.lane(lane).add(pending)

    def next_due(self, now: float) -> float | None:
        dues = [due for lane in self.lanes.values()
                if (due := lane.next_due(now)) is not None]
        return min(dues) if dues else None

    def tick(self, now: float) -> None:
        for lane in list(self.lanes.values()):
            lane.tick(now)

    def child_exited(self, pid: int) -> bool:
        """SIGCHLD: True when pid was a live scout (replaced on its lane's next task)."""
        return any(lane.child_exited(pid) for lane in list(self.lanes.values()))

    def stop(self) -> None:
        for lane in self.lanes.values():
            lane.stop()
