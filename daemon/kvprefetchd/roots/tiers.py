"""Tier profiles: what warming means on each kind of file system, decided per root.

A warm-up helps only if the consumer, opening the file a few hundred ms later in another
process, finds what the warmer fetched. Where that is differs by file system, and some
defeat a warmer outright: a FUSE file system that does not set keep_cache has the kernel
drop a file's cached pages at every open (fs/fuse/file.c, fuse_finish_open), so whatever
a reader left in the page cache is gone when the consumer opens it. s3fs without
`kernel_cache` is one (measured here: `read 500` and a consumer as slow as cold); there,
s3fs keeps a file's data only while someone has it open, so the warm-up that reaches
the consumer is holding the file open until the consumer has opened it (holds.py).

Each profile says, for a file-system type (mountinfo's, `fuse.SUBTYPE` for FUSE):
- near: where the near tier is (the page cache, the file system's own disk cache, the
  file system's memory while the file is open, the tier's own disk);
- promotes: what a read brings near (the range read, a chunk, the whole file);
- extent: what to read to warm a file for a consumer that reads it whole (`head`
  where a head read recalls the file, `whole` where only what is read comes near);
- residency: the rule that says "already warm" cheaply (residency.py);
- keep: how a warm-up survives to the consumer: `pagecache` (the page cache outlives
  the warmer's close), `hold` (kept open: holds.py), `fs_cache` (the file system's disk
  cache keeps it), or `probe` (unknown: the worker warms a file, reopens it and looks).
Mount options refine a profile where the FUSE server's command line shows them (s3fs
`kernel_cache` / `use_cache`, rclone `--vfs-cache-mode`). docs/tiers.md has the table
with the source of each fact.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

WARM_EXTENTS = ("auto", "head", "whole")
KEEPS = ("pagecache", "hold", "fs_cache", "probe")
# A read_bytes that covers any file: the queue reads [0, min(st_size, read_bytes)).
WHOLE_FILE = 1 << 40
FUSECTL = "/sys/fs/fuse/connections"
# The kernel's default max_background for a FUSE connection (fs/fuse/inode.c,
# FUSE_DEFAULT_MAX_BACKGROUND): background reads in flight on one mount, whatever the
# warmer does, unless the file system raises it.
FUSE_DEFAULT_MAX_BACKGROUND = 12


@dataclass(frozen=True)
class TierProfile:
    fstype: str
    near: str
    promotes: str
    extent: str
    residency: str
    keep: str
    fix: str = ""  # how to make warming work where this profile defeats it
    source: str = ""
    # Hold warmed files open until their consumer opens them (holds.py): where the file
    # system keeps data only while a file is open (keep = "hold"), and where holding
    # spares the consumer's open a fetch all the same (s3fs with a cache too).
    hold: bool = False


def _local(fstype: str) -> TierProfile:
    return TierProfile(fstype, "page cache", "the range read (plus readahead)", "head",
                       "pagecache", "pagecache", source="Linux page cache")


_OBJECT_FIX = ("the consumer reads the whole object: set warm_extent = \"whole\" (the "
               "profile's default) so the warm-up fetches what it will read")

PROFILES: Mapping[str, TierProfile] = {
    **{kind: _local(kind) for kind in ("ext4", "xfs", "btrfs", "tmpfs", "zfs", "f2fs")},
    "nfs": TierProfile(
        "nfs", "page cache", "the range read (plus readahead)", "head", "pagecache",
        "pagecache", source="nfs(5): close-to-open consistency revalidates attributes at "
        "open and keeps cached data while the file is unchanged"),
    "nfs4": TierProfile(
        "nfs4", "page cache", "the range read (plus readahead)", "head", "pagecache",
        "pagecache", source="nfs(5), as nfs"),
    "lustre": TierProfile(
        "lustre", "OSTs (HSM restore)", "the whole file (an HSM restore on first access)",
        "head", "tier", "pagecache",
        source="Lustre manual, HSM: a released file is restored whole on first access; "
        "a released file has no blocks (st_blocks)"),
    "gpfs": TierProfile(
        "gpfs", "the cache fileset (AFM) / disk pool (HSM)",
        "the whole file (AFM fetch or HSM recall on read)", "head", "tier", "pagecache",
        source="IBM Storage Scale AFM and TSM/HSM docs: an uncached or migrated file is "
        "fetched or recalled on read; a stub has no blocks"),
    "fuse.tiersim": TierProfile(
        "fuse.tiersim", "page cache (keep_cache)", "the chunks read", "head", "tier",
        "pagecache", source="bench/tiersim (this project's simulator): st_blocks counts "
        "fetched chunks"),
    "fuse.s3fs": TierProfile(
        "fuse.s3fs", "s3fs's temporary copy while the file is open",
        "the whole object on first read", "whole", "off", "hold",
        fix="mount with -o kernel_cache (the page cache then survives opens) or "
        "-o use_cache=DIR (a disk cache); without either the daemon holds warmed files "
        "open until their consumer opens them",
        source="s3fs-fuse man page (kernel_cache, use_cache); measured here with s3fs "
        "1.90 (bench/realtier.py): page cache dropped at each open, data kept while open",
        hold=True),
    "fuse.rclone": TierProfile(
        "fuse.rclone", "rclone's VFS cache (--vfs-cache-mode full) or none",
        "the chunks read (--vfs-read-chunk-size)", "whole", "off", "probe",
        fix="mount with --vfs-cache-mode full (a disk cache that outlives opens)",
        source="rclone mount docs, VFS File Caching; measured here with rclone 1.60 "
        "(bench/realtier.py)"),
    "fuse.juicefs": TierProfile(
        "fuse.juicefs", "JuiceFS's local block cache (--cache-dir) and the page cache",
        "the 4 MiB blocks read (plus prefetch)", "whole", "off", "probe",
        source="JuiceFS docs, cache: local block cache; page cache kept for unchanged "
        "files (not measured here)"),
    "fuse.gcsfuse": TierProfile(
        "fuse.gcsfuse", "gcsfuse's file cache (file-cache:max-size-mb) when enabled",
        "the whole object into the file cache, else the range read", "whole", "off",
        "probe", fix="enable the file cache (--file-cache-max-size-mb, "
        "cache-file-for-range-read) so a warm-up lands on local disk",
        source="gcsfuse docs, file caching (not measured here)"),
    "fuse.mountpoint-s3": TierProfile(
        "fuse.mountpoint-s3", "Mountpoint's local cache (--cache DIR) when enabled",
        "the ranges read (prefetched parts)", "whole", "off", "probe",
        fix="mount with --cache DIR (and --metadata-ttl) so reads outlive the reader",
        source="mountpoint-s3 docs, caching configuration (not measured here)"),
    "fuse.blobfuse2": TierProfile(
        "fuse.blobfuse2", "blobfuse2's file_cache (local disk) or block_cache",
        "the whole blob at open (file_cache), blocks (block_cache)", "whole", "off",
        "probe", source="blobfuse2 docs, file_cache and block_cache (not measured here)"),
    "fuse.geesefs": TierProfile(
        "fuse.geesefs", "GeeseFS's memory and disk cache", "the ranges read (readahead)",
        "whole", "off", "probe", source="GeeseFS README, caching (not measured here)"),
    "fuse.goofys": TierProfile(
        "fuse.goofys", "none (catfs if configured)", "the ranges read", "whole", "off",
        "probe", fix="goofys caches nothing itself: add catfs (--cache)",
        source="goofys README (not measured here)"),
    "fuse.alluxio-fuse": TierProfile(
        "fuse.alluxio-fuse", "Alluxio workers' cache", "the blocks read", "whole", "off",
        "probe", source="Alluxio FUSE docs (not measured here)"),
}

UNKNOWN_FUSE = TierProfile(
    "fuse", "unknown (a FUSE file system without a profile)", "unknown", "head", "pagecache",
    "probe", fix="tell us its type: a profile says what a warm-up must read and keep",
    source="FUSE: the kernel drops cached pages at open unless keep_cache is set")
UNKNOWN = TierProfile("unknown", "page cache", "the range read", "head", "pagecache",
                      "pagecache", source="assumed: a local file system")


@dataclass(frozen=True)
class MountFacts:
    """What can be learnt of a mount beyond its type: the FUSE server's options (from its
    command line, when it runs in this pid namespace) and the FUSE connection's limits."""

    server: str = ""  # the FUSE server's command, "" when not found
    options: Mapping[str, str] = field(default_factory=dict)
    positional: tuple[str, ...] = ()
    max_background: int = 0  # 0: not known (fusectl not mounted, or not FUSE)
    congestion_threshold: int = 0
    connection: str = ""  # /sys/fs/fuse/connections/N (FUSE), whether mounted or not
    device: str = ""  # major:minor
    read_ahead_kb: int = -1  # the backing device's readahead (-1: not known)


