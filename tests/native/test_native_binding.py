"""The binding itself: import, constants, context validation, kvp_resident_bytes."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from native_helpers import PAGE, Ctx, KiB, MiB, check_warm, evict, write_file

from kvprefetchd._native import ffi, lib


def test_import_constants_and_a_call() -> None:
    assert lib.KVP_OUT_READ == 0 and lib.KVP_OUT_FAILED == 4
    assert lib.KVP_ENGINE_URING_FADVISE == 3
    assert lib.KVP_RES_PAGECACHE == 2
    assert lib.kvp_have_cachestat() in (0, 1)
    assert lib.kvp_resident_bytes(-1, 0, PAGE, 0) == -errno.EBADF
    assert lib.kvp_resident_bytes(-1, 0, PAGE, 1) == -errno.EBADF


def test_uring_probe_reports_a_reason() -> None:
    why = ffi.new("char[]", 128)
    ok = lib.kvp_uring_probe(why, 128)
    text = ffi.string(why).decode()
    assert ok in (0, 1)
    assert (ok == 1 and text == "") or (ok == 0 and text), text
    # A tiny buffer is never overrun.
    small = ffi.new("char[]", 4)
    lib.kvp_uring_probe(small, 4)
    assert len(ffi.string(small)) <= 3


@pytest.mark.parametrize(
    "cfg",
    [
        {"engine": 7},
        {"engine": -1},
        {"chunk": 0},
        {"chunk": 1 << 30},
        {"max_open": 0},
        {"engine": lib.KVP_ENGINE_URING_READ, "queue_depth": 0},
    ],
)
def test_ctx_new_rejects_bad_config(cfg: dict[str, int]) -> None:
    full = {"engine": lib.KVP_ENGINE_PREAD, "fadv_random": 1, "chunk": 65536,
            "queue_depth": 8, "threads": 1, "max_open": 8}
    full.update(cfg)
    err = ffi.new("int *")
    assert lib.kvp_ctx_new(ffi.new("struct kvp_config *", full), err) == ffi.NULL
    assert err[0] == errno.EINVAL


def test_ctx_new_null_config() -> None:
    err = ffi.new("int *")
    assert lib.kvp_ctx_new(ffi.NULL, err) == ffi.NULL
    assert err[0] == errno.EINVAL
    lib.kvp_ctx_free(ffi.NULL)  # a no-op, like free(NULL)


def test_empty_batch_and_null_ctx() -> None:
    ctx = Ctx("pread1")
    assert lib.kvp_run_batch(ctx.ctx, ffi.NULL, 0) == 0
    items = ffi.new("struct kvp_item[]", 2)
    assert lib.kvp_run_batch(ffi.NULL, items, 2) == -errno.EINVAL
    assert [it.outcome for it in items] == [lib.KVP_OUT_FAILED] * 2
    assert [it.err for it in items] == [errno.EINVAL] * 2


def test_resident_bytes_cachestat_and_mincore_agree(tmp_path: Path) -> None:
    path = write_file(tmp_path / "f", 3 * MiB + 100)
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        for uptodate in (0, 1):
            assert lib.kvp_resident_bytes(fd, 0, 3 * MiB + 100, uptodate) == 0
        os.pread(fd, MiB, MiB)  # may read ahead beyond: only check what must be there
        for uptodate in (0, 1):
            got = lib.kvp_resident_bytes(fd, MiB, MiB, uptodate)
            assert got <= MiB
            check_warm(got, MiB, f"uptodate={uptodate}")
            # capped at len, whole pages, unaligned offset
            assert lib.kvp_resident_bytes(fd, MiB + 100, 1000, uptodate) == 1000
            assert lib.kvp_resident_bytes(fd, MiB, 0, uptodate) == 0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        os.pread(fd, 4 * MiB, 0)
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


def test_uring_engines_need_liburing() -> None:
    """Built without liburing, the io_uring engines fail kvp_ctx_new with ENOSYS."""
    why = ffi.new("char[]", 64)
    cfg = ffi.new("struct kvp_config *", {"engine": lib.KVP_ENGINE_URING_READ, "fadv_random": 1,
                                          "chunk": 65536, "queue_depth": 8, "threads": 1,
                                          "max_open": 8})
    err = ffi.new("int *")
    ctx = lib.kvp_ctx_new(cfg, err)
    if lib.kvp_uring_probe(why, 64) == 0 and ffi.string(why) == b"built without liburing":
        assert ctx == ffi.NULL and err[0] == errno.ENOSYS
    elif ctx != ffi.NULL:
        lib.kvp_ctx_free(ctx)
    else:
        assert lib.kvp_uring_probe(why, 64) == 0, "ring setup refused although the probe passed"
