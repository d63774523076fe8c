"""The log handler's two promises, on real pipes: priorities per line, and no blocking."""

from __future__ import annotations

import contextlib
import logging
import os

from kvprefetchd.logs import PENDING_LIMIT, JournalFormatter, NonBlockingStderr


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
