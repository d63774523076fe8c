"""The binding itself: import, constants, context validation, kvp_resident_bytes."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
from native_helpers import (
    PAGE,
    Ctx,
    KiB,
    MiB,
    engine_table,
    engine_unavailable,
    evict,
    new_ctx,
    new_queue,
    write_file,
)

from kvharness.pagecache import pinned
from kvprefetchd._native import ffi, lib

# C's one engine table: the queue's engines (native/queue.c), then the batch engines.
TABLE = [("pread", "read", True), ("fadvise", "advise", True), ("io_uring", "read", False),
         ("io_uring", "advise", False)]


def test_import_constants_and_a_call() -> None:
    assert lib.KVP_OUT_READ == 0 and lib.KVP_OUT_FAILED == 4
    assert lib.KVP_RES_OFF == 0 and lib.KVP_RES_PAGECACHE == 2
    assert lib.kvp_have_cachestat() in (0, 1)
    assert lib.kvp_resident_bytes(-1, 0, PAGE, 0) == -errno.EBADF
    assert lib.kvp_resident_bytes(-1, 0, PAGE, 1) == -errno.EBADF


def test_the_engine_table_lists_every_engine_once() -> None:
    assert engine_table() == TABLE
    # A short array gets the first rows; the count is the whole table's either way.
    one = ffi.new("struct kvp_engine_name[]", 1)
    assert lib.kvp_engines(one, 1) == len(TABLE)
    assert (ffi.string(one[0].engine), ffi.string(one[0].warm_mode), one[0].queued) == (
        b"pread", b"read", 1)


@pytest.mark.parametrize(("engine", "warm_mode", "queued"), TABLE)
def test_engine_probe_reports_a_reason(engine: str, warm_mode: str, queued: bool) -> None:
    why = ffi.new("char[]", 128)
    ok = lib.kvp_engine_detect(engine.encode(), warm_mode.encode(), why, 128)
    text = ffi.string(why).decode()
    assert (ok == 1 and text == "") or (ok == 0 and text), text
    # A tiny buffer is never overrun, and no buffer at all is allowed.
    small = ffi.new("char[]", 4)
    assert lib.kvp_engine_detect(engine.encode(), warm_mode.encode(), small, 4) == ok
    assert len(ffi.string(small)) <= 3
    assert lib.kvp_engine_detect(engine.encode(), warm_mode.encode(), ffi.NULL, 0) == ok
    if queued:  # pread(2) and posix_fadvise(2): nothing here refuses them
        assert ok == 1


@pytest.mark.parametrize(("engine", "warm_mode", "queued"), TABLE)
def test_each_kind_is_made_by_its_own_constructor(engine: str, warm_mode: str,
                                                  queued: bool) -> None:
    """A queue engine makes a queue and no batch context; a batch engine the reverse: both
    refuse the other kind with EINVAL, as they refuse a name the table lacks."""
    wrong = new_ctx if queued else new_queue
    with pytest.raises(OSError) as refused:
        wrong(engine, warm_mode)
    assert refused.value.errno == errno.EINVAL
    if queued:
        assert new_queue(engine, warm_mode) is not None


@pytest.mark.parametrize(
    ("engine", "warm_mode"),
    [("nope", "read"), ("pread", "advise"), ("fadvise", "read"), ("io_uring", "write"),
     ("", ""), ("IO_URING", "read")],
)
def test_an_unknown_engine_is_refused(engine: str, warm_mode: str) -> None:
    why = ffi.new("char[]", 128)
    assert lib.kvp_engine_detect(engine.encode(), warm_mode.encode(), why, 128) == 0
    assert f"no engine {engine} with warm mode {warm_mode}" == ffi.string(why).decode()
    for make in (new_ctx, new_queue):
        with pytest.raises(OSError) as refused:
            make(engine, warm_mode)
        assert refused.value.errno == errno.EINVAL


def test_a_null_engine_name_is_refused() -> None:
    why = ffi.new("char[]", 128)
    assert lib.kvp_engine_detect(ffi.NULL, b"read", why, 128) == 0
    assert lib.kvp_engine_detect(b"io_uring", ffi.NULL, why, 128) == 0
    cfg = ffi.new("struct kvp_config *", {"chunk": 65536, "max_open": 8, "threads": 1})
    err = ffi.new("int *")
    assert lib.kvp_ctx_new(cfg, err) == ffi.NULL
    assert err[0] == errno.EINVAL
    queue_cfg = ffi.new("struct kvp_queue_config *",
                        {"chunk": 65536, "initial_depth": 1, "max_threads": 1})
    assert lib.kvp_queue_new(queue_cfg, err) == ffi.NULL
    assert err[0] == errno.EINVAL


@pytest.mark.parametrize(
    ("engine", "warm_mode", "cfg"),
    [
        ("io_uring", "read", {"chunk": 0}),
        ("io_uring", "read", {"chunk": 1 << 30}),
        ("io_uring", "read", {"max_open": 0}),
        ("io_uring", "advise", {"max_open": 0}),
        ("io_uring", "read", {"queue_depth": 0}),
        ("io_uring", "advise", {"queue_depth": 0}),
    ],
)
def test_ctx_new_rejects_bad_config(engine: str, warm_mode: str, cfg: dict[str, int]) -> None:
    """EINVAL, before anything else (a build without liburing included)."""
    with pytest.raises(OSError) as refused:
        new_ctx(engine, warm_mode, **cfg)
    assert refused.value.errno == errno.EINVAL


def test_ctx_new_null_config() -> None:
    err = ffi.new("int *")
    assert lib.kvp_ctx_new(ffi.NULL, err) == ffi.NULL
    assert err[0] == errno.EINVAL
    lib.kvp_ctx_free(ffi.NULL)  # a no-op, like free(NULL)


def test_empty_batch_and_null_ctx() -> None:
    if (why := engine_unavailable("io_uring", "read")) is not None:
        pytest.skip(why)
    ctx = Ctx("io_uring-read")
    assert lib.kvp_run_batch(ctx.ctx, ffi.NULL, 0) == 0
    items = ffi.new("struct kvp_item[]", 2)
    assert lib.kvp_run_batch(ffi.NULL, items, 2) == -errno.EINVAL
    assert [it.outcome for it in items] == [lib.KVP_OUT_FAILED] * 2
    assert [it.err for it in items] == [errno.EINVAL] * 2


@pytest.mark.parametrize(
    "cfg",
    [{"chunk": 0}, {"chunk": 1 << 30}, {"max_threads": 0}, {"max_threads": 5000},
     {"initial_depth": 0}],
)
def test_queue_new_rejects_bad_config(cfg: dict[str, int]) -> None:
    with pytest.raises(OSError) as refused:
        new_queue(**cfg)
    assert refused.value.errno == errno.EINVAL
    err = ffi.new("int *")
    assert lib.kvp_queue_new(ffi.NULL, err) == ffi.NULL and err[0] == errno.EINVAL


def test_an_empty_submission_and_an_idle_queue() -> None:
    queue = new_queue()
    assert lib.kvp_queue_submit(queue, ffi.NULL, ffi.NULL, 0) == 0
    out = ffi.new("struct kvp_done[]", 4)
    assert lib.kvp_queue_reap(queue, out, 4) == 0
    lib.kvp_queue_tick(queue)
    stats = ffi.new("struct kvp_queue_stats *")
    lib.kvp_queue_stats(queue, stats)
    assert (stats.threads, stats.pending, stats.running, stats.submitted) == (0, 0, 0, 0)


def test_resident_bytes_cachestat_and_mincore_agree(tmp_path: Path) -> None:
    path = write_file(tmp_path / "f", 3 * MiB + 100)
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for uptodate in (0, 1):
            assert lib.kvp_resident_bytes(fd, 0, 3 * MiB + 100, uptodate) == 0
        os.pread(fd, MiB, MiB)  # may read ahead beyond: only check what must be there
        # Held by an mlocked mapping (the host's reclaimer would take a few pages back).
        with pinned([path], MiB, offset=MiB) as pin:
            pin.require_all()
            for uptodate in (0, 1):
                assert lib.kvp_resident_bytes(fd, MiB, MiB, uptodate) == MiB, uptodate
                # capped at len, whole pages, unaligned offset
                assert lib.kvp_resident_bytes(fd, MiB + 100, 1000, uptodate) == 1000
                assert lib.kvp_resident_bytes(fd, MiB, 0, uptodate) == 0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        os.pread(fd, 4 * MiB, 0)
        with pinned([path]) as pin:
            pin.require_all()
            for uptodate in (0, 1):
                # pages past EOF are never cached: the tail page counts whole
                assert lib.kvp_resident_bytes(fd, 3 * MiB, 1 << 40, uptodate) == PAGE
                assert lib.kvp_resident_bytes(fd, 8 * MiB, MiB, uptodate) == 0
    finally:
        os.close(fd)


def test_resident_bytes_on_a_write_only_fd_uses_what_it_can(tmp_path: Path) -> None:
    path = write_file(tmp_path / "f", 64 * KiB)
    fd = os.open(path, os.O_WRONLY)
    try:
        # cachestat works on any fd; mincore needs a readable mapping
        if lib.kvp_have_cachestat():
            assert lib.kvp_resident_bytes(fd, 0, 64 * KiB, 0) >= 0
        assert lib.kvp_resident_bytes(fd, 0, 64 * KiB, 1) == -errno.EACCES
    finally:
        os.close(fd)


@pytest.mark.parametrize("warm_mode", ["read", "advise"])
def test_uring_engines_need_liburing(warm_mode: str) -> None:
    """Built without liburing, the io_uring engines fail kvp_ctx_new with ENOSYS."""
    why = engine_unavailable("io_uring", warm_mode)
    try:
        new_ctx("io_uring", warm_mode)
    except OSError as error:
        if why == "built without liburing":
            assert error.errno == errno.ENOSYS
        else:
            assert why is not None, f"ring setup refused although the probe passed: {error}"
    else:
        assert why is None, f"a ring was set up although the probe said: {why}"


def test_prefetch_c_maps_every_native_file() -> None:
    """prefetch.c's header comment is the map of native/: every C file and header, and
    nothing that is not there."""
    native = Path(__file__).resolve().parents[2] / "native"
    head = (native / "prefetch.c").read_text().split("*/", 1)[0]
    listed = re.findall(r"^ \*   (\w+\.[ch]) ", head, re.MULTILINE)
    assert len(listed) == len(set(listed))
    assert set(listed) == {p.name for p in native.iterdir() if p.suffix in (".c", ".h")}