def profile_for(fstype: str, facts: MountFacts | None = None) -> TierProfile:
    """The profile of a file-system type, refined by what its mount's facts show."""
    profile = PROFILES.get(fstype)
    if profile is None:
        if fstype == "fuse" or fstype.startswith(("fuse.", "fuseblk")):
            profile = replace(UNKNOWN_FUSE, fstype=fstype)
        else:
            profile = replace(UNKNOWN, fstype=fstype) if fstype != "unknown" else UNKNOWN
    if facts is None or not facts.server:
        return profile
    options = facts.options
    if fstype == "fuse.s3fs":
        # Held open all the same: an open file keeps s3fs's attributes and its inode (and
        # so the pages kernel_cache keeps: a forgotten inode comes back empty).
        if "kernel_cache" in options:
            return replace(profile, near="page cache (kernel_cache)", keep="pagecache",
                           residency="pagecache", fix="")
        if options.get("use_cache"):
            return replace(profile, near=f"s3fs's disk cache ({options['use_cache']})",
                           keep="fs_cache", fix="")
    if fstype == "fuse.rclone":
        mode = options.get("vfs-cache-mode", "off")
        if mode == "full":
            return replace(profile, near="rclone's VFS disk cache (--vfs-cache-mode full)",
                           keep="fs_cache", fix="")
        return replace(profile, near=f"none (--vfs-cache-mode {mode})")
    return profile


