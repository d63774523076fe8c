"""Logging to stderr that never stalls the event loop, never raises, and keeps its levels.

Three things the standard StreamHandler gets wrong for a daemon:
- It blocks. A stderr pipe nobody drains (a wrapper that stopped reading, a full
  `journalctl` buffer) or a terminal held by XOFF fills and then every log call, on the
  supervisor's only thread, sleeps until someone reads. Here a line that cannot be
  written now waits in a small bounded buffer, later lines are dropped (and counted)
  while the sink is full, and the count is reported once it drains.
- It raises. A write error (ENOSPC on a full file system, EIO from a terminal whose
  master side hung up, EPIPE) escapes `emit` into whatever logged, and a warning about
  a refused peer stopped the daemon (issue 23, finding 6). Here a failed write is
  counted and retried with a bounded backoff; after FAILURES_BEFORE_REPLACING failures
  in a row the sink is replaced by the journal's stdout stream when one is there, else
  lines are dropped (counted) while stderr is still retried now and then. The log says
  how many lines were lost, on the replacement or once the sink works again. Nothing is
  ever printed to the broken stream about it (handleError, logging.raiseExceptions).
- It loses priorities. Under systemd, stderr is a stream into journald, which stores
  every line at the unit's default level (6, info) unless the line starts with a
  sd-daemon(3) prefix: "<3>" error, "<4>" warning, "<6>" info, "<7>" debug. Each line of
  a multi-line record (a traceback) gets its own prefix, since journald splits on
  newlines.

The supervisor's loop drives the handler through LogPump: it watches the sink for
writability while lines are held and calls the retry when it is due.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import stat
import sys
import time
from collections import Counter
from collections.abc import Callable

from kvprefetchd import systemd

# Bytes held while the sink is full or failing; beyond this whole lines are dropped and counted.
PENDING_LIMIT = 256 * 1024
# A failed write is retried after RETRY_FIRST seconds, doubling up to RETRY_MOST.
RETRY_FIRST = 0.1
RETRY_MOST = 30.0
# Failed writes in a row (about 1.5 s of retries) before the journal takes over.
FAILURES_BEFORE_REPLACING = 5
# journald's stream socket: what systemd connects a unit's stderr to (sd_journal_stream_fd(3)).
JOURNAL_STDOUT = "/run/systemd/journal/stdout"
LINE_FORMAT = "%(levelname)s %(name)s: %(message)s"

# sd-daemon(3) priorities (syslog's numbers) for Python's levels.
_PRIORITY = {
    logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
    logging.DEBUG: 7,
}


def journal_priority(levelno: int) -> int:
    for level in sorted(_PRIORITY, reverse=True):
        if levelno >= level:
            return _PRIORITY[level]
    return 7


class JournalFormatter(logging.Formatter):
    """Prefixes every line of a record with its sd-daemon(3) priority."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{journal_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def open_journal_stream(path: str = JOURNAL_STDOUT,
                        identifier: str = "kvprefetchd") -> socket.socket:
    """A non-blocking stream into journald, as sd_journal_stream_fd(3) opens one: the
    header names the identifier, priority 6 for lines without a prefix, and says that
    lines carry "<N>" prefixes (systemd's src/journal/journald-stream.c reads it)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.setblocking(False)  # a journald that does not accept must not hold us
        sock.connect(path)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RD)
        header = f"{identifier}\n\n6\n1\n0\n0\n0\n".encode()
        if sock.send(header) != len(header):
            raise OSError("short write of the journal stream header")
    except OSError:
        sock.close()
        raise
    return sock


def _reason(error: OSError) -> str:
    name = os.strerror(error.errno) if error.errno else str(error)
    return f"{name} ({error.errno})" if error.errno else name


class NonBlockingStderr(logging.Handler):
    """A handler whose writes never block and never raise: pipes and terminals are
    reopened non-blocking (a file description of our own, so the shell's terminal or a
    shared pipe keeps its flags), sockets (the journal) are sent with MSG_DONTWAIT,
    files are written as they are (they do not fill up, but they may fail)."""

    def __init__(self, fd: int | None = None, *, journal_path: str | None = JOURNAL_STDOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        fd = sys.stderr.fileno() if fd is None else fd
        self.journal_path = journal_path
        self.clock = clock
        self.sock: socket.socket | None = None
        self.fd = fd
        self.owned = False
        self.sink = "stderr"
        self.generation = 0  # changes with the sink (LogPump re-registers its fd)
        with contextlib.suppress(OSError):
            mode = os.fstat(fd).st_mode
            if stat.S_ISSOCK(mode):
                self.sock = socket.socket(fileno=os.dup(fd))
            elif stat.S_ISFIFO(mode) or (stat.S_ISCHR(mode) and os.isatty(fd)):
                self.fd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK
                                  | os.O_CLOEXEC | os.O_NOCTTY)
                self.owned = True
        self.pending = bytearray()
        self.dropped = 0  # lines dropped while the sink was full (nobody reading)
        self.lost = 0  # lines dropped while the sink was failing
        self.failures = 0  # failed writes in a row
        self.failure = ""  # the last one's reason
        self.retry_at: float | None = None  # failing: no write before this
        self.recovered = False  # a note is owed: the sink works again
        self.counts: Counter[str] = Counter()  # log_write_errors, log_lines_dropped, ...

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode("utf-8", "replace")
        except Exception:
            self.handleError(record)
            return
        self.flush()
        if self.pending:  # full or failing: keep what fits, count the rest
            if len(self.pending) + len(line) <= PENDING_LIMIT:
                self.pending += line
            else:
                self._drop()
            return
        self.pending += line
        self.flush()

    def handleError(self, record: logging.LogRecord) -> None:
        """A record that cannot be formatted is counted and dropped; never a traceback
        printed to a stderr that may be the very thing failing."""
        self.counts["log_format_errors"] += 1
        self.counts["log_lines_dropped"] += 1

    def flush(self) -> None:
        """Write what the sink takes now (unless a retry is not due yet); when it drains,
        say how many lines were dropped or lost. Never raises."""
        if self.retry_at is not None and self.clock() < self.retry_at:
            return
        while self.pending:
            try:
                written = self._write(self.pending)
            except BlockingIOError:  # full: the loop waits for it to drain
                return
            except OSError as error:
                if not self._failed(error):
                    return
                continue  # replaced: the held lines go to the journal
            if self.failures:
                self.failures, self.retry_at, self.recovered = 0, None, True
            del self.pending[:written]
            if not self.pending:
                self._note_losses()

    def _drop(self) -> None:
        if self.retry_at is not None or self.failures:
            self.lost += 1
        else:
            self.dropped += 1
        self.counts["log_lines_dropped"] += 1

    def _failed(self, error: OSError) -> bool:
        """Count a failed write, then replace the sink (True: write again now) or back off."""
        self.counts["log_write_errors"] += 1
        self.failures += 1
        self.failure = _reason(error)
        if self.failures >= FAILURES_BEFORE_REPLACING and self._replace_by_journal():
            return True
        delay = min(RETRY_MOST, RETRY_FIRST * 2 ** min(self.failures - 1, 16))
        self.retry_at = self.clock() + delay
        return False

    def _replace_by_journal(self) -> bool:
        """The journal's stream instead of the failing sink (a fresh one when the journal
        itself failed: journald restarted); False when there is none to connect to."""
        if self.journal_path is None:
            return False
        try:
            sock = open_journal_stream(self.journal_path)
        except OSError:
            return False
        failed = self.sink
        self._close_sink()
        self.sock, self.sink = sock, "the journal"
        self.generation += 1
        self.setFormatter(JournalFormatter(LINE_FORMAT))
        self.counts["log_sink_replaced"] += 1
        note = (f"<4>{failed} failed {self.failures} times in a row ({self.failure}): logging "
                f"to the journal from now on; {self.lost} log lines were lost\n")
        self.pending[:0] = note.encode()
        self.failures, self.retry_at, self.lost, self.recovered = 0, None, 0, False
        return True

    def _note_losses(self) -> None:
        prefix = "<4>" if isinstance(self.formatter, JournalFormatter) else ""
        notes = []
        if self.recovered:
            notes.append(f"{prefix}{self.sink} works again after failing ({self.failure}); "
                         f"{self.lost} log lines were lost\n")
            self.recovered, self.lost = False, 0
        if self.dropped:
            notes.append(f"{prefix}{self.dropped} log lines dropped: {self.sink} was not "
                         "being read\n")
            self.dropped = 0
        self.pending += "".join(notes).encode()

    def fileno(self) -> int:
        """What to poll for writability while lines are held back."""
        return self.sock.fileno() if self.sock is not None else self.fd

    def _write(self, data: bytearray) -> int:
        if self.sock is not None:
            return self.sock.send(data, socket.MSG_DONTWAIT)
        return os.write(self.fd, data)

    def _close_sink(self) -> None:
        if self.owned:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.owned = False
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def forget_pending(self) -> None:
        """In a forked child: the parent writes the lines it held; counts start afresh."""
        self.pending.clear()
        self.dropped = self.lost = 0
        self.counts.clear()

    def close(self) -> None:
        self._close_sink()
        super().close()


def setup_logging(level: str) -> NonBlockingStderr:
    """One line per event on stderr; under systemd no timestamps (the journal adds its
    own) and sd-daemon priority prefixes when stderr is the journal."""
    # A handler that fails must not print a traceback to the stderr that failed.
    logging.raiseExceptions = False
    handler = NonBlockingStderr()
    fmt = LINE_FORMAT
    if systemd.stderr_is_journal():
        handler.setFormatter(JournalFormatter(fmt))
    else:
        if not systemd.under_systemd():
            fmt = "%(asctime)s " + fmt
        handler.setFormatter(logging.Formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


def _forget_in_child() -> None:
    handler = stderr_handler()
    if handler is not None:
        handler.forget_pending()


os.register_at_fork(after_in_child=_forget_in_child)


def stderr_handler() -> NonBlockingStderr | None:
    """The handler setup_logging installed, for the loop to flush when stderr drains."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, NonBlockingStderr):
            return handler
    return None


