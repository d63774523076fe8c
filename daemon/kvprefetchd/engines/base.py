"""What every engine offers a worker: take files, say when outcomes wait, hand them over.

Two kinds stand behind it, in the manner of fio's ioengines (sync and async):
- the queue (engines/queue.py, native/queue.c): files are taken as they arrive and
  their outcomes come back as they finish, from persistent threads whose reads in
  flight follow each root's file system; `fileno()` turns readable when outcomes wait.
- the batch (BatchEngine below, kvp_run_batch): a batch of files is warmed in one
  native call, with the GIL released, and its outcomes are ready when `take` returns
  (`fileno()` is -1). io_uring's engines are of this kind: one ring per worker.
Either way the boundary is crossed once per batch of files, never once per file.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from kvprefetchd.native import NativeUnavailable, load_native

# Most head bytes one batch call may be asked for. A worker running a batch says
# nothing to the supervisor until it returns, and the supervisor kills a worker that
# owes outcomes and says nothing for `worker_timeout` (60 s): so a batch must stay
# short on a slow tier. 256 MiB is batch_files x read_bytes at their defaults;
# requests with a large read_bytes get fewer files per batch, e.g. 4 heads of 64 MiB,
# which a tier delivering 5 MB/s still reads within 60 s.
MAX_BATCH_BYTES = 256 << 20


@dataclass(frozen=True)
class EngineSettings:
    chunk_bytes: int
    queue_depth: int  # io_uring: reads in flight per ring
    pread_threads: int  # io_uring advise: confirming threads per batch
    fadv_random: bool
    batch_files: int
    max_open_files: int
    # The queue: reads in flight per root to start from, threads at most per worker,
    # and how long a file may take before it is settled `failed` (0: no limit); the
    # threads of its lane for files behind another mount beneath their root.
    initial_depth: int = 16
    max_in_flight: int = 512
    file_timeout: float = 60.0
    other_mount_threads: int = 4


@dataclass(slots=True)
class WarmItem:
    """One head to warm: where it lives, how deep, and (for the worker) what it is known as."""

    root_fd: int
    rule: int
    relative: bytes
    read_bytes: int  # the request's read_bytes: how much of the head to warm
    key: Any = None
    received: float = 0.0  # monotonic time the worker got it: per-file latency starts here
    deadline: float = 0.0  # monotonic seconds past which its read is not issued; 0: none
    flags: int = 0  # KVP_ITEM_*
    # The queue engines' scheduling (native/schedule.c): the request the file came with
    # (the worker numbers them, a later one is newer; 0: none) and who sent it.
    group: int = 0
    client: int = 0
    position: int = 0  # its place in the request: its consumer reads them in order


@dataclass(slots=True)  # one per file on the hot path: no frozen __setattr__ detour
class Completion:
    item: WarmItem
    outcome: str
    error: int
    size: int
    done: int
    held_fd: int = -1  # KVP_ITEM_HOLD: the fd the read kept open, now the worker's to close


class Engine(Protocol):
    """The worker's view of an engine of either kind."""

    name: str
    warm_mode: str
    batched: bool  # take() runs a batch to its end before it returns

    def take(self, pending: deque[WarmItem]) -> None:
        """Start on pending files (all of them, or one batch), removing them from it."""

    def reap(self) -> list[Completion]:
        """The outcomes that are ready, each once."""

    def fileno(self) -> int:
        """An fd that is readable while outcomes wait; -1 when take() leaves them ready."""

    @property
    def outstanding(self) -> int:
        """Files taken whose outcomes have not been reaped."""

    def tick(self) -> None:
        """Housekeeping a few times a second while files are out."""


class NativeEngine:
    """What both kinds hold: their names, settings, and the native module's outcome names."""

    def __init__(self, name: str, warm_mode: str, settings: EngineSettings) -> None:
        self.name = name
        self.warm_mode = warm_mode
        self.settings = settings
        self._native = load_native()
        self._outcome_names = self._native.outcome_names


