"""kvp_run_batch on real files, for every engine.

Eviction is real (fsync + POSIX_FADV_DONTNEED, verified) and so is the check (mincore
through kvp_resident_bytes(uptodate=1)).  A page the host's reclaimer took after an
engine read it is told from one never read (assert_warm); a head a batch must find
resident is pinned (mlocked) first.  Nothing here asserts a timing.  Ctx.run_batch
checks that the process's descriptor count is the same before and after every batch.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from native_helpers import (
    OUTCOMES,
    PAGE,
    Batch,
    Ctx,
    KiB,
    MiB,
    Result,
    assert_warm,
    evict,
    resident,
    write_file,
)

from kvharness.pagecache import pinned
from kvprefetchd._native import lib
from real_eio import real_eio

# With FADV_RANDOM a read brings in what it asks for, not a readahead window;
# measured: exactly the head on ext4 (slack 0).  Leave room for one large folio.
RANDOM_SLACK = 128 * KiB


@pytest.fixture(autouse=True)
def no_hang() -> Iterator[None]:
    """A blocking open (a FIFO opened for reading) must fail the run, not hang it."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def make_files(root: Path, n: int, size: int, prefix: str = "f") -> list[str]:
    rels = []
    for i in range(n):
        write_file(root / f"{prefix}{i:04d}", size, seed=i)
        evict(root / f"{prefix}{i:04d}")
        rels.append(f"{prefix}{i:04d}")
    return rels


def test_cold_heads_are_read_then_resident(engine: str, root) -> None:
    size, read_bytes = 4 * MiB, MiB
    rels = make_files(root.path, 8, size)
    ctx = Ctx(engine, chunk=256 * KiB, queue_depth=8, max_open=4)
    res = ctx.run(root.fd, rels, read_bytes)
    assert res == [Result("READ", "", size, read_bytes)] * len(rels)
    for rel in rels:
        assert_warm(root.path / rel, read_bytes)
        # FADV_RANDOM: no readahead window beyond the head
        assert resident(root.path / rel, 0, size, 0) <= read_bytes + RANDOM_SLACK
    # Second batch, page-cache rule: everything is already there (held there: what the
    # reclaimer took is read back by the pin, never beyond the head), nothing read.
    with pinned([root.path / rel for rel in rels], read_bytes) as pin:
        pin.require_all()
        res = ctx.run(root.fd, rels, read_bytes, residency=lib.KVP_RES_PAGECACHE)
    assert res == [Result("RESIDENT", "", size, read_bytes)] * len(rels), res
    for rel in rels:
        assert resident(root.path / rel, 0, size, 0) <= read_bytes + RANDOM_SLACK


