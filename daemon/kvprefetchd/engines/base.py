"""The engine interface, in the manner of fio's ioengines: queue, submit, reap.

`queue` answers QUEUED or BUSY: backpressure is part of the contract, so the
worker stops feeding an engine that is full instead of growing a hidden list.
Every engine hands its whole batch to C in one call (kvp_run_batch), with the
GIL released: crossing the cffi boundary per file would cost more than the
residency check it wraps. One class serves every engine: what differs between
them is a row of C's engine table (native/prefetch.c), named by the engine and
its warm mode; engines/__init__.py says which row serves which configuration.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

from kvprefetchd.native import NativeUnavailable, load_native


class QueueAnswer(enum.Enum):
    QUEUED = "queued"
    BUSY = "busy"


@dataclass(frozen=True)
class EngineSettings:
    chunk_bytes: int
    queue_depth: int
    pread_threads: int
    fadv_random: bool
    batch_files: int
    max_open_files: int


@dataclass(slots=True)
class WarmItem:
    """One head to warm: where it lives, how deep, and (for the worker) what it is known as."""

    root_fd: int
    rule: int
    relative: bytes
    read_bytes: int  # the request's read_bytes: how much of the head to warm
    key: Any = None
    received: float = 0.0  # monotonic time the worker got it: per-file latency starts here


@dataclass(slots=True)  # one per file on the hot path: no frozen __setattr__ detour
class Completion:
    item: WarmItem
    outcome: str
    error: int
    size: int
    done: int


class Engine:
    """A native context for one row of C's engine table, fed a batch at a time."""

    def __init__(self, name: str, warm_mode: str, settings: EngineSettings) -> None:
        self.name = name
        self.warm_mode = warm_mode
        self.settings = settings
        self._native = load_native()
        self._outcome_names = self._native.outcome_names
        self._queued: list[WarmItem] = []
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
            raise NativeUnavailable(f"{name}: cannot set up ({_strerror(error[0])})")
        self._ctx = ffi.gc(ctx, self._native.lib.kvp_ctx_free)

    def queue(self, item: WarmItem) -> QueueAnswer:
        if len(self._queued) >= self.settings.batch_files:
            return QueueAnswer.BUSY
        self._queued.append(item)
        return QueueAnswer.QUEUED

    def submit(self) -> int:
        """Warm everything queued, in one native call; returns how many files it covered."""
        items, self._queued = self._queued, []
        if not items:
            return 0
        ffi, lib = self._native.ffi, self._native.lib
        # One buffer of NUL-terminated names, pointed into, instead of one cffi
        # allocation per file: the batch costs one allocation however large.
        names = b"\0".join(item.relative for item in items) + b"\0"
        name_buffer = ffi.from_buffer(names)
        base = ffi.cast("char *", name_buffer)
        native_items = ffi.new("struct kvp_item[]", len(items))
        offset = 0
        for native, item in zip(native_items, items, strict=True):
            native.root_fd = item.root_fd
            native.residency = item.rule
            native.rel = base + offset
            native.read_bytes = item.read_bytes
            offset += len(item.relative) + 1
        status = lib.kvp_run_batch(self._ctx, native_items, len(items))
        if status < 0 and all(n.outcome == 0 and n.done == 0 for n in native_items):
            # The batch never ran: nothing was read, every file failed.
            self._done.extend(Completion(item, "failed", -status, 0, 0) for item in items)
            return len(items)
        for native, item in zip(native_items, items, strict=True):
            outcome = self._outcome_names[native.outcome]
            self._done.append(Completion(item, outcome, native.err, native.size, native.done))
        return len(items)

    def reap(self) -> list[Completion]:
        done, self._done = self._done, []
        return done


def _strerror(error: int) -> str:
    try:
        return os.strerror(error)
    except ValueError:
        return f"errno {error}"