class BatchEngine(NativeEngine):
    """A native context for one row of C's engine table, fed a batch at a time."""

    batched = True

    def __init__(self, name: str, warm_mode: str, settings: EngineSettings) -> None:
        super().__init__(name, warm_mode, settings)
        self._done: list[Completion] = []
        ffi = self._native.ffi
        engine, mode = ffi.new("char[]", name.encode()), ffi.new("char[]", warm_mode.encode())
        config = ffi.new("struct kvp_config *")
        config.engine = engine  # kvp_ctx_new keeps the table's copy: these may go after it
        config.warm_mode = mode
        config.fadv_random = int(settings.fadv_random)
        config.chunk = settings.chunk_bytes
        config.queue_depth = settings.queue_depth
        config.threads = settings.pread_threads
        config.max_open = settings.max_open_files
        error = ffi.new("int *")
        ctx = self._native.lib.kvp_ctx_new(config, error)
        if ctx == ffi.NULL:
            raise NativeUnavailable(f"{name}: cannot set up ({strerror(error[0])})")
        self._ctx = ffi.gc(ctx, self._native.lib.kvp_ctx_free)

    def fileno(self) -> int:
        return -1

    @property
    def outstanding(self) -> int:
        return len(self._done)

    def tick(self) -> None:
        pass

    def take(self, pending: deque[WarmItem]) -> None:
        """Warm one batch (at most batch_files files and MAX_BATCH_BYTES) in one native call.

        Bounding a batch bounds the worker's silence, which the supervisor's heartbeat
        reads as wedged past worker_timeout."""
        items = next_batch(pending, self.settings.batch_files)
        if items:
            self._run(items)

    def _run(self, items: list[WarmItem]) -> None:
        ffi, lib = self._native.ffi, self._native.lib
        native_items, keep = native_batch(ffi, items)
        status = lib.kvp_run_batch(self._ctx, native_items, len(items))
        del keep
        if status < 0 and all(n.outcome == 0 and n.done == 0 for n in native_items):
            # The batch never ran: nothing was read, every file failed.
            self._done.extend(Completion(item, "failed", -status, 0, 0) for item in items)
            return
        for native, item in zip(native_items, items, strict=True):
            outcome = self._outcome_names[native.outcome]
            self._done.append(Completion(item, outcome, native.err, native.size, native.done))

    def reap(self) -> list[Completion]:
        done, self._done = self._done, []
        return done


def next_batch(pending: deque[WarmItem], batch_files: int) -> list[WarmItem]:
    """Take one batch off pending: at most batch_files files and MAX_BATCH_BYTES of
    heads (a head larger than that goes alone)."""
    items: list[WarmItem] = []
    budget = MAX_BATCH_BYTES
    while pending and len(items) < batch_files and (not items or pending[0].read_bytes <= budget):
        item = pending.popleft()
        budget -= item.read_bytes
        items.append(item)
    return items


# The native deadline is int64 ns of CLOCK_MONOTONIC. The protocol refuses deadlines
# beyond a day (protocol.MAX_DEADLINE_MS); should any other path hand a worker a larger
# one, it is clamped here ("not before the end of time") rather than overflowing the
# field, which raised OverflowError and killed the worker (issue 23).
_DEADLINE_NS_MAX = (1 << 63) - 1
_DEADLINE_S_MAX = 9.2e9  # * 1e9 stays below _DEADLINE_NS_MAX, inf included


def deadline_ns(deadline: float) -> int:
    """A WarmItem's deadline (monotonic seconds; 0, negative or NaN: none) as the native
    field holds it, always within int64."""
    if not deadline > 0.0:
        return 0
    return min(int(min(deadline, _DEADLINE_S_MAX) * 1e9), _DEADLINE_NS_MAX)


def native_batch(ffi: Any, items: list[WarmItem]) -> tuple[Any, Any]:
    """The items as a `struct kvp_item[]`, and what must stay alive while C reads it.

    One buffer of NUL-terminated names, pointed into, instead of one cffi allocation
    per file: a batch costs one allocation however large."""
    names = ffi.from_buffer(b"\0".join(item.relative for item in items) + b"\0")
    base = ffi.cast("char *", names)
    native = ffi.new("struct kvp_item[]", len(items))
    offset = 0
    for entry, item in zip(native, items, strict=True):
        entry.root_fd = item.root_fd
        entry.residency = item.rule
        entry.rel = base + offset
        entry.read_bytes = item.read_bytes
        if item.deadline:  # time.monotonic() is CLOCK_MONOTONIC
            entry.deadline_ns = deadline_ns(item.deadline)
        entry.flags = item.flags
        entry.group = item.group
        entry.client = item.client
        entry.position = item.position
        offset += len(item.relative) + 1
    return native, names


def strerror(error: int) -> str:
    try:
        return os.strerror(error)
    except ValueError:
        return f"errno {error}"
