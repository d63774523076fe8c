"""Bulk verbs for the CLI: stream any number of paths through the daemon, losing none.

`kvprefetch warm|check|evict` over a list of 10^6 files must not read the list whole, must
not overrun the daemon's bounded queues (which drop files rather than make anyone wait),
and must say which files were not warmed. So the paths are read as they are sent, in
batches of BATCH_PATHS, with at most WINDOW requests on the wire (memory: WINDOW batches,
whatever the list's length); every request asks for all its failures to be listed
(max_failures = the batch), so a file the daemon dropped for a full queue is known by name
and sent again after a backoff; and a fire-and-forget batch is sent only while the
daemon's last ack (`room`), less what was sent since, leaves room for it.

No reply is waited for with a clock: a batch of a slow tier takes as long as its files do.
The CLI runs a kvprefetch.liveness.Watchdog beside the run, which gives up only when the
daemon stops answering, and feeds `observe` the daemon's counters for the progress line.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from kvprefetch.aio import AsyncClient
from kvprefetch.progress import Figures, Progress
from kvprefetch.protocol import Path
from kvprefetch.results import CheckResult, Failure, FileState, PrefetchResult
from kvprefetch.stats import Stats

BATCH_PATHS = 1024
BATCH_BYTES = 1 << 20
WINDOW = 8  # requests in flight: 8 x 1,024 files, half the daemon's default queues
MAX_ATTEMPTS = 40  # sends of one dropped file before it is given up (counted dropped)
BACKOFF_FIRST_S = 0.005
BACKOFF_MAX_S = 0.5
LISTED_MAX = 100_000  # failures kept for --json; -v prints them as they come instead
READ_CHUNK = 1 << 20
# The longest line a list may hold: Linux's PATH_MAX (4,096 bytes with the NUL), longer
# than any name the kernel opens and than the daemon's default max_path_bytes. A longer
# line is no path: the run stops there (exit 2), rather than send what must be refused or
# (0.3.0) keep an endless line, `-f /dev/zero`, in memory while it grows.
MAX_LINE_BYTES = 4096
# Empty lines in a row past which the input is no list: `-0 -f /dev/zero` is nothing but
# empty records, read for ever (and Ctrl-C waits for the reading thread).
MAX_EMPTY_RUN = 1 << 20


class ListError(ValueError):
    """A list (or a PATH operand) holds what cannot be a path; the message says where."""


def read_paths(paths: Iterable[str], lists: Iterable[str], *, nul: bool,
               stdin: IO[bytes] | None = None) -> Iterator[Path]:
    """The command line's paths, then those of its list files, as they are read: `-`
    (as a path or a list) is stdin; a list holds one path a line (NUL-separated with
    `nul`). Relative paths become absolute (the daemon has its own cwd); names that are
    not UTF-8 stay bytes. A line longer than MAX_LINE_BYTES raises ListError naming the
    list and the line, once it is that long: memory stays bounded on endless input."""
    separator = b"\0" if nul else b"\n"
    for number, path in enumerate(paths, 1):
        if path == "-":
            yield from _split(stdin if stdin is not None else sys.stdin.buffer, separator,
                              "stdin")
        else:
            raw = os.fsencode(path)
            if len(raw) > MAX_LINE_BYTES:
                raise ListError(f"PATH operand {number}: longer than {MAX_LINE_BYTES} bytes "
                                "(PATH_MAX): not a path")
            yield _absolute(raw)
    for name in lists:
        if name == "-":
            yield from _split(stdin if stdin is not None else sys.stdin.buffer, separator,
                              "stdin")
        else:
            with open(name, "rb") as listing:
                yield from _split(listing, separator, name)


def _split(handle: IO[bytes], separator: bytes, name: str) -> Iterator[Path]:
    """The non-empty lines of a list, each as soon as it is whole. What is held between
    reads is one chunk and at most MAX_LINE_BYTES of an unfinished line."""
    rest = b""
    number = 0  # lines (records) ended so far, empty ones included: what an editor counts
    empty = 0  # empty ones in a row
    blank = b"\r" if separator == b"\n" else b""  # a CRLF list's empty line
    while chunk := handle.read(READ_CHUNK):
        lines = (rest + chunk).split(separator)
        rest = lines.pop()
        for line in lines:
            number += 1
            if not line or line == blank:
                empty += 1
                if empty > MAX_EMPTY_RUN:
                    raise _no_list(name, number, empty, separator)
                continue
            empty = 0
            if len(line) > MAX_LINE_BYTES:
                raise _too_long(name, number, separator)
            yield _absolute(line)
        if len(rest) > MAX_LINE_BYTES:
            raise _too_long(name, number + 1, separator)
    if rest.strip(b"\r\n" if separator == b"\n" else b""):
        yield _absolute(rest)


def _too_long(name: str, number: int, separator: bytes) -> ListError:
    what = "record" if separator == b"\0" else "line"
    return ListError(f"{name}: {what} {number} is longer than {MAX_LINE_BYTES} bytes "
                     "(PATH_MAX): not a path")


def _no_list(name: str, number: int, empty: int, separator: bytes) -> ListError:
    what = "records" if separator == b"\0" else "lines"
    return ListError(f"{name}: {what} {number - empty + 1} to {number} are empty (more than "
                     f"{MAX_EMPTY_RUN} in a row): not a path list")


def _absolute(raw: bytes) -> Path:
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    if not raw.startswith(b"/"):
        raw = os.path.join(os.getcwdb(), raw)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw


def batches(paths: Iterator[Path], size: int = BATCH_PATHS) -> Iterator[list[Path]]:
    batch: list[Path] = []
    nbytes = 0
    for path in paths:
        length = len(path)  # characters: close enough to bytes for a frame budget
        if batch and (len(batch) == size or nbytes + length > BATCH_BYTES):
            yield batch
            batch, nbytes = [], 0
        batch.append(path)
        nbytes += length
    if batch:
        yield batch


@dataclass
class Tally:
    """What a bulk run did, over every request it sent."""

    paths: int = 0  # read from the input
    accepted: int = 0
    rejected: int = 0  # by the supervisor
    dropped: int = 0  # given up after MAX_ATTEMPTS
    retried: int = 0  # sends of a dropped file again
    outcomes: Counter[str] = field(default_factory=Counter)  # warm --wait
    states: Counter[str] = field(default_factory=Counter)  # check, evict
    size_bytes: int = 0
    resident_bytes: int = 0
    evicted_files: int = 0
    failures: list[Failure] = field(default_factory=list)  # first LISTED_MAX
    failures_by_outcome: Counter[str] = field(default_factory=Counter)
    unlisted: int = 0  # failures the daemon counted without naming (wait timeouts)
    started: float = field(default_factory=time.monotonic)

    @property
    def settled(self) -> int:
        return (sum(self.outcomes.values()) + sum(self.states.values()) + self.rejected
                + self.dropped)


Report = Callable[[Failure], None]
# The daemon's counters of files a check or an evict looked at (docs/protocol.md, "The
# `stats` reply"); warm-ups settled are its `files`: accepted less in_flight, whatever
# outcomes a daemon adds.
SETTLED_EVENTS = {"check": "files_checked", "evict": "files_evicted"}


class Bulk:
    """One bulk run: `op` is warm, check or evict; `options` go into each request.

    `progress`: a Progress, or a stream to redraw a terminal's line on. `on_answer` is
    called at each reply (the Watchdog's `answered`)."""

    def __init__(self, client: AsyncClient, op: str, options: dict[str, Any], *,
                 wait: bool = True, report: Report | None = None,
                 progress: Progress | IO[str] | None = None) -> None:
        self.client = client
        self.op = op
        self.options = options
        self.wait = wait
        self.report = report
        self.progress = (progress if progress is None or isinstance(progress, Progress)
                         else Progress(progress, redraw=True))
        self.on_file: Callable[[FileState], None] | None = None
        self.on_answer: Callable[[], None] | None = None
        self.tally = Tally()
        self.room: int | None = None  # the queues' room, as the last ack said
        self.most_room = 0  # the most room an ack ever said: about the queues' size
        self.in_flight = 0  # paths sent whose reply has not come (not in `room` yet)
        self.listed_all = False  # the input is read to its end
        self._window = asyncio.Semaphore(WINDOW)
        self._daemon_first: int | None = None  # the daemon's settled count when first seen
        self._daemon_settled = 0  # settled by the daemon since then, every client's files
        self._done = 0  # the progress figure, last computed
        self._grew = time.monotonic()  # when it last grew

    async def run(self, paths: Iterator[Path]) -> Tally:
        """Send every path. The first error (a request that failed, a list that is not
        one) stops the reading; the requests in flight end, and it is raised: a run never
        ends as if it sent what it skipped (0.3.0 lost a failed batch's error, exit 0)."""
        loop = asyncio.get_running_loop()
        source = batches(paths)
        tasks: set[asyncio.Task[None]] = set()
        errors: list[BaseException] = []

        def finished(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            error = None if task.cancelled() else task.exception()
            if error is not None:
                errors.append(error)

        try:
            while not errors:
                await self._window.acquire()
                try:
                    # The list is read off the loop: a slow pipe (find | kvprefetch) must
                    # not stall the replies of the requests in flight.
                    batch = await loop.run_in_executor(None, next, source, None)
                except BaseException:
                    self._window.release()
                    raise
                if batch is None:
                    self._window.release()
                    self.listed_all = True
                    break
                self.tally.paths += len(batch)
                task = asyncio.create_task(self._send(batch))
                tasks.add(task)
                task.add_done_callback(finished)
        except asyncio.CancelledError:  # the daemon stopped answering (Watchdog), Ctrl-C
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        except Exception:
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        await asyncio.gather(*tasks, return_exceptions=True)
        if errors:
            raise errors[0]
        self.show(final=True)
        return self.tally

    async def _send(self, batch: list[Path]) -> None:
        try:
            attempt = 0
            while batch:
                if attempt:
                    await asyncio.sleep(min(BACKOFF_FIRST_S * 2 ** (attempt - 1), BACKOFF_MAX_S))
                    self.tally.retried += len(batch)
                if self.op == "warm" and not self.wait:
                    await self._pace(len(batch))
                self.in_flight += len(batch)
                dropped = await (self._warm(batch) if self.op == "warm"
                                 else self._inspect(batch))
                self.in_flight -= len(batch)  # not on an error: the run ends with them out
                if self.on_answer is not None:
                    self.on_answer()
                attempt += 1
                if dropped and attempt >= MAX_ATTEMPTS:
                    self.tally.dropped += len(dropped)
                    for path in dropped:
                        self._failed(Failure(path, "dropped", "dropped_queue_full"))
                    break
                batch = dropped
            self.show()
        finally:
            self._window.release()

    async def _warm(self, batch: list[Path]) -> list[Path]:
        result: PrefetchResult = await self.client.prefetch(
            batch, wait=self.wait, max_failures=len(batch), **self.options)
        tally = self.tally
        tally.accepted += result.accepted
        tally.rejected += result.rejected
        if result.outcomes:
            tally.outcomes.update(result.outcomes)
        if result.room is not None:
            self.room = result.room
            self.most_room = max(self.most_room, result.room)
        tally.unlisted += result.failures_truncated
        dropped = []
        for failure in result.failures:
            if failure.outcome == "dropped":
                dropped.append(failure.path)
            else:
                self._failed(failure)
        return dropped

    async def _inspect(self, batch: list[Path]) -> list[Path]:
        call = self.client.check if self.op == "check" else self.client.evict
        result: CheckResult = await call(batch, details=True, **self.options)
        tally = self.tally
        dropped = []
        for state in result.results or []:
            if state.state == "dropped":
                dropped.append(state.path)
                continue
            tally.states[state.state] += 1
            if state.reason is not None and state.state not in ("resident", "cold"):
                self._failed(Failure(state.path, state.state, state.reason))
            if self.on_file is not None:
                self.on_file(state)
        tally.size_bytes += result.size_bytes
        tally.resident_bytes += result.resident_bytes
        tally.evicted_files += result.evicted_files or 0
        tally.states["expired"] += result.states.get("expired", 0)
        return dropped

    async def _pace(self, files: int) -> None:
        """Fire and forget: send only what the queues have room for, as far as the last
        ack said, less what was sent since; twice the batch, since the daemon's room is
        per worker and a batch splits over them unevenly. While there is none, wait for
        the queues to drain (an empty prefetch only reports the room)."""
        delay = BACKOFF_FIRST_S
        # Queues smaller than that take what they can, the rest is resent.
        while self.room is not None and self.room - self.in_flight < min(2 * files,
                                                                       self.most_room):
            await asyncio.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX_S)
            if self.in_flight == 0:  # else the acks on their way will say
                probe = await self.client.prefetch([])
                if self.on_answer is not None:
                    self.on_answer()
                self.room = probe.room
                self.most_room = max(self.most_room, probe.room or 0)

    def _failed(self, failure: Failure) -> None:
        tally = self.tally
        tally.failures_by_outcome[failure.outcome] += 1
        if self.report is not None:
            self.report(failure)
        elif len(tally.failures) < LISTED_MAX:
            tally.failures.append(failure)

    def observe(self, stats: Stats) -> None:
        """The daemon's counters (a Watchdog's `stats` probe): between replies, files it
        settled since the run began count toward the progress line, as far as this run
        has files out. Every client's files are in them, so the figure is shown as
        `about` until the replies confirm it."""
        try:
            if self.op == "warm":
                count = int(stats["files"]["accepted"]) - int(stats["files"]["in_flight"])
            else:
                count = int(stats["events"][SETTLED_EVENTS[self.op]])
        except (KeyError, TypeError, ValueError):
            return  # a daemon of another version: the replies alone will do
        if self._daemon_first is None:
            self._daemon_first = count
        self._daemon_settled = count - self._daemon_first
        self.show()

    def figures(self) -> Figures:
        """Where the run stands: files settled (confirmed by replies, or as the daemon's
        counters say, within what is in flight), or queued when nobody waits."""
        tally = self.tally
        now = time.monotonic()
        if self.op == "warm" and not self.wait:
            verb, confirmed = "queued", tally.accepted
        else:
            verb, confirmed = "settled", tally.settled
        done = confirmed
        if verb == "settled":
            done = max(confirmed, min(self._daemon_settled, confirmed + self.in_flight))
        if done > self._done:
            self._done, self._grew = done, now
        return Figures(op=self.op, verb=verb, done=done, about=done > confirmed,
                       listed=tally.paths, listed_all=self.listed_all,
                       in_flight=self.in_flight - (done - confirmed), retried=tally.retried,
                       elapsed_s=now - tally.started, idle_s=now - self._grew)

    def show(self, final: bool = False) -> None:
        """The progress line, as often as its Progress draws."""
        if self.progress is not None:
            self.progress.show(self.figures(), final)