def counters() -> dict[str, int]:
    """log_write_errors, log_lines_dropped, log_sink_replaced, log_format_errors: this
    process's, for the `stats` events."""
    handler = stderr_handler()
    return dict(handler.counts) if handler is not None else {}


class LogPump:
    """The supervisor loop's side of the handler: while lines are held behind a full
    sink, its fd is watched and flushed when writable; while the sink is failing, the
    retry is due at `next_due` and made by `tick` (a failing file is always "writable":
    watching it would spin the loop)."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self.selector = selector
        self.watched: tuple[int, int] | None = None  # (sink generation, fd)

    def next_due(self, now: float) -> float | None:
        handler = stderr_handler()
        if handler is None or handler.retry_at is None or not handler.pending:
            return None
        return max(0.0, handler.retry_at - now)

    def tick(self, now: float) -> None:
        handler = stderr_handler()
        if handler is None:
            return
        if handler.pending and handler.retry_at is not None and now >= handler.retry_at:
            handler.flush()
        wanted = None
        if handler.pending and handler.retry_at is None:
            wanted = (handler.generation, handler.fileno())
        if wanted == self.watched:
            return
        if self.watched is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.selector.unregister(self.watched[1])
        self.watched = wanted
        if wanted is not None:
            self.selector.register(wanted[1], selectors.EVENT_WRITE,
                                   lambda _events: handler.flush())