def fs_cache_dir(fstype: str, facts: MountFacts, root: str, mount_point: str) -> str:
    """Where the file system keeps its disk copy of the root's files, as a glob pattern
    ("" when it keeps none, or it cannot be told): s3fs `use_cache=DIR` keeps
    DIR/BUCKET/path, rclone `--cache-dir DIR` keeps DIR/vfs/REMOTE/path, REMOTE spelt
    `:s3{hash}` for an on-the-fly remote (a pattern: rclone makes the directory at its
    first read). A stat there says what is on the near tier without opening the file on
    the mount (fscache.py)."""
    options, positional = facts.options, facts.positional
    if fstype == "fuse.s3fs" and options.get("use_cache") and positional:
        bucket = positional[0].partition(":")[0]
        base = os.path.join(glob.escape(options["use_cache"]), glob.escape(bucket))
    elif (fstype == "fuse.rclone" and options.get("vfs-cache-mode") == "full"
          and options.get("cache-dir") and positional):
        spec = positional[1] if positional[0] == "mount" and len(positional) > 1 \
            else positional[0]
        colon = ":" if spec.startswith(":") else ""
        remote, _, path = spec[len(colon):].partition(":")
        remote = glob.escape(colon + remote)
        base = os.path.join(glob.escape(options["cache-dir"]), "vfs",
                            f"{remote}{{*}}" if colon else remote, glob.escape(path.strip("/")))
    else:
        return ""
    inside = os.path.relpath(root, mount_point) if mount_point else "."
    return os.path.normpath(os.path.join(base, glob.escape(inside)))


def warm_extent(profile: TierProfile, configured: str) -> str:
    return profile.extent if configured == "auto" else configured


def mount_facts(mount_point: str, device: int, fstype: str,
                proc: str = "/proc") -> MountFacts:
    """The facts of a mount: the device's readahead, and a FUSE server's options and
    connection limits."""
    number = f"{os.major(device)}:{os.minor(device)}"
    read_ahead = _read_int(f"/sys/class/bdi/{number}/read_ahead_kb", -1)
    if not fstype.startswith("fuse"):
        return MountFacts(device=number, read_ahead_kb=read_ahead)
    connection = os.path.join(FUSECTL, str(os.minor(device)))
    limits = fuse_limits(connection)
    server, options, positional = fuse_server(mount_point, proc)
    return MountFacts(server, options, positional, limits[0], limits[1], connection, number,
                      read_ahead)


def fuse_limits(connection: str) -> tuple[int, int]:
    """(max_background, congestion_threshold) of a FUSE connection; 0s when fusectl is
    not mounted (mount -t fusectl none /sys/fs/fuse/connections)."""
    return (_read_int(os.path.join(connection, "max_background")),
            _read_int(os.path.join(connection, "congestion_threshold")))


