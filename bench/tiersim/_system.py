"""What the simulator needs from the machine: FUSE itself, the mount table, fusectl, sysfs.

Kept apart from the simulator's API so that "can FUSE be used here?" has one answer, with
the reason, that tests turn into a skip (or, with KVPREFETCH_REQUIRE_FUSE=1, a failure).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REQUIRE_ENV = "KVPREFETCH_REQUIRE_FUSE"
FUSECTL = Path("/sys/fs/fuse/connections")
MNT_DETACH = 2  # <sys/mount.h>

_libc = ctypes.CDLL(None, use_errno=True)


class FuseUnavailable(RuntimeError):
    """FUSE cannot be used on this machine; the message says why and what would fix it.

    Tests skip on it, except when KVPREFETCH_REQUIRE_FUSE=1 (CI sets it: /dev/fuse exists
    there, so a simulator that cannot mount is a bug to see, not a test to skip).
    """


def fuse_required() -> bool:
    """True where FUSE must work (CI): being unable to mount is then a failure."""
    return os.environ.get(REQUIRE_ENV) == "1"


def check_fuse() -> None:
    """Raise FuseUnavailable unless this process can mount the simulator.

    Root is required: the simulator mounts with allow_other (so a daemon running as another
    user can read it) and the helpers write fusectl and sysfs knobs, all root-only.
    """
    if not sys.platform.startswith("linux"):
        raise FuseUnavailable(f"FUSE simulator needs Linux, not {sys.platform}")
    if os.geteuid() != 0:
        raise FuseUnavailable("the FUSE tier simulator needs root (it mounts with allow_other)")
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        raise FuseUnavailable(f"/dev/fuse cannot be opened ({exc.strerror}): no FUSE in this "
                              "kernel or container") from exc
    for tool in ("gcc", "pkg-config"):
        if shutil.which(tool) is None:
            raise FuseUnavailable(f"{tool} not found: install it (./dev setup does, as root)")


def _unescape(field: str) -> str:
    r"""Mount points in mountinfo escape space, tab, newline and backslash as \ooo."""
    out, i = [], 0
    while i < len(field):
        digits = field[i + 1:i + 4]
        if field[i] == "\\" and len(digits) == 3 and digits.isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts() -> list[tuple[str, str, str]]:
    """(major:minor, mount point, fs type) of every mount, from /proc/self/mountinfo."""
    rows = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            rows.append((fields[2], _unescape(fields[4]), right.split()[0]))
    return rows


def mount_device(mountpoint: Path, fstype: str | None = None) -> str | None:
    """The major:minor of the topmost mount at mountpoint (of this type), or None."""
    found = None
    for device, point, kind in mounts():
        if point == str(mountpoint) and (fstype is None or kind == fstype):
            found = device
    return found


def connection_id(device: str) -> str:
    """The fusectl directory of a FUSE mount: the kernel's dev_t of its superblock.

    fs/fuse/control.c names it "%u" of fc->dev, and the kernel's dev_t is
    major << 20 | minor (include/linux/kdev_t.h MKDEV), not userspace's encoding.
    """
    major, minor = (int(part) for part in device.split(":"))
    return str(major << 20 | minor)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def lazy_unmount(mountpoint: Path) -> None:
    """Detach a mount even while files on it are open (umount2(2) MNT_DETACH)."""
    _check(int(_libc.umount2(os.fsencode(mountpoint), MNT_DETACH)), f"umount {mountpoint}")


@contextmanager
def fusectl() -> Iterator[Path]:
    """The fusectl file system's root, mounted privately for the duration if it isn't.

    It is usually mounted at /sys/fs/fuse/connections by systemd; when it isn't, a private
    mount in a temporary directory is used and removed, so nothing is left behind.
    """
    if any(kind == "fusectl" and point == str(FUSECTL) for _, point, kind in mounts()):
        yield FUSECTL
        return
    where = Path(tempfile.mkdtemp(prefix="tiersim-fusectl-"))
    try:
        _check(int(_libc.mount(b"fusectl", os.fsencode(where), b"fusectl", 0, None)),
               "mount -t fusectl")
        try:
            yield where
        finally:
            lazy_unmount(where)
    finally:
        where.rmdir()


def read_connection(device: str, name: str) -> str:
    """A fusectl file of one connection: max_background, congestion_threshold, waiting."""
    with fusectl() as root:
        return (root / connection_id(device) / name).read_text().strip()


def abort_connection(device: str) -> bool:
    """Abort a FUSE connection: every request fails at once, readers blocked in it included.

    The last resort when the simulator does not exit: writing to fusectl's `abort` ends all
    requests with ECONNABORTED (fs/fuse/control.c fuse_conn_abort_write).
    """
    try:
        with fusectl() as root:
            (root / connection_id(device) / "abort").write_text("1")
        return True
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return False  # the connection is already gone
        raise


def bdi_file(device: str, name: str) -> Path:
    """A knob of the mount's backing device info, e.g. read_ahead_kb (fs/fuse/inode.c
    fuse_bdi_init names the bdi major:minor)."""
    return Path("/sys/class/bdi") / device / name
