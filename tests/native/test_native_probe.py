"""The fast path for warm heads (native/probe.c) on real files and the real page cache.

kvp_probe may only ever say "resident", and only when the root's rule says so; every
other file, and every file it could not look at without waiting, goes to the rest (the
queue then decides it as before).
"""

from __future__ import annotations

import ctypes
import os
import select
import stat
import struct
import subprocess
import time
import weakref
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from native_helpers import Child, KiB, evict, open_root, skip_if_dropped, write_file

from kvprefetchd._native import ffi, lib
from kvprefetchd.native import load_native
from kvprefetchd.worker.probe import Prober

BUDGET = 10**9


def nodev_view(fd: int) -> tuple[int, bool]:
    """kvp_nodev_view of a root: (the view's fd, whether it is a copy of the root's mounts);
    a skip where none can be had (a copy takes CAP_SYS_ADMIN)."""
    detached = ffi.new("int32_t *")
    view = lib.kvp_nodev_view(fd, detached)
    if view < 0:
        pytest.skip(f"no nodev view here: {os.strerror(ffi.errno)}")
    return view, bool(detached[0])


class Probe:
    """kvp_probe over roots (fd, rule). view: each page-cache root through its nodev view
    (one open a file), else the checked way (an O_PATH open, then the /proc reopen)."""

    def __init__(self, roots: list[tuple[int, int]], *, fallback: int = 0,
                 view: bool = False) -> None:
        self.prober = ffi.gc(lib.kvp_prober_new(), lib.kvp_prober_free)
        if fallback:
            lib.kvp_prober_force_fallback(self.prober, fallback)
        self.roots = ffi.new("struct kvp_probe_root[]", len(roots))
        views: list[int] = []
        for slot, (fd, rule) in zip(self.roots, roots, strict=True):
            slot.fd, slot.residency = fd, rule
            slot.local = lib.kvp_probe_root_local(fd)
            slot.view = -1
            if view and fd >= 0 and rule == lib.KVP_RES_PAGECACHE:
                slot.view = nodev_view(fd)[0]
                views.append(slot.view)
        weakref.finalize(self, close_all, views)

    def run(self, files: list[tuple[int, str]], read_bytes: int,
            budget: int = BUDGET, paths: bytes | None = None,
            ) -> tuple[list[int], list[int], list[int]]:
        n = len(files)
        blob = paths if paths is not None else b"".join(
            name.encode() + b"\0" for _, name in files)
        indexes = array("H", [root for root, _ in files]).tobytes()
        found, rest = ffi.new("uint32_t[]", max(n, 1)), ffi.new("uint32_t[]", max(n, 1))
        missing, nmissing = ffi.new("uint32_t[]", max(n, 1)), ffi.new("size_t *")
        k = lib.kvp_probe(self.prober, self.roots, len(self.roots), blob, len(blob),
                          ffi.from_buffer("uint16_t[]", indexes), n, read_bytes, budget,
                          found, missing, nmissing, rest)
        m = nmissing[0]
        return list(found[0:k]), list(missing[0:m]), list(rest[0 : n - k - m])


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def warm(path: Path) -> None:
    with open(path, "rb") as handle:
        handle.read()


IN_OPEN, IN_NONBLOCK = 0x20, 0o4000  # <sys/inotify.h>