def test_pagecache_rule_reads_a_partly_cached_head(engine: str, root) -> None:
    (rel,) = make_files(root.path, 1, 2 * MiB)
    fd = os.open(root.path / rel, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    os.pread(fd, 256 * KiB, 0)  # first quarter of the head only
    os.close(fd)
    res = Ctx(engine).run(root.fd, [rel], MiB, residency=lib.KVP_RES_PAGECACHE)
    assert res == [Result("READ", "", 2 * MiB, MiB)]
    assert_warm(root.path / rel, MiB)


def test_head_shapes(engine: str, root) -> None:
    short = 100 * KiB + 17
    odd = MiB + PAGE + 123  # not a multiple of the chunk nor of the page
    write_file(root.path / "short", short)
    write_file(root.path / "empty", 0)
    write_file(root.path / "big", 4 * MiB)
    write_file(root.path / "tiny", 1)
    for name in ("short", "big", "tiny"):
        evict(root.path / name)
    rels = ["short", "empty", "big", "big", "tiny"]
    read_bytes = [MiB, MiB, odd, 0, MiB]
    res = Ctx(engine, chunk=256 * KiB).run(root.fd, rels, read_bytes)
    assert res == [
        Result("READ", "", short, short),
        Result("RESIDENT", "", 0, 0),  # empty file: nothing to warm
        Result("READ", "", 4 * MiB, odd),
        Result("RESIDENT", "", 4 * MiB, 0),  # read_bytes 0: nothing to warm
        Result("READ", "", 1, 1),
    ]
    assert_warm(root.path / "short", short)
    assert_warm(root.path / "big", odd)
    assert_warm(root.path / "tiny", 1)


def test_missing_and_removed_before_the_run(engine: str, root) -> None:
    write_file(root.path / "soon_gone", 64 * KiB)
    write_file(root.path / "plain", 64 * KiB)
    batch = Batch(root.fd, ["nope", "dir/nope", "plain/child", "soon_gone"], MiB)
    os.unlink(root.path / "soon_gone")  # after the batch was built
    res = Ctx(engine).run_batch(batch)
    assert [(r.outcome, r.err) for r in res] == [
        ("MISSING", "ENOENT"),
        ("MISSING", "ENOENT"),
        ("MISSING", "ENOTDIR"),
        ("MISSING", "ENOENT"),
    ]


def test_escapes_are_rejected_and_inner_symlinks_followed(
    engine: str, root, tmp_path: Path
) -> None:
    outside = write_file(tmp_path / "outside", 64 * KiB)
    write_file(root.path / "inner", 64 * KiB)
    (root.path / "sub").mkdir()
    evict(root.path / "inner")
    os.symlink(outside, root.path / "abs_out")
    os.symlink("../outside", root.path / "rel_out")
    os.symlink("../../outside", root.path / "sub" / "rel_out2")
    os.symlink(root.path / "inner", root.path / "abs_in")  # absolute: refused even if inside
    os.symlink("inner", root.path / "link_in")
    os.symlink("../inner", root.path / "sub" / "link_up_in")
    os.symlink("loop_b", root.path / "loop_a")
    os.symlink("loop_a", root.path / "loop_b")
    rels = ["../outside", "/etc/hostname", "abs_out", "rel_out", "sub/rel_out2", "abs_in",
            "sub/../../outside", "loop_a", "x" * 300, "", "link_in", "sub/link_up_in",
            "sub/../inner", "./sub//../inner"]
    res = Ctx(engine).run(root.fd, rels, MiB)
    got = [(r.outcome, r.err) for r in res]
    assert got == [("REJECTED", "EXDEV")] * 7 + [
        ("REJECTED", "ELOOP"),
        ("REJECTED", "ENAMETOOLONG"),
        ("REJECTED", "EINVAL"),
    ] + [("READ", "")] * 4
    assert all(r.done == 64 * KiB for r in res[-4:])
    assert_warm(root.path / "inner", 64 * KiB)


def test_special_files_are_rejected_without_blocking(engine: str, root, monkeypatch) -> None:
    os.mkfifo(root.path / "fifo")
    (root.path / "dir").mkdir()
    monkeypatch.chdir(root.path)  # keep the socket path short (sun_path is 108 bytes)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("sock")
    rels = ["fifo", "sock", "dir", "."]
    expected = [("REJECTED", "ENODEV"), ("REJECTED", "ENODEV"), ("REJECTED", "EISDIR"),
            ("REJECTED", "EISDIR")]
    try:
        os.mknod(root.path / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
        rels.append("null")
        expected.append(("REJECTED", "ENODEV"))
    except PermissionError:
        pass  # no CAP_MKNOD here: the FIFO and the socket still cover non-regular files
    try:
        res = Ctx(engine).run(root.fd, rels, MiB)
    finally:
        sock.close()
    assert [(r.outcome, r.err) for r in res] == expected


def test_device_node_needs_root(root) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod of a device node needs root")
    os.mknod(root.path / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    res = Ctx("pread-read").run(root.fd, ["null"], MiB)
    assert [(r.outcome, r.err) for r in res] == [("REJECTED", "ENODEV")]


def test_read_error_is_failed_with_its_errno(engine: str) -> None:
    """An honest EIO (tests/real_eio.py)."""
    base, rel = real_eio()
    root_fd = os.open(base, os.O_PATH | os.O_DIRECTORY)
    try:
        res = Ctx(engine).run(root_fd, [rel], 64 * KiB)
    finally:
        os.close(root_fd)
    assert [(r.outcome, r.err, r.done) for r in res] == [("FAILED", "EIO", 0)]


def test_open_error_is_failed_not_rejected(engine: str) -> None:
    """EACCES is an operational error: FAILED.  As root, DAC never refuses, but
    kernfs does: a write-only sysfs attribute cannot be opened for reading by
    anyone (fs/kernfs/file.c kernfs_fop_open).  Never written, so harmless."""
    base = "/sys/bus"
    cands = sorted(d for d in os.listdir(base) if os.path.exists(f"{base}/{d}/drivers_probe"))
    if not cands:
        pytest.skip("no /sys/bus/*/drivers_probe here")
    rel = f"{cands[0]}/drivers_probe"
    root_fd = os.open(base, os.O_PATH | os.O_DIRECTORY)
    try:
        res = Ctx(engine).run(root_fd, [rel], 64 * KiB)
    finally:
        os.close(root_fd)
    assert [(r.outcome, r.err) for r in res] == [("FAILED", "EACCES")]


def test_bad_residency_value_is_rejected(engine: str, root) -> None:
    write_file(root.path / "f", 4096)
    res = Ctx(engine).run(root.fd, ["f"], MiB, residency=9)
    assert [(r.outcome, r.err) for r in res] == [("REJECTED", "EINVAL")]


def test_full_ring_and_fd_budget(engine: str, root) -> None:
    """600 files through queue_depth 8 and at most 16 open at once, mixed with
    items that settle before any read."""
    size = 64 * KiB
    rels = make_files(root.path, 600, size)
    mixed = [r for i, r in enumerate(rels) for r in ([r, "missing"] if i % 50 == 0 else [r])]
    ctx = Ctx(engine, chunk=16 * KiB, queue_depth=8, max_open=16, threads=None)
    res = ctx.run(root.fd, mixed, size)
    for rel, r in zip(mixed, res, strict=True):
        if rel == "missing":
            assert (r.outcome, r.err) == ("MISSING", "ENOENT")
        else:
            assert r == Result("READ", "", size, size), rel
    for rel in rels:
        assert_warm(root.path / rel, size)
    # more threads than max_open: the budget still holds (checked by fd count)
    res = Ctx(engine, max_open=2, threads=8).run(root.fd, rels[:40], size,
                                                   residency=lib.KVP_RES_PAGECACHE)
    assert {r.outcome for r in res} <= {"RESIDENT", "READ"}


def test_tier_rule(engine: str, root) -> None:
    size, read_bytes = 4 * MiB, MiB
    with open(root.path / "stub", "wb") as f:  # a recalled-nothing stub: no blocks at all
        f.truncate(size)
    write_file(root.path / "full", size)
    with open(root.path / "partial", "wb") as f:  # first 512 KiB on disk, the rest a hole
        f.write(os.urandom(512 * KiB))
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())
    write_file(root.path / "small_full", 100 * KiB)
    for name in ("stub", "full", "partial", "small_full"):
        evict(root.path / name)
    assert os.stat(root.path / "stub").st_blocks == 0
    rels = ["stub", "full", "partial", "small_full"]
    res = Ctx(engine).run(root.fd, rels, read_bytes, residency=lib.KVP_RES_TIER)
    assert res == [
        Result("READ", "", size, read_bytes),
        Result("RESIDENT", "", size, read_bytes),
        Result("READ", "", size, read_bytes),
        Result("RESIDENT", "", 100 * KiB, 100 * KiB),
    ]
    assert_warm(root.path / "stub", read_bytes)
    # RESIDENT under the tier rule means not even opened for reading: still cold
    assert resident(root.path / "full", 0, size, 0) == 0
    assert resident(root.path / "small_full", 0, 100 * KiB, 0) == 0


def test_no_random_advice_still_reads_the_head(engine: str, root) -> None:
    rels = make_files(root.path, 3, 4 * MiB)
    res = Ctx(engine, fadv_random=0, chunk=MiB).run(root.fd, rels, MiB)
    assert res == [Result("READ", "", 4 * MiB, MiB)] * 3
    for rel in rels:
        assert_warm(root.path / rel, MiB)


def test_ctx_is_reused_across_many_batches(engine: str, root) -> None:
    rels = make_files(root.path, 20, 128 * KiB)
    ctx = Ctx(engine, queue_depth=4, max_open=3)
    for k in range(10):
        batch = [*rels[k * 2 : k * 2 + 2], "missing"]
        res = ctx.run(root.fd, batch, 128 * KiB)
        assert [r.outcome for r in res] == ["READ", "READ", "MISSING"]


def test_one_batch_settles_every_outcome(engine: str, root, tmp_path: Path) -> None:
    """Every row of C's engine table, one batch mixing an item of each outcome, each item
    under its own root as the worker sends them (the failed one under sysfs)."""
    eio_base, eio_rel = real_eio()
    write_file(tmp_path / "outside", 4096)
    (cold,) = make_files(root.path, 1, 256 * KiB, "cold")
    write_file(root.path / "warm", 64 * KiB)
    eio_root = os.open(eio_base, os.O_PATH | os.O_DIRECTORY)
    try:
        batch = Batch(root.fd, [cold, "warm", "nope", "../outside", eio_rel, cold], 128 * KiB,
                      residency=lib.KVP_RES_PAGECACHE)
        batch.items[4].root_fd = eio_root
        batch.items[4].residency = lib.KVP_RES_OFF
        batch.items[5].deadline_ns = 1  # long past: never looked up, never read
        with pinned([root.path / "warm"]) as pin:  # read and mlocked: resident for sure
            pin.require_all()
            res = Ctx(engine).run_batch(batch)
    finally:
        os.close(eio_root)
    assert res == [
        Result("READ", "", 256 * KiB, 128 * KiB),
        Result("RESIDENT", "", 64 * KiB, 64 * KiB),
        Result("MISSING", "ENOENT", 0, 0),
        Result("REJECTED", "EXDEV", 0, 0),
        Result("FAILED", "EIO", res[4].size, 0),
        Result("EXPIRED", "", 0, 0),
    ]
    assert {r.outcome for r in res} == set(OUTCOMES.values()), "a new outcome: add its item"
    assert_warm(root.path / cold, 128 * KiB)
