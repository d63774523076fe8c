"""A worker's fast path for heads that are warm already (native/probe.c).

Most files a router asks for are resident, and many others are not written yet. Through
the queue each cost a record, a thread hand-off and a Python object each way (~18 us of
a worker's CPU); the probe answers a whole message's share in one call on the worker's
thread (~4 us a file, the syscalls of a confined residency check), and only the files it
cannot call resident or missing go on to the engines, which decide them exactly as
before. It never waits on a file
system: roots on network or FUSE file systems are not probed, nor are names outside the
dentry cache or behind another mount beneath a local root (a FUSE mount in a subdirectory:
the walk stops at its mount point, RESOLVE_NO_XDEV), and a call stops at PROBE_BUDGET_NS
of its thread's CPU or at the first file that was slow because it waited (a file that was
only preempted on a busy host does not stop it: the queue would cost that host more CPU
for the same answer). The probe leaves such names with the rest, untagged: under
RESOLVE_CACHED a mount point and a name outside the dentry cache both say EAGAIN; the
queue's own lookup tells them apart and reads them in its other-mount lane.

Under the page-cache rule the probe opens each file once where it has a root's nodev view
(native/nodev.c: a mount where no open can reach a device), twice where it has not (an
O_PATH open checked, then a read open of that inode). A view that is a copy of the root's
mounts does not see later mounts and unmounts beneath the root; the walk never crosses a
mount point, so that misleads no answer, but the copy keeps an unmounted file system alive:
the worker's loop polls `mounts_fd` and calls `remount` at every change.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvprefetchd.native import Native

log = logging.getLogger(__name__)

# The most CPU one call may spend on the worker's thread (it reads no channel meanwhile):
# ~10,000 resident files here. CPU time, not wall time: on a busy host a preempted call
# did none of that work, and the queue the rest would go to costs more of the same CPU.
PROBE_BUDGET_NS = 50_000_000


class Prober:
    """The probe and what it knows of each root: its fd, rule, and whether it is local
    (the root's own file system: the probe never leaves the root's mount)."""

    def __init__(self, native: Native, root_fds: list[int], rules: list[int], *,
                 check_before_open: bool = False) -> None:
        self._native = native
        self._check_before_open = check_before_open
        ffi, lib = native.ffi, native.lib
        self._prober = ffi.gc(lib.kvp_prober_new(), lib.kvp_prober_free)
        self.works = bool(self._prober != ffi.NULL and lib.kvp_prober_works(self._prober))
        self._roots: Any = ffi.new("struct kvp_probe_root[]", max(1, len(root_fds)))
        self._nroots = len(root_fds)
        self._probed = [False] * len(root_fds)
        self._copied = [False] * len(root_fds)  # the view is a copy of the root's mounts
        self._detached: Any = ffi.new("int32_t *")
        self.mounts_fd = -1 if check_before_open else self._watch_mounts()
        for index in range(len(root_fds)):
            self._roots[index].view = -1
        for index, (fd, rule) in enumerate(zip(root_fds, rules, strict=True)):
            self.set_root(index, fd, rule)
        self._capacity = 0
        self._resident: Any = None
        self._missing: Any = None
        self._rest: Any = None
        self._nmissing: Any = native.ffi.new("size_t *")

    def set_root(self, index: int, fd: int, rule: int) -> None:
        lib = self._native.lib
        root = self._roots[index]
        root.fd, root.residency = fd, rule
        root.local = int(fd >= 0 and lib.kvp_probe_root_local(fd) == 1)
        self._probed[index] = bool(root.local and rule != lib.KVP_RES_OFF)
        self._set_view(index)

    def _set_view(self, index: int) -> None:
        """Make root `index`'s nodev view (again), where the page-cache rule probes."""
        lib, root = self._native.lib, self._roots[index]
        if root.view >= 0:
            os.close(root.view)
        root.view, self._copied[index] = -1, False
        if (self._check_before_open or not self._probed[index]
                or root.residency != lib.KVP_RES_PAGECACHE):
            return
        view = lib.kvp_nodev_view(root.fd, self._detached)
        if view < 0:
            log.debug("root %d: no nodev view (%s); the probe opens each file twice",
                      index, os.strerror(self._native.ffi.errno))
            return
        # A copy that would go stale unwatched is not used.
        if self._detached[0] and self.mounts_fd < 0:
            os.close(view)
            return
        root.view, self._copied[index] = view, bool(self._detached[0])

    @staticmethod
    def _watch_mounts() -> int:
        """/proc/self/mountinfo, which polls POLLPRI when this mount namespace changes."""
        try:
            return os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1

    def remount(self) -> None:
        """The mount table changed: make every copied view again, so that none keeps a
        file system unmounted beneath its root alive."""
        for index, copied in enumerate(self._copied):
            if copied:
                self._set_view(index)

    def view_fd(self, index: int) -> int:
        """Root `index`'s nodev view, beneath which the probe opens each file once; -1:
        none, it opens each file twice."""
        return int(self._roots[index].view)

    def close(self) -> None:
        for index in range(self._nroots):
            if self._roots[index].view >= 0:
                os.close(self._roots[index].view)
                self._roots[index].view = -1
        if self.mounts_fd >= 0:
            os.close(self.mounts_fd)
            self.mounts_fd = -1

    def local(self, index: int) -> bool:
        """Whether root `index` is on a local file system (not network, not FUSE)."""
        return bool(self._roots[index].local)

    @property
    def useful(self) -> bool:
        """Whether any root may be probed at all (else every file goes to the engines)."""
        return self.works and any(self._probed)

    def probe(self, roots: bytes, paths: bytes, count: int,
              read_bytes: int) -> tuple[bytes, list[int], list[int]]:
        """The indexes of the resident files (uint32, native order), of the missing ones,
        and of the rest."""
        ffi, lib = self._native.ffi, self._native.lib
        if count > self._capacity:
            self._capacity = max(count, 1024)
            self._resident = ffi.new("uint32_t[]", self._capacity)
            self._missing = ffi.new("uint32_t[]", self._capacity)
            self._rest = ffi.new("uint32_t[]", self._capacity)
        found = lib.kvp_probe(self._prober, self._roots, self._nroots, paths, len(paths),
                              ffi.from_buffer("uint16_t[]", roots), count, read_bytes,
                              PROBE_BUDGET_NS, self._resident, self._missing, self._nmissing,
                              self._rest)
        missing = self._nmissing[0]
        return (ffi.buffer(self._resident, 4 * found)[:], ffi.unpack(self._missing, missing),
                ffi.unpack(self._rest, count - found - missing))