@contextmanager
def opens_in(*folders: Path) -> Iterator[list[str]]:
    """The names of the files opened in `folders` during the block (inotify IN_OPEN, which
    an O_PATH open does not raise: fs/open.c do_dentry_open), filled in at its end."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(IN_NONBLOCK)
    if fd < 0:
        pytest.skip(f"no inotify here: {os.strerror(ctypes.get_errno())}")
    names: list[str] = []
    try:
        for folder in folders:
            if libc.inotify_add_watch(fd, str(folder).encode(), IN_OPEN) < 0:
                pytest.skip(f"no inotify watch: {os.strerror(ctypes.get_errno())}")
        yield names
        while True:  # every event is queued by the time the probe's call returned
            try:
                buffer = os.read(fd, 65536)
            except BlockingIOError:
                break
            at = 0
            while at < len(buffer):
                _, _, _, length = struct.unpack_from("iIII", buffer, at)
                names.append(buffer[at + 16:at + 16 + length].rstrip(b"\0").decode())
                at += 16 + length
    finally:
        os.close(fd)


@pytest.fixture
def probe_works() -> None:
    prober = ffi.gc(lib.kvp_prober_new(), lib.kvp_prober_free)
    if not lib.kvp_prober_works(prober):
        pytest.skip("no openat2 with RESOLVE_CACHED or no /proc here")


@pytest.fixture(params=["checked", "view"])
def view(request: pytest.FixtureRequest) -> bool:
    """Each page-cache test both ways: checked (two opens), and through a nodev view."""
    return bool(request.param == "view")


def test_only_resident_heads_are_found_every_other_file_is_left(
        root: Any, probe_works: None, tmp_path: Path, view: bool) -> None:
    if not lib.kvp_probe_root_local(root.fd):
        pytest.skip("the test directory is not on a local file system")
    hot, cold = write_file(root.path / "hot", 64 * KiB), write_file(root.path / "cold", 64 * KiB)
    half = write_file(root.path / "half", 128 * KiB)
    empty = write_file(root.path / "empty", 0)
    (root.path / "dir").mkdir()
    os.mkfifo(root.path / "fifo")
    outside = write_file(tmp_path / "outside", 4 * KiB)
    warm(outside)
    os.symlink(outside, root.path / "escape")
    os.symlink("hot", root.path / "inside")
    # A new symlink's atime is due an update (relatime: its atime is not after its mtime
    # and ctime, all stamped in one coarse clock tick), which a lookup under RESOLVE_CACHED
    # cannot make (pick_link's touch_atime must leave RCU mode): EAGAIN, the queue's. With
    # an atime set after both, the link is followed from the cache like any other.
    now = time.time()
    os.utime(root.path / "inside", (now + 2, now - 2), follow_symlinks=False)
    evict(cold)
    evict(half)
    warm(hot)
    fd = os.open(half, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past the 64 KiB
        os.pread(fd, 64 * KiB, 0)
    finally:
        os.close(fd)
    assert not (root.path / "absent").exists()  # its negative dentry: cached now
    probe = Probe([(root.fd, lib.KVP_RES_PAGECACHE)], view=view)
    names = ["hot", "cold", "half", "empty", "dir", "fifo", "escape", "inside", "absent",
             "../outside", "/etc/passwd", "", "never-looked-up"]
    found, missing, rest = probe.run([(0, name) for name in names], 128 * KiB)
    got = [names[i] for i in found]
    assert set(got) <= {"hot", "empty", "inside"}
    assert set(got) == {"hot", "empty", "inside"} or skip_if_dropped()
    # Missing by the dentry cache's word only: a name never looked up is the queue's.
    assert [names[i] for i in missing] == ["absent"]
    assert sorted(found + missing + rest) == list(range(len(names)))  # each index once
    assert rest == sorted(rest) and found == sorted(found)
    # A shallower head of the half-read file is resident.
    assert probe.run([(0, "half")], 64 * KiB)[0] == [0] or skip_if_dropped()
    assert hot.exists() and empty.exists()


def test_the_tier_rule_goes_by_allocation_not_by_the_page_cache(
        root: Any, probe_works: None) -> None:
    if not lib.kvp_probe_root_local(root.fd):
        pytest.skip("the test directory is not on a local file system")
    written = write_file(root.path / "written", 256 * KiB)
    evict(written)
    with open(root.path / "sparse", "wb") as handle:
        handle.truncate(256 * KiB)  # a stub: its size, no blocks
    probe = Probe([(root.fd, lib.KVP_RES_TIER)])
    assert probe.run([(0, "written"), (0, "sparse")], 64 * KiB) == ([0], [], [1])


def test_roots_the_probe_must_not_touch_are_left_whole(root: Any, probe_works: None) -> None:
    write_file(root.path / "hot", 4 * KiB)
    warm(root.path / "hot")
    proc = open_root(Path("/proc/self"))
    try:
        probe = Probe([(root.fd, lib.KVP_RES_OFF), (-1, lib.KVP_RES_PAGECACHE),
                       (proc, lib.KVP_RES_PAGECACHE)])
        assert lib.kvp_probe_root_local(proc) == 0
        files = [(0, "hot"), (1, "hot"), (2, "status"), (7, "hot")]  # 7: no such root
        assert probe.run(files, 4 * KiB) == ([], [], [0, 1, 2, 3])
    finally:
        os.close(proc)


def test_without_its_kernel_features_the_probe_leaves_everything(
        root: Any, probe_works: None) -> None:
    write_file(root.path / "hot", 4 * KiB)
    warm(root.path / "hot")
    for which in (lib.KVP_FALLBACK_OPENAT2, lib.KVP_FALLBACK_PROC):
        probe = Probe([(root.fd, lib.KVP_RES_PAGECACHE)], fallback=which)
        assert probe.run([(0, "hot")], 4 * KiB) == ([], [], [0])


def test_a_call_stops_at_its_budget_and_at_a_short_buffer(
        root: Any, probe_works: None, view: bool) -> None:
    if not lib.kvp_probe_root_local(root.fd):
        pytest.skip("the test directory is not on a local file system")
    for i in range(5):
        write_file(root.path / f"f{i}", 4 * KiB)
        warm(root.path / f"f{i}")
    probe = Probe([(root.fd, lib.KVP_RES_PAGECACHE)], view=view)
    files = [(0, f"f{i}") for i in range(5)]
    found, _, rest = probe.run(files, 4 * KiB, budget=0)
    assert len(found) <= 1 and sorted(found + rest) == list(range(5))
    # Three names for five files: the last two are left, never read past the buffer.
    found, _, rest = probe.run(files, 4 * KiB, paths=b"f0\0f1\0f2\0")
    assert rest[-2:] == [3, 4] and 3 not in found and 4 not in found


def test_names_outside_the_dentry_cache_are_left_to_the_queue(
        root: Any, probe_works: None, view: bool) -> None:
    if os.geteuid() != 0:
        pytest.skip("dropping the dentry cache needs root")
    if not lib.kvp_probe_root_local(root.fd):
        pytest.skip("the test directory is not on a local file system")
    (root.path / "d").mkdir()
    write_file(root.path / "d" / "f", 4 * KiB)
    assert not (root.path / "d" / "g").exists()
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("2\n")  # dentries and inodes
    probe = Probe([(root.fd, lib.KVP_RES_PAGECACHE)], view=view)
    # Neither the file nor the absent name is known any more: no answer without I/O.
    assert probe.run([(0, "d/f"), (0, "d/g")], 4 * KiB) == ([], [], [0, 1])


def test_names_behind_another_mount_beneath_the_root_are_left_to_the_queue(
        root: Any, probe_works: None, tmpfs_beneath: Path, view: bool) -> None:
    """The root is local; a tmpfs mounted in it is another file system the probe did not
    judge (it might as well be FUSE): its files go to the queue even when resident, and a
    name it says is absent is not `missing` by the probe's word."""
    if not lib.kvp_probe_root_local(root.fd):
        pytest.skip("the test directory is not on a local file system")
    write_file(root.path / "hot", 4 * KiB)
    warm(root.path / "hot")
    write_file(tmpfs_beneath / "f", 4 * KiB)  # tmpfs: resident for as long as it exists
    os.symlink("sub/f", root.path / "link")
    assert not (tmpfs_beneath / "absent").exists()  # a negative dentry, on the tmpfs
    probe = Probe([(root.fd, lib.KVP_RES_PAGECACHE)], view=view)
    names = ["hot", "sub/f", "sub", "link", "sub/absent"]
    found, missing, rest = probe.run([(0, name) for name in names], 4 * KiB)
    assert (missing, rest) == ([], [1, 2, 3, 4])
    assert found == [0] or skip_if_dropped()


