"""Closing held files off the worker's loop.

A close on a FUSE mount is a request to the file system (FUSE_FLUSH), answered when one
of its threads gets to it: on s3fs under load, behind the HEADs and GETs it is serving,
tens to hundreds of milliseconds. A worker lets a held file go from its loop (its consumer
opened it, its time ran out, the budget needed room), and a loop blocked in close(2) hands
no new file to its queue meanwhile: measured in the router replay on s3fs (issue 25),
files waited past their deadline unstarted while the loop closed what consumers had
opened. So held fds are closed here, by one thread of their own, in the order let go.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading


class Closer:
    """One thread that closes the fds it is given."""

    def __init__(self) -> None:
        self._fds: queue.Queue[int | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def close(self, fd: int) -> None:
        """Close `fd` soon, on the closer's thread (started at the first fd)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvprefetchd-closer",
                                            daemon=True)
            self._thread.start()
        self._fds.put(fd)

    def _run(self) -> None:
        while (fd := self._fds.get()) is not None:
            with contextlib.suppress(OSError):  # EBADF cannot happen; EIO is the fs's
                os.close(fd)
            self._fds.task_done()
        self._fds.task_done()

    def pending(self) -> int:
        """Fds given and not closed yet (one of them, perhaps, in close(2) now)."""
        return self._fds.unfinished_tasks

    def wait(self) -> None:
        """Until every fd given so far is closed."""
        if self._thread is not None:
            self._fds.join()

    def stop(self, timeout: float) -> None:
        """Close what is left and end the thread, waiting at most `timeout` seconds (a
        file system that never answers must not hold a worker's exit)."""
        if self._thread is None:
            return
        self._fds.put(None)
        self._thread.join(timeout)
        self._thread = None
