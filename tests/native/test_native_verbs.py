"""check, evict, deadlines and O_NOATIME at the native boundary, on real files.

Residency is read back with mincore (uptodate pages only); atime with os.stat after
setting it two days back, which relatime refreshes on any read.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest
from native_helpers import (
    Batch,
    Child,
    Ctx,
    KiB,
    MiB,
    as_nobody,
    assert_warm,
    evict,
    new_queue,
    resident,
    run_queue,
    write_file,
)

from kvharness.pagecache import pinned
from kvprefetchd._native import ffi, lib
from kvprefetchd.native import load_native

STATES = load_native().check_states
TWO_DAYS = 2 * 86400


def test_evict_keeps_the_tail_of_a_file_cached_in_small_folios(root) -> None:
    path = write_file(root.path / "f", MiB)
    evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for offset in range(0, MiB, 4 * KiB):
            os.pread(fd, 4 * KiB, offset)  # page by page: small folios
    finally:
        os.close(fd)
    assert_warm(path, MiB)  # every page read (the host's reclaimer may take some: counted)
    (got,) = inspect(lib.KVP_INSPECT_EVICT_HEAD,
                     Batch(root.fd, ["f"], 256 * KiB, residency=lib.KVP_RES_PAGECACHE))
    assert got[0] == "cold" and resident(path, 0, 256 * KiB) == 0
    # The tail is still cached, but for what the reclaimer took: an eviction leaves no
    # shadow entry, so a tail page DONTNEED dropped would show here.
    assert_warm(path, 768 * KiB, offset=256 * KiB)


def inspect(action: int, batch: Batch) -> list[tuple[str, str, int, int, int]]:
    out = ffi.new("struct kvp_inspect_out[]", max(batch.n, 1))
    lib.kvp_inspect(action, batch.items, out, batch.n)
    return [
        (STATES[o.state], errno.errorcode.get(o.err, "") if o.err else "", o.size, o.cached,
         o.tier)
        for o in out[0 : batch.n]
    ]


def age_atime(path: Path) -> float:
    """Set atime two days back (relatime then refreshes it on the next read)."""
    st = os.stat(path)
    old = time.time() - TWO_DAYS
    os.utime(path, (old, st.st_mtime))
    return os.stat(path).st_atime


def test_check_reports_each_state_without_reading(root, tmp_path: Path) -> None:
    write_file(tmp_path / "outside", 4096)
    cold = write_file(root.path / "cold", MiB)
    warm = write_file(root.path / "warm", 256 * KiB)
    evict(cold)
    (root.path / "dir").mkdir()
    before = age_atime(cold)
    batch = Batch(root.fd, ["cold", "warm", "nope", "../outside", "dir"], 128 * KiB,
                  residency=lib.KVP_RES_PAGECACHE)
    with pinned([warm]) as pin:  # read and mlocked: no reclaimer or drop_caches takes it
        pin.require_all()
        got = inspect(lib.KVP_INSPECT_CHECK, batch)
    assert got[1][:3] == ("resident", "", 256 * KiB)
    assert got[1][3] == 256 * KiB and got[1][4] >= 256 * KiB
    assert got[0][:4] == ("cold", "", MiB, 0)
    assert got[2:] == [("missing", "ENOENT", 0, 0, 0), ("rejected", "EXDEV", 0, 0, 0),
                       ("rejected", "EISDIR", 0, 0, 0)]
    assert os.stat(cold).st_atime == before, "check changed atime"
    assert resident(cold) == 0, "check read the file"  # mincore maps it: atime after this


def test_the_tier_rule_judges_allocation(root) -> None:
    sparse = root.path / "stub"
    with open(sparse, "wb") as f:
        f.truncate(MiB)  # an HSM stub: a size, no blocks
    write_file(root.path / "full", MiB)
    batch = Batch(root.fd, ["stub", "full"], 256 * KiB, residency=lib.KVP_RES_TIER)
    got = inspect(lib.KVP_INSPECT_CHECK, batch)
    assert [(state, size, tier) for state, _, size, _, tier in got] == [
        ("cold", MiB, 0), ("resident", MiB, got[1][4])]
    assert got[1][4] >= MiB


def test_evict_drops_the_head_or_the_whole_file(root) -> None:
    for name in ("a", "b"):
        write_file(root.path / name, MiB)
        with open(root.path / name, "rb") as f:
            f.read()
        assert_warm(root.path / name, MiB)  # there, or taken by the host's reclaimer
    head = inspect(lib.KVP_INSPECT_EVICT_HEAD,
                   Batch(root.fd, ["a"], 256 * KiB, residency=lib.KVP_RES_PAGECACHE))
    whole = inspect(lib.KVP_INSPECT_EVICT_FILE,
                    Batch(root.fd, ["b"], 256 * KiB, residency=lib.KVP_RES_PAGECACHE))
    assert head[0][0] == "cold" and whole[0][0] == "cold"
    # Written in 1 MiB writes, the file may sit in large folios, which DONTNEED drops
    # whole or not at all: the head goes, with at most the rest of its folio.
    assert resident(root.path / "a", 0, 256 * KiB) == 0
    assert resident(root.path / "b") == 0
    assert whole[0][3] == 0


def test_an_unknown_action_fails_every_item(root) -> None:
    write_file(root.path / "f", 4096)
    got = inspect(7, Batch(root.fd, ["f"], 4096))
    assert got == [("failed", "EINVAL", 0, 0, 0)]


def test_the_queue_expires_files_past_their_deadline(root) -> None:
    paths = [write_file(root.path / f"f{i}", 64 * KiB) for i in range(4)]
    for path in paths:
        evict(path)
    batch = Batch(root.fd, [p.name for p in paths], 64 * KiB)
    batch.items[1].deadline_ns = 1
    batch.items[3].deadline_ns = time.monotonic_ns() + 60 * 10**9
    run_queue(new_queue(), batch)
    assert [(r.outcome, r.done) for r in batch.results()] == [
        ("READ", 64 * KiB), ("EXPIRED", 0), ("READ", 64 * KiB), ("READ", 64 * KiB)]
    assert resident(paths[1]) == 0


def _read_atime(root, flags: int, engine: str) -> tuple[str, float, float]:
    path = write_file(root.path / f"f{flags}{engine}", 64 * KiB)
    evict(path)
    before = age_atime(path)
    batch = Batch(root.fd, [path.name], 64 * KiB)
    batch.items[0].flags = flags
    (result,) = Ctx(engine).run_batch(batch)
    return result.outcome, before, os.stat(path).st_atime


def test_noatime_keeps_atime_and_plain_reads_refresh_it(root, engine: str) -> None:
    outcome, before, after = _read_atime(root, lib.KVP_ITEM_NOATIME, engine)
    assert outcome == "READ" and after == before
    outcome, before, after = _read_atime(root, 0, engine)
    assert outcome == "READ" and after > before


def test_noatime_falls_back_to_a_counted_plain_read_for_a_non_owner(root) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to nobody")
    path = write_file(root.path / "f", 64 * KiB)
    os.chmod(path, 0o644)  # root's file: nobody may read it, not open it O_NOATIME
    evict(path)
    batch = Batch(root.fd, ["f"], 64 * KiB)
    batch.items[0].flags = lib.KVP_ITEM_NOATIME
    ctx = Ctx("pread-read")

    def child() -> dict[str, Any]:
        before = lib.kvp_noatime_fallbacks()
        outcome = ctx.run_batch(batch)[0].outcome
        return {"outcome": outcome, "fallbacks": lib.kvp_noatime_fallbacks() - before}

    assert as_nobody(child) == {"outcome": "READ", "fallbacks": 1}


def states_of(got: list[tuple[str, str, int, int, int]]) -> list[tuple[str, str]]:
    return [(state, err) for state, err, *_ in got]


def test_check_and_evict_settle_names_behind_another_mount_unlooked_at(
        root, tmpfs_beneath: Path) -> None:
    """A file system mounted beneath the root (here a tmpfs; in the field a FUSE or NFS
    mount that may hang) is never looked at on the worker's thread: its names are failed
    with EXDEV (`other_mount`), told apart from a symlink that escapes the root."""
    write_file(tmpfs_beneath / "f", 64 * KiB)
    os.symlink("sub/f", root.path / "link")  # inside the root, onto the other mount
    os.symlink("/etc/passwd", root.path / "escape")
    write_file(root.path / "own", 4 * KiB)
    names = ["sub/f", "sub", "link", "escape", "../outside", "own"]
    batch = Batch(root.fd, names, 4 * KiB, residency=lib.KVP_RES_PAGECACHE)
    got = inspect(lib.KVP_INSPECT_CHECK, batch)
    other, escape = ("failed", "EXDEV"), ("rejected", "EXDEV")
    assert states_of(got[:5]) == [other, other, other, escape, escape]
    assert got[5][0] in ("resident", "cold") and got[5][2] == 4 * KiB
    evicted = inspect(lib.KVP_INSPECT_EVICT_FILE,
                      Batch(root.fd, ["sub/f"], 4 * KiB, residency=lib.KVP_RES_PAGECACHE))
    assert states_of(evicted) == [other]
    # Without openat2 (before Linux 5.6, or refused by a seccomp filter) the component walk
    # stops at the mount too, told by the mount id (/proc) or else the device. The walk
    # follows no symlink: both links are rejected ELOOP there.
    for which in (lib.KVP_FALLBACK_OPENAT2, lib.KVP_FALLBACK_OPENAT2 | lib.KVP_FALLBACK_PROC):
        def walked(which: int = which) -> list[tuple[str, str, int, int, int]]:
            lib.kvp_inspect_force_fallback(which)  # the child's own inspect context
            return inspect(lib.KVP_INSPECT_CHECK, batch)

        child = Child(walked)
        fell_back = child.result(30.0)
        child.reap()
        loop = ["rejected", "ELOOP"]
        assert [g[:2] for g in fell_back[:5]] == [list(other), list(other), loop, loop,
                                                  list(escape)], which
        assert fell_back[5][0] in ("resident", "cold"), which


def test_check_never_asks_a_hung_mount_beneath_the_root(root, hung_beneath: Any) -> None:
    """Issue 23: `check` of one file behind a hung FUSE mount held its worker for good
    (the lookup waited on the server). It is settled at once now, and the server sees no
    request; files of the root itself are looked at as before."""
    write_file(root.path / "own", 4 * KiB)
    names = ["tier/hung/f0", "own", "tier/hung/f1"]
    batch = Batch(root.fd, names, 4 * KiB, residency=lib.KVP_RES_PAGECACHE)
    child = Child(lambda: [inspect(action, batch) for action in (
        lib.KVP_INSPECT_CHECK, lib.KVP_INSPECT_EVICT_HEAD)])
    got = child.result(10.0)
    asked = hung_beneath.stats()
    hung_beneath.release()
    child.reap()
    assert got is not None, f"check was held by the hung mount: {asked}"
    for answers in got:
        assert [g[:2] for g in answers[::2]] == [["failed", "EXDEV"]] * 2
        assert answers[1][0] in ("resident", "cold")
    assert (asked.lookups, asked.getattrs, asked.opens, asked.held_total) == (0, 0, 0, 0), asked