def test_a_hung_fuse_mount_beneath_the_root_is_never_asked(
        root: Any, probe_works: None, hung_beneath: Any, view: bool) -> None:
    """Issue 23: a FUSE server hung in a subdirectory of a local root held the worker's
    thread in the probe's reopen (GETATTR from FUSE's permission check). The walk stops at
    the mount point now: the files go to the queue and the server sees no request at all."""
    if not lib.kvp_probe_root_local(root.fd):
        pytest.skip("the test directory is not on a local file system")
    write_file(root.path / "hot", 4 * KiB)
    warm(root.path / "hot")
    probe = Probe([(root.fd, lib.KVP_RES_PAGECACHE)], view=view)
    names = ["tier/hung/f0", "hot", "tier/hung/f1", "tier", "tier/hung"]
    child = Child(lambda: probe.run([(0, name) for name in names], 4 * KiB))
    got = child.result(10.0)
    asked = hung_beneath.stats()
    hung_beneath.release()
    child.reap()
    assert got is not None, f"the probe was held by the hung mount: {asked}"
    found, missing, rest = got
    assert (missing, rest) == ([], [0, 2, 3, 4])
    assert found == [1] or skip_if_dropped()
    assert (asked.lookups, asked.getattrs, asked.opens, asked.held_total) == (0, 0, 0, 0), asked


