"""The log handler's promises, on real pipes, terminals and /dev/full: priorities per line,
no blocking, and no exception ever: a failing sink is counted, retried, replaced by the
journal or dropped, and the loss told."""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
from pathlib import Path

import pytest

from kvprefetchd.logs import (
    FAILURES_BEFORE_REPLACING,
    PENDING_LIMIT,
    RETRY_FIRST,
    RETRY_MOST,
    JournalFormatter,
    LogPump,
    NonBlockingStderr,
)


def record(level: int, message: str, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            import sys

            info = sys.exc_info()
    return logging.LogRecord("kvprefetchd", level, __file__, 1, message, None, info)


def test_every_line_of_a_traceback_gets_the_records_priority() -> None:
    text = JournalFormatter("%(levelname)s %(message)s").format(
        record(logging.ERROR, "it broke", exc=True)
    )
    lines = text.split("\n")
    assert len(lines) > 3 and all(line.startswith("<3>") for line in lines)
    assert lines[0] == "<3>ERROR it broke" and lines[-1] == "<3>ValueError: boom"
    for level, prefix in ((logging.WARNING, "<4>"), (logging.INFO, "<6>"),
                          (logging.DEBUG, "<7>"), (logging.CRITICAL, "<2>"), (5, "<7>")):
        assert JournalFormatter().format(record(level, "x")).startswith(prefix)


def test_a_full_pipe_holds_then_drops_lines_and_never_blocks() -> None:
    read_end, write_end = os.pipe()
    handler = NonBlockingStderr(write_end)
    handler.setFormatter(logging.Formatter("%(message)s"))
    assert os.get_blocking(write_end)  # the original description keeps its flags
    line = "y" * 1000
    for _ in range(2000):  # 2 MB into a 64 KiB pipe: returns at once
        handler.emit(record(logging.INFO, line))
    assert 0 < len(handler.pending) <= PENDING_LIMIT and handler.dropped > 0
    dropped = handler.dropped
    drained = b""
    os.set_blocking(read_end, False)
    while handler.pending or handler.dropped:
        try:
            drained += os.read(read_end, 1 << 20)
        except BlockingIOError:
            handler.flush()
    with contextlib.suppress(BlockingIOError):
        drained += os.read(read_end, 1 << 20)
    assert drained.endswith(f"{dropped} log lines dropped: stderr was not being read\n".encode())
    handler.close()
    os.close(write_end)
    os.close(read_end)


# ---- a sink that fails (issue 23, finding 6) ---------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def failing_handler(clock: Clock, journal_path: str | None = None) -> tuple[NonBlockingStderr, int]:
    """A handler on its own fd, a copy of /dev/full: every write fails with ENOSPC."""
    full = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
    handler = NonBlockingStderr(full, journal_path=journal_path, clock=clock)
    handler.setFormatter(logging.Formatter("%(message)s"))
    return handler, full


def test_a_full_file_system_never_raises_and_is_retried_with_a_growing_backoff() -> None:
    clock = Clock()
    handler, fd = failing_handler(clock)
    handler.emit(record(logging.WARNING, "first"))  # would raise OSError(ENOSPC) before
    assert handler.counts["log_write_errors"] == 1 and handler.retry_at == clock.now + RETRY_FIRST
    for _ in range(100):  # before the retry is due nothing is written, nothing raised
        handler.emit(record(logging.WARNING, "more"))
    assert handler.counts["log_write_errors"] == 1
    delays = []
    for _ in range(12):
        assert handler.retry_at is not None
        delays.append(round(handler.retry_at - clock.now, 3))
        clock.now = handler.retry_at
        handler.flush()
    assert delays[:4] == [0.1, 0.2, 0.4, 0.8] and max(delays) == RETRY_MOST
    assert handler.counts["log_write_errors"] == 13
    assert "No space left on device" in handler.failure
    handler.close()
    os.close(fd)


def test_lines_beyond_what_is_held_are_counted_as_dropped_while_the_sink_fails() -> None:
    clock = Clock()
    handler, fd = failing_handler(clock)
    line = "z" * 1000
    for _ in range(1000):
        handler.emit(record(logging.INFO, line))
    assert len(handler.pending) <= PENDING_LIMIT
    assert handler.lost == handler.counts["log_lines_dropped"] > 700
    handler.close()
    os.close(fd)


def test_a_sink_that_works_again_gets_the_held_lines_and_how_many_were_lost() -> None:
    """The fd the handler writes to is /dev/full, then (dup2) a pipe: the same sink,
    failing, then working, as a file system that had its space freed."""
    clock = Clock()
    handler, fd = failing_handler(clock)
    for i in range(400):
        handler.emit(record(logging.INFO, f"line {i:03d} " + "q" * 1000))
    lost = handler.lost
    assert lost > 0
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # what the handler makes of a pipe it is given
    os.dup2(write_end, fd)
    os.set_blocking(read_end, False)
    out = b""
    clock.now = handler.retry_at or clock.now
    while handler.pending or not out.endswith(b"were lost\n"):
        handler.flush()
        with contextlib.suppress(BlockingIOError):
            out += os.read(read_end, 1 << 20)
    text = out.decode()
    assert text.startswith("line 000 ")
    assert text.endswith(f"stderr works again after failing (No space left on device (28)); "
                         f"{lost} log lines were lost\n")
    assert handler.failures == 0 and handler.retry_at is None and handler.lost == 0
    handler.emit(record(logging.INFO, "after"))
    assert os.read(read_end, 100) == b"after\n"
    handler.close()
    for each in (fd, read_end, write_end):
        os.close(each)


def test_after_repeated_failures_the_journal_takes_over_and_hears_what_was_lost(
    tmp_path: Path,
) -> None:
    """A stand-in for journald's stream socket: the header sd_journal_stream_fd(3) sends,
    then the note with the count, then the held lines, then new ones with priorities."""
    path = str(tmp_path / "stdout")
    journald = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    journald.bind(path)
    journald.listen(1)
    clock = Clock()
    handler, fd = failing_handler(clock, journal_path=path)
    for i in range(300):
        handler.emit(record(logging.INFO, f"held {i} " + "j" * 1000))
    lost = handler.lost
    for _ in range(FAILURES_BEFORE_REPLACING - 1):
        assert handler.sink == "stderr" and handler.retry_at is not None
        clock.now = handler.retry_at
        handler.flush()
    assert handler.sink == "the journal" and handler.counts["log_sink_replaced"] == 1
    handler.emit(record(logging.ERROR, "after the switch"))
    journald.settimeout(5)
    stream, _ = journald.accept()
    stream.settimeout(5)
    received = b""
    while not received.endswith(b"<3>ERROR kvprefetchd: after the switch\n"):
        handler.flush()
        received += stream.recv(1 << 20)
    header, _, lines = received.decode().partition("0\n0\n0\n")
    assert header == "kvprefetchd\n\n6\n1\n"  # identifier, unit, priority, level prefix
    first = lines.split("\n")[0]
    assert first == (f"<4>stderr failed {FAILURES_BEFORE_REPLACING} times in a row (No space "
                     f"left on device (28)): logging to the journal from now on; {lost} log "
                     "lines were lost")
    assert "\nheld 0 " in lines
    handler.close()
    stream.close()
    journald.close()
    os.close(fd)


def test_without_a_journal_lines_are_dropped_and_stderr_is_still_retried() -> None:
    clock = Clock()
    handler, fd = failing_handler(clock, journal_path="/nonexistent/journal/stdout")
    for _ in range(30):
        handler.emit(record(logging.INFO, "x"))
        clock.now = handler.retry_at or clock.now
    assert handler.sink == "stderr" and handler.counts["log_sink_replaced"] == 0
    assert handler.retry_at is not None and handler.retry_at - clock.now <= RETRY_MOST
    handler.close()
    os.close(fd)


def test_a_terminal_whose_master_hung_up_never_raises() -> None:
    master, slave = os.openpty()
    handler = NonBlockingStderr(slave, journal_path=None, clock=Clock())
    handler.setFormatter(logging.Formatter("%(message)s"))
    os.close(master)
    handler.emit(record(logging.WARNING, "hung up"))  # EIO
    assert handler.counts["log_write_errors"] == 1 and "Input/output error" in handler.failure
    handler.close()
    os.close(slave)


def test_a_record_that_cannot_be_formatted_is_counted_and_prints_nothing(
    capfd: pytest.CaptureFixture[str],
) -> None:
    read_end, write_end = os.pipe()
    handler = NonBlockingStderr(write_end, journal_path=None)
    bad = logging.LogRecord("kvprefetchd", logging.ERROR, __file__, 1, "%d items", ("x",), None)
    handler.emit(bad)
    assert handler.counts["log_format_errors"] == 1
    assert capfd.readouterr().err == ""  # no "--- Logging error ---" traceback
    handler.close()
    os.close(write_end)
    os.close(read_end)


def test_the_pump_retries_a_failing_sink_when_due_and_never_watches_it() -> None:
    """A failing file is always writable: watching it would spin the loop."""
    clock = Clock()
    handler, fd = failing_handler(clock)
    root = logging.getLogger()
    root.addHandler(handler)
    selector = selectors.DefaultSelector()
    pump = LogPump(selector)
    try:
        handler.emit(record(logging.INFO, "x"))
        pump.tick(clock.now)
        assert not selector.get_map() and pump.next_due(clock.now) == pytest.approx(RETRY_FIRST)
        clock.now += RETRY_FIRST
        pump.tick(clock.now)
        assert handler.counts["log_write_errors"] == 2
        assert pump.next_due(clock.now) == pytest.approx(2 * RETRY_FIRST)
    finally:
        root.removeHandler(handler)
        selector.close()
        handler.close()
        os.close(fd)


def test_the_pump_watches_a_full_pipe_and_lets_go_once_it_drains() -> None:
    read_end, write_end = os.pipe()
    handler = NonBlockingStderr(write_end, journal_path=None)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    selector = selectors.DefaultSelector()
    pump = LogPump(selector)
    try:
        for _ in range(200):
            handler.emit(record(logging.INFO, "p" * 1000))
        pump.tick(0.0)
        assert len(selector.get_map()) == 1 and pump.next_due(0.0) is None
        os.set_blocking(read_end, False)
        while handler.pending:
            with contextlib.suppress(BlockingIOError):
                os.read(read_end, 1 << 20)
            for key, events in selector.select(1):
                key.data(events)
        pump.tick(0.0)
        assert not selector.get_map()
    finally:
        root.removeHandler(handler)
        selector.close()
        handler.close()
        os.close(write_end)
        os.close(read_end)
