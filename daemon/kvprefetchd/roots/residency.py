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
`auto` picks by file system type, read from /proc/self/mountinfo, through the type's
tier profile (tiers.py), which also says how much of a file to warm and how a warm-up
survives to the consumer; FUSE object stores get `off` there (every check would open the
file, which costs round trips and, without keep_cache, drops the very pages it looks at).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvprefetchd.native import load_native
from kvprefetchd.roots.tiers import (
    FUSE_DEFAULT_MAX_BACKGROUND,
    MountFacts,
    TierProfile,
    fs_cache_dir,
    mount_facts,
    profile_for,
    warm_extent,
)

# File systems whose cold files are stubs without allocated blocks (mountinfo's type,
# "fuse.SUBTYPE" for FUSE): the profiles whose residency is `tier` (tiers.py). FUSE
# object stores (JuiceFS, gcsfuse, s3fs) are not: their st_blocks follows the file's
# size, not what is local, so the tier rule would call every file resident.
TIERED_FILESYSTEMS = frozenset({"gpfs", "lustre", "fuse.tiersim"})

# File systems whose first read of a file may wait 10-200 ms on a server or a remote
# tier: their roots start at NETWORK_START_DEPTH reads in flight (all workers together),
# not at initial_depth, which on a 100 ms tier cost the first burst after a start
# several round trips of ramp (issue 25).
NETWORK_FILESYSTEMS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "ceph",
                                 "beegfs", "9p"})
NETWORK_START_DEPTH = 256


@dataclass(frozen=True)
class RootRule:
    root: str
    fstype: str
    name: str  # the rule: pagecache, tier or off (its native enum: code)
    why: str
    profile: TierProfile = field(default_factory=lambda: profile_for("unknown"))
    extent: str = "head"  # head or whole (tiers.warm_extent)
    facts: MountFacts = field(default_factory=MountFacts)
    mount_point: str = ""
    fs_cache: str = ""  # the file system's disk copy of the root, a glob (tiers.fs_cache_dir)

    @property
    def keep(self) -> str:
        """How a warm-up survives to the consumer (tiers.KEEPS)."""
        return self.profile.keep

    @property
    def start_depth(self) -> int:
        """Reads in flight this root starts at, all workers together, trusted so that a
        slow tier's first burst pays no ramp (native/depthctl.c checks it against what
        the tier serves): a FUSE connection's max_background (the kernel's default, 12,
        when fusectl is not mounted to say), past which reads wait in the kernel; a
        network file system's NETWORK_START_DEPTH; 0 on a local one (initial_depth, and
        the depth controller finds the rest: a local read takes microseconds)."""
        if self.fstype.startswith("fuse"):
            return self.facts.max_background or FUSE_DEFAULT_MAX_BACKGROUND
        return NETWORK_START_DEPTH if self.fstype in NETWORK_FILESYSTEMS else 0

    @property
    def gauge(self) -> str:
        """The FUSE connection's fusectl directory, whose `waiting` counts the requests
        not answered yet, every reader's: admission judges by it where the tier keeps
        one (native/gauge.c). "" on other file systems; named even when fusectl is not
        mounted (the worker's open then fails, and the root goes on without)."""
        return self.facts.connection if self.fstype.startswith("fuse") else ""

    @property
    def hold(self) -> bool:
        return self.profile.hold

    @property
    def whole(self) -> bool:
        return self.extent == "whole"

    @property
    def code(self) -> int:
        """The rule's native code: KVP_RES_<RULE> of native/kvprefetch.h."""
        return load_native().rule_codes[self.name]


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
    """The type of the file system of `device`, which holds `path`."""
    return mount_of(device, path, mountinfo)[0]


def mount_of(device: int, path: str, mountinfo: str | None = None) -> tuple[str, str]:
    """(type, mount point) of the file system of `device`, which holds `path`.

    Matched by device number first (exact, and right under bind mounts), then by
    the longest mount point that prefixes the path.
    """
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as handle:
                mountinfo = handle.read()
        except OSError:
            return "unknown", ""
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
        best, fstype = by_device[-1][1], by_device[-1][2]
    return fstype, best


def choose_rule(root: str, configured: str, mountinfo: str | None = None) -> RootRule:
    return rule_of(root, filesystem_type(root, mountinfo), configured)


def rule_for_fd(fd: int, root: str, configured: str, extent: str = "auto") -> RootRule:
    """The rule of a root opened as fd (its device tells the file system, no path walk),
    with its tier profile refined by the mount's facts (a FUSE server's options)."""
    device = os.fstat(fd).st_dev
    fstype, mount_point = mount_of(device, root)
    facts = mount_facts(mount_point, device, fstype) if mount_point else MountFacts()
    return rule_of(root, fstype, configured, extent, facts, mount_point,
                   fs_cache_dir(fstype, facts, root, mount_point))


def rule_of(root: str, fstype: str, configured: str, extent: str = "auto",
            facts: MountFacts | None = None, mount_point: str = "",
            fs_cache: str = "") -> RootRule:
    profile = profile_for(fstype, facts)

    def rule(name: str, why: str) -> RootRule:
        return RootRule(root, fstype, name, why, profile, warm_extent(profile, extent),
                        facts or MountFacts(), mount_point, fs_cache)

    if configured != "auto":
        return rule(configured, "configured")
    if profile.residency == "tier":
        return rule("tier", f"{fstype} keeps cold files as block-less stubs")
    if profile.residency == "off":
        return rule("off", f"{fstype}: a residency check would open the file (round trips; "
                    "a FUSE file system may drop cached pages at open)")
    return rule("pagecache", f"{fstype} files are warm when in the page cache")