def special_files(root: Any, outside: Path) -> list[str]:
    """A resident regular file "hot" and, beneath the root, what must not be read: a FIFO,
    a character device like /dev/null (mknod needs CAP_MKNOD), links to both, and a link
    to a resident file outside the root. Every dentry cached; the names."""
    hot = write_file(root.path / "hot", 4 * KiB)
    os.mkfifo(root.path / "fifo")
    os.symlink("fifo", root.path / "to-fifo")
    names = ["hot", "fifo", "to-fifo", "escape"]
    if os.geteuid() == 0:
        os.mknod(root.path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.symlink("null", root.path / "to-null")
        names += ["null", "to-null"]
    outside.mkdir()
    warm(write_file(outside / "file", 4 * KiB))
    os.symlink(outside / "file", root.path / "escape")
    now = time.time()  # the links' atimes set, so RESOLVE_CACHED may follow them (above)
    for name in ("to-fifo", "escape", *(["to-null"] if "null" in names else [])):
        os.utime(root.path / name, (now + 2, now - 2), follow_symlinks=False)
    for name in names:
        os.stat(root.path / name, follow_symlinks=False)  # every dentry cached
    warm(hot)
    return names


def test_nothing_but_a_regular_file_beneath_the_root_is_ever_opened_for_reading(
        root: Any, probe_works: None, tmp_path: Path) -> None:
    """The checked way reopens for reading (for cachestat) only the regular file its statx
    checked: never a FIFO (opening one for reading wakes its writers), a device (its
    driver's open may act), nor what a symlink points at outside the root."""
    if not lib.kvp_probe_root_local(root.fd):
        pytest.skip("the test directory is not on a local file system")
    names = special_files(root, tmp_path / "outside")
    probe = Probe([(root.fd, lib.KVP_RES_PAGECACHE)])
    with opens_in(root.path, tmp_path / "outside") as opened:
        found, missing, rest = probe.run([(0, name) for name in names], 4 * KiB)
    assert opened == ["hot"]  # reopened for cachestat, resident or not; nothing else
    assert found == [0] or skip_if_dropped()
    assert (missing, rest) == ([], list(range(1, len(names))))


def test_through_a_nodev_view_no_device_is_ever_opened(
        root: Any, probe_works: None, tmp_path: Path) -> None:
    """Through the root's nodev view the probe opens first and checks after, and the
    kernel refuses every device before its driver runs (EACCES). A FIFO is opened without
    waiting (O_NONBLOCK) and closed unread; nothing outside the root is opened."""
    if not lib.kvp_probe_root_local(root.fd):
        pytest.skip("the test directory is not on a local file system")
    names = special_files(root, tmp_path / "outside")
    probe = Probe([(root.fd, lib.KVP_RES_PAGECACHE)], view=True)
    with opens_in(root.path, tmp_path / "outside") as opened:
        found, missing, rest = probe.run([(0, name) for name in names], 4 * KiB)
    assert "hot" in opened and set(opened) <= {"hot", "fifo"}, opened
    assert found == [0] or skip_if_dropped()
    assert (missing, rest) == ([], list(range(1, len(names))))


def test_a_nodev_view_is_the_roots_files_on_a_mount_that_opens_no_device(root: Any) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod needs CAP_MKNOD")
    write_file(root.path / "f", 4 * KiB)
    os.mknod(root.path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    view, copied = nodev_view(root.fd)
    try:
        assert os.fstatvfs(view).f_flag & os.ST_NODEV
        assert copied == (not os.fstatvfs(root.fd).f_flag & os.ST_NODEV)
        fd = os.open("f", os.O_RDONLY, dir_fd=view)
        try:
            assert os.fstat(fd).st_ino == os.stat(root.path / "f").st_ino
        finally:
            os.close(fd)
        with pytest.raises(PermissionError):
            os.open("null", os.O_RDONLY, dir_fd=view)
        os.close(os.open(root.path / "null", os.O_RDONLY))  # the root's own mount opens it
    finally:
        os.close(view)


def test_a_copied_view_lets_go_of_what_is_unmounted_once_made_again(
        root: Any, probe_works: None, tmpfs_beneath: Path) -> None:
    """A copy of the root's mounts keeps a file system unmounted beneath the root alive
    (its blocks, its server's connection) for as long as the copy exists. The worker's
    Prober makes its copies again when /proc/self/mountinfo polls POLLPRI; this is that,
    in kvprefetchd.worker.probe. A name beneath any mount point, in the copy or not, is
    never answered by the probe: the dentry is flagged mounted, and the walk under
    RESOLVE_NO_XDEV | RESOLVE_CACHED stops there (EAGAIN), so a stale copy cannot say
    "missing" or "resident" of what a newer mount covers."""
    if not lib.kvp_probe_root_local(root.fd):
        pytest.skip("the test directory is not on a local file system")
    write_file(tmpfs_beneath / "f", 4 * KiB)
    prober = Prober(load_native(), [root.fd], [lib.KVP_RES_PAGECACHE])
    try:
        if prober.view_fd(0) < 0 or os.fstatvfs(root.fd).f_flag & os.ST_NODEV:
            pytest.skip("no copied view here (it takes CAP_SYS_ADMIN; a nodev root needs none)")
        roots = array("H", [0]).tobytes()
        assert prober.probe(roots, b"sub/f\0", 1, 4 * KiB) == (b"", [], [0])  # the queue's
        watch = select.poll()
        watch.register(prober.mounts_fd, select.POLLPRI)
        assert watch.poll(0) == []
        subprocess.run(["umount", str(tmpfs_beneath)], check=True)
        assert not (tmpfs_beneath / "f").exists()
        view = prober.view_fd(0)
        assert os.stat("sub/f", dir_fd=view).st_size == 4 * KiB  # kept alive by the copy
        assert [event & select.POLLPRI for _, event in watch.poll(0)] == [select.POLLPRI]
        prober.remount()
        with pytest.raises(FileNotFoundError):
            os.stat("sub/f", dir_fd=prober.view_fd(0))
    finally:
        prober.close()


def test_a_prober_made_before_a_fork_reopens_through_the_childs_own_fds(
        root: Any, probe_works: None, view: bool) -> None:
    """The prober holds /proc/self/fd of the process that made it. In a child forked
    after, that is the parent's fd table: the child's O_PATH fd N reopened through it
    would be the parent's fd N. Child's pipe makes it bite: the child's first free fd is
    the number of the parent's read end of the result pipe."""
    if not lib.kvp_probe_root_local(root.fd):
        pytest.skip("the test directory is not on a local file system")
    hot = write_file(root.path / "hot", 4 * KiB)
    warm(hot)
    probe = Probe([(root.fd, lib.KVP_RES_PAGECACHE)], view=view)
    child = Child(lambda: probe.run([(0, "hot")], 4 * KiB))
    got = child.result(30.0)
    child.reap()
    assert got is not None
    assert got == [[0], [], []] or skip_if_dropped()