def fuse_server(mount_point: str, proc: str = "/proc",
                ) -> tuple[str, dict[str, str], tuple[str, ...]]:
    """The command, options and positional arguments of the process serving a FUSE
    mount: one whose command line names the mount point and that holds /dev/fuse open.
    Other processes name it too: this daemon itself (`--root /mnt/s3`), a shell, a
    router; taking the first by pid took this daemon's own command line for the server's
    whenever pids had wrapped (the s3fs profile then lost `kernel_cache`). Where a
    process's fds cannot be looked at (another user's, unprivileged), the first such
    process outside this one's session stands in. ("", {}, ()) when none in this pid
    namespace names it (a FUSE server in another container)."""
    wanted = mount_point
    try:
        pids = sorted((name for name in os.listdir(proc) if name.isdigit()), key=int)
    except OSError:
        return "", {}, ()
    own_session = os.getsid(0)
    stand_in: tuple[str, dict[str, str], tuple[str, ...]] | None = None
    for pid in pids:
        try:
            with open(os.path.join(proc, pid, "cmdline"), "rb") as handle:
                raw = handle.read(65536)
        except OSError:
            continue
        argv = [arg.decode("utf-8", "replace") for arg in raw.split(b"\0") if arg]
        if len(argv) < 2 or not any(_same_path(arg, wanted) for arg in argv[1:]):
            continue
        serves = _holds_dev_fuse(os.path.join(proc, pid))
        if serves is False:
            continue
        options, positional = parse_command_line(argv[1:])
        found = (os.path.basename(argv[0]), options, tuple(positional))
        if serves:
            return found
        if stand_in is None and _session(os.path.join(proc, pid)) != own_session:
            stand_in = found
    return stand_in or ("", {}, ())


def _holds_dev_fuse(process: str) -> bool | None:
    """Whether the process has /dev/fuse open (None: its fds cannot be looked at)."""
    fds = os.path.join(process, "fd")
    try:
        names = os.listdir(fds)
    except OSError:
        return None
    for name in names:
        try:
            if os.readlink(os.path.join(fds, name)) == "/dev/fuse":
                return True
        except OSError:
            continue  # closed meanwhile
    return False


def _session(process: str) -> int:
    """The process's session id from its stat (-1: not known)."""
    try:
        with open(os.path.join(process, "stat"), "rb") as handle:
            fields = handle.read(4096).rpartition(b")")[2].split()
        return int(fields[3])
    except (OSError, IndexError, ValueError):
        return -1


# Long flags that take a value in the next argument (rclone's, of those a profile reads or
# that would otherwise be taken for a boolean followed by a positional argument).
VALUE_FLAGS = frozenset({
    "vfs-cache-mode", "cache-dir", "vfs-cache-max-age", "vfs-cache-max-size",
    "vfs-read-chunk-size", "vfs-read-ahead", "buffer-size", "dir-cache-time", "config",
    "log-file", "log-level", "uid", "gid", "umask", "attr-timeout", "poll-interval",
    "max-read-ahead", "s3-endpoint", "s3-provider",
})


def parse_command_line(args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """`-o a,b=c` / `-oa` (mount(8) style, s3fs) and `--name value` / `--name=value`
    (rclone) into one map; the rest positional."""
    options: dict[str, str] = {}
    positional: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "-o" and index + 1 < len(args):
            _mount_options(args[index + 1], options)
            index += 2
            continue
        if arg.startswith("-o") and len(arg) > 2:
            _mount_options(arg[2:], options)
        elif arg.startswith("--"):
            name, equals, value = arg[2:].partition("=")
            if not equals and name in VALUE_FLAGS and index + 1 < len(args):
                value = args[index + 1]
                index += 1
            options[name] = value
        elif not arg.startswith("-"):
            positional.append(arg)
        index += 1
    return options, positional


def _mount_options(text: str, into: dict[str, str]) -> None:
    for item in text.split(","):
        name, _, value = item.partition("=")
        if name:
            into[name] = value


def _same_path(arg: str, wanted: str) -> bool:
    """Compared as spelt: resolving another process's arguments could walk a hung mount."""
    return arg.startswith("/") and arg.rstrip("/") == wanted.rstrip("/")


def _read_int(path: str, missing: int = 0) -> int:
    try:
        with open(path) as handle:
            return int(handle.read().strip() or missing)
    except (OSError, ValueError):
        return missing
