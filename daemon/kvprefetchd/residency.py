"""Which residency rule each allowed root gets, decided once at start.

Two rules answer "is this head already warm?" before any read (the checks
themselves run in C, native/residency.c):
- tier: st_blocks says whether the file's data is on the near tier. Tiered
  file systems (Storage Scale AFM/HSM, Lustre HSM) leave migrated files as
  stubs with no blocks allocated, and their data cache is not Linux's page
  cache, so cachestat would say "cold" for a file that is in fact near.
- pagecache: cachestat (mincore before 6.5) over exactly the head. On ext4,
  XFS or NFS every file has its blocks, so the tier rule would call
  everything resident and nothing would ever be warmed.
`auto` picks by file system type, read from /proc/self/mountinfo.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvprefetchd.native import load_native

# File systems whose cold files are stubs without allocated blocks (mountinfo's type,
# "fuse.SUBTYPE" for FUSE). fuse.tiersim is the project's slow-tier simulator
# (bench/tiersim), whose st_blocks counts fetched chunks as an HSM stub does. FUSE
# object stores (JuiceFS, gcsfuse, s3fs) are not listed: their st_blocks follows the
# file's size, not what is local, so the tier rule would call every file resident.
TIERED_FILESYSTEMS = frozenset({"gpfs", "lustre", "fuse.tiersim"})


@dataclass(frozen=True)
class RootRule:
    root: str
    fstype: str
    rule: str
    why: str

    @property
    def code(self) -> int:
        """The rule's native code: KVP_RES_<RULE> of native/kvprefetch.h."""
        return load_native().rule_codes[self.rule]


def parse_mountinfo(text: str) -> list[tuple[str, str, str]]:
    """(major:minor, mount point, fs type) per mount; fields per proc(5), '-' separates."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or dash + 1 >= len(fields):
            continue
        mount_point = fields[4].replace("\\040", " ").replace("\\011", "\t")
        mounts.append((fields[2], mount_point, fields[dash + 1]))
    return mounts


def filesystem_type(path: str, mountinfo: str | None = None) -> str:
    """The type of the file system holding path ('unknown' when it cannot be told)."""
    try:
        real = os.path.realpath(path)
        device = os.stat(real).st_dev
    except OSError:
        return "unknown"
    return filesystem_type_of(device, real, mountinfo)


def filesystem_type_of(device: int, path: str, mountinfo: str | None = None) -> str:
    """The type of the file system of `device`, which holds `path`.

    Matched by device number first (exact, and right under bind mounts), then by
    the longest mount point that prefixes the path.
    """
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as handle:
                mountinfo = handle.read()
        except OSError:
            return "unknown"
    mounts = parse_mountinfo(mountinfo)
    real = path
    wanted = f"{os.major(device)}:{os.minor(device)}"
    by_device = [m for m in mounts if m[0] == wanted]
    candidates = by_device or mounts
    best = ""
    fstype = "unknown"
    for _, mount_point, kind in candidates:
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, fstype = mount_point, kind
    if fstype == "unknown" and by_device:
        fstype = by_device[-1][2]
    return fstype


def choose_rule(root: str, configured: str, mountinfo: str | None = None) -> RootRule:
    return rule_of(root, filesystem_type(root, mountinfo), configured)


def rule_for_fd(fd: int, root: str, configured: str) -> RootRule:
    """The rule of a root opened as fd (its device tells the file system, no path walk)."""
    return rule_of(root, filesystem_type_of(os.fstat(fd).st_dev, root), configured)


def rule_of(root: str, fstype: str, configured: str) -> RootRule:
    if configured != "auto":
        return RootRule(root, fstype, configured, "configured")
    if fstype in TIERED_FILESYSTEMS:
        return RootRule(root, fstype, "tier", f"{fstype} keeps cold files as block-less stubs")
    return RootRule(root, fstype, "pagecache", f"{fstype} files are warm when in the page cache")
