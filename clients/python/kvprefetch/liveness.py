"""Is the daemon still answering? The bulk verbs' waits follow the work, not a clock.

A `warm --wait` batch is answered when its last file settles: on a tier that serves 25
files a second a batch of 1,024 takes 40 s, and 0.4.0's client timeout per reply (30 s)
gave up, exit 1, on a daemon that was working (issue 24). So the bulk client waits for its
replies without a bound of its own, and a Watchdog asks the daemon `ping` (or `stats`,
whose counters feed the progress line) every `every_s` while the run lasts. The run gives
up only when `timeout` seconds pass with no answer from the daemon at all, probe or reply
(it is stopped, hung, or its host is), or when a connection to it breaks (it died or
restarted): never because the files are slow.

The probes go on a connection of their own: one on the bulk connection would queue behind
that connection's own unsent batches (the daemon stops reading a connection whose large
frame waits for its input pool: docs/protocol.md, "Memory per client"), so its silence
could be our own backlog rather than the daemon's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvprefetch.aio import AsyncClient
from kvprefetch.errors import ConnectFailed, ConnectionClosed, ServerError, Timeout
from kvprefetch.stats import Stats

T = TypeVar("T")

PROBE_EVERY_S = 1.0  # at most; a quarter of the timeout when that is shorter


class DaemonSilent(Timeout):
    """Nothing came back from the daemon for the whole timeout, probes included."""


class DaemonLost(ConnectionClosed):
    """The probes' connection to the daemon broke, or could not be made again."""


class Watchdog:
    """Probes the daemon through `client` (its own connection; its timeout bounds each
    probe) and raises once it has answered nothing for `timeout` seconds (None: never).
    `observe` gets every `stats` reply; without it the probe is a `ping`."""

    def __init__(self, client: AsyncClient, timeout: float | None, *,
                 observe: Callable[[Stats], None] | None = None) -> None:
        self.client = client
        self.timeout = timeout
        self.observe = observe
        self.every_s = PROBE_EVERY_S if timeout is None else min(PROBE_EVERY_S, timeout / 4)
        self.last_answer = time.monotonic()
        self.stopping = False  # guard's work is over: watch() returns

    def answered(self) -> None:
        """Any reply from the daemon, a bulk request's too: it is alive now."""
        self.last_answer = time.monotonic()

    async def probe(self) -> None:
        """One question, bounded by the client's timeout (Timeout when unanswered)."""
        try:
            if self.observe is not None:
                self.observe(await self.client.stats())
            else:
                await self.client.ping()
        except ServerError:
            pass  # an answer all the same (overloaded, forbidden): the daemon is there
        except ConnectFailed as error:
            raise DaemonLost(f"kvprefetchd at {self.client.socket_path} closed the "
                             f"connection and cannot be reached again ({error})") from error
        except ConnectionClosed as error:
            raise DaemonLost(f"{error} (it died or restarted)") from error
        self.answered()

    async def watch(self) -> None:
        """Probe until the daemon has been silent for the timeout, then raise DaemonSilent;
        DaemonLost as soon as a probe finds the daemon gone. Returns once `stopping`."""
        self.answered()  # the clock starts with the watch
        while True:  # the first probe at once: the counters' starting point for progress
            with contextlib.suppress(Timeout):  # that probe waited the timeout: judged below
                await self.probe()
            # Python 3.11's wait_for (the probe's timeout) can swallow a cancellation that
            # lands as its reply does (gh-86296): the flag ends the loop all the same.
            if self.stopping:
                return
            silent = time.monotonic() - self.last_answer
            if self.timeout is not None and silent >= self.timeout:
                raise DaemonSilent(
                    f"kvprefetchd at {self.client.socket_path} answered nothing for "
                    f"{self.timeout:g} s (--timeout): it is stopped or hung, or its host is")
            await asyncio.sleep(self.every_s)

    async def guard(self, work: Awaitable[T]) -> T:
        """`work`'s result, unless the daemon stops answering first: then `work` is
        cancelled and the watchdog's error raised."""
        task = asyncio.ensure_future(work)
        dog = asyncio.ensure_future(self.watch())
        finished = False
        try:
            await asyncio.wait({task, dog}, return_when=asyncio.FIRST_COMPLETED)
            finished = task.done()  # the work's own end wins a tie
        finally:  # also when the caller is cancelled (Ctrl-C): nothing left running
            self.stopping = True
            for running in (task, dog):
                if not running.done():
                    running.cancel()
            await asyncio.gather(task, dog, return_exceptions=True)
        if finished:
            return task.result()
        dog.result()  # raises: watch() returns only once stopping
        raise AssertionError("the watchdog ended before the work")
