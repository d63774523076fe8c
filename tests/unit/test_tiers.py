"""Tier profiles: a FUSE server's command line read as the daemon reads it, and what each
mount's options make of its profile (tiers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvprefetchd.roots.residency import rule_of
from kvprefetchd.roots.tiers import (
    PROFILES,
    MountFacts,
    fs_cache_dir,
    fuse_server,
    parse_command_line,
    profile_for,
    warm_extent,
)

S3FS = ["kvcache", "/mnt/s3", "-f", "-o", "ro,allow_other,url=http://127.0.0.1:9000"]
RCLONE = ["mount", ":s3:kvcache", "/mnt/rc", "--read-only", "--allow-other",
          "--vfs-cache-mode", "full", "--cache-dir", "/var/cache/rc"]


def facts(server: str, args: list[str]) -> MountFacts:
    options, positional = parse_command_line(args)
    return MountFacts(server, options, tuple(positional))


def test_mount_options_and_long_flags_are_read_as_their_programs_read_them() -> None:
    options, positional = parse_command_line([*S3FS, "-okernel_cache", "-o", "use_cache=/c"])
    assert positional == ["kvcache", "/mnt/s3"]
    assert options["url"] == "http://127.0.0.1:9000"
    assert options["kernel_cache"] == "" and options["use_cache"] == "/c"
    options, positional = parse_command_line([*RCLONE, "--vfs-read-ahead=64M"])
    # A boolean flag does not swallow the positional argument after it.
    assert positional == ["mount", ":s3:kvcache", "/mnt/rc"]
    assert options["vfs-cache-mode"] == "full" and options["read-only"] == ""
    assert options["vfs-read-ahead"] == "64M"


def test_s3fs_holds_files_open_in_every_configuration_and_keeps_by_its_options() -> None:
    plain = profile_for("fuse.s3fs", facts("s3fs", S3FS))
    assert (plain.keep, plain.hold, plain.extent, plain.residency) == ("hold", True, "whole",
                                                                       "off")
    kernel = profile_for("fuse.s3fs", facts("s3fs", [*S3FS, "-o", "kernel_cache"]))
    assert (kernel.keep, kernel.hold, kernel.residency) == ("pagecache", True, "pagecache")
    cached = profile_for("fuse.s3fs", facts("s3fs", [*S3FS, "-o", "use_cache=/c"]))
    assert (cached.keep, cached.hold) == ("fs_cache", True)
    # A server not found (another container): the type's own profile.
    assert profile_for("fuse.s3fs", MountFacts()).keep == "hold"


def test_rclone_keeps_in_its_disk_cache_only_with_full_cache_mode() -> None:
    assert profile_for("fuse.rclone", facts("rclone", RCLONE)).keep == "fs_cache"
    off = [a if a != "full" else "off" for a in RCLONE]
    assert profile_for("fuse.rclone", facts("rclone", off)).keep == "probe"


def test_every_listed_type_has_a_source_and_an_unknown_fuse_type_is_probed() -> None:
    for name in ("fuse.s3fs", "fuse.rclone", "fuse.juicefs", "fuse.gcsfuse",
                 "fuse.mountpoint-s3", "fuse.blobfuse2", "fuse.geesefs", "fuse.goofys",
                 "fuse.alluxio-fuse", "nfs", "nfs4", "lustre", "gpfs", "ext4", "xfs"):
        assert PROFILES[name].source, name
    unknown = profile_for("fuse.somethingnew")
    assert (unknown.fstype, unknown.keep, unknown.extent) == ("fuse.somethingnew", "probe",
                                                              "head")
    assert profile_for("ext4").keep == "pagecache"


def test_the_disk_cache_of_a_root_is_found_beneath_the_mount() -> None:
    s3fs = facts("s3fs", [*S3FS, "-o", "use_cache=/var/cache/s3fs"])
    assert fs_cache_dir("fuse.s3fs", s3fs, "/mnt/s3/kv", "/mnt/s3") == "/var/cache/s3fs/kvcache/kv"
    rclone = facts("rclone", RCLONE)
    assert fs_cache_dir("fuse.rclone", rclone, "/mnt/rc", "/mnt/rc") == \
        "/var/cache/rc/vfs/:s3{*}/kvcache"
    assert fs_cache_dir("fuse.s3fs", facts("s3fs", S3FS), "/mnt/s3", "/mnt/s3") == ""


@pytest.mark.parametrize(("fstype", "configured", "extent", "rule"), [
    ("fuse.s3fs", "auto", "whole", "off"),
    ("gpfs", "auto", "head", "tier"),
    ("ext4", "whole", "whole", "pagecache"),
    ("fuse.rclone", "head", "head", "off"),
])
def test_the_configured_extent_overrides_the_profiles(fstype: str, configured: str,
                                                      extent: str, rule: str) -> None:
    decided = rule_of("/r", fstype, "auto", configured)
    assert (decided.extent, decided.name) == (extent, rule)
    assert warm_extent(profile_for(fstype), "auto") == profile_for(fstype).extent


def test_the_fuse_server_is_the_process_whose_command_line_names_the_mount(
        tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    for pid, argv in (("7", ["bash"]), ("42", ["/usr/bin/s3fs", *S3FS]),
                      ("43", ["rclone", *RCLONE])):
        (proc / pid).mkdir(parents=True)
        (proc / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    server, _, positional = fuse_server("/mnt/s3", str(proc))
    assert (server, positional[0]) == ("s3fs", "kvcache")
    assert fuse_server("/mnt/rc/", str(proc))[0] == "rclone"
    assert fuse_server("/mnt/none", str(proc)) == ("", {}, ())


def test_the_fuse_server_is_the_one_holding_dev_fuse_not_another_naming_the_mount(
        tmp_path: Path) -> None:
    """This daemon names its roots on its command line too: with a lower pid (pids wrap)
    it was taken for the server, and s3fs lost its mount options (`kernel_cache`)."""
    proc = tmp_path / "proc"
    processes = (("12", ["kvprefetchd", "--root", "/mnt/s3"], "/dev/null"),
                 ("42", ["/usr/bin/s3fs", *S3FS], "/dev/fuse"))
    for pid, argv, fd in processes:
        (proc / pid / "fd").mkdir(parents=True)
        (proc / pid / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (proc / pid / "fd" / "3").symlink_to(fd)
    server, options, _ = fuse_server("/mnt/s3", str(proc))
    assert server == "s3fs" and options["url"] == "http://127.0.0.1:9000"
    # Fds not to be looked at: the first process outside this one's session stands in.
    (proc / "12" / "fd" / "3").unlink()
    (proc / "12" / "fd").rmdir()
    (proc / "12" / "stat").write_text(f"12 (kvprefetchd) S 1 12 {os.getsid(0)} 0\n")
    (proc / "42" / "fd" / "3").unlink()
    (proc / "42" / "fd").rmdir()
    assert fuse_server("/mnt/s3", str(proc))[0] == "s3fs"


def test_the_docs_table_says_what_each_profile_says() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "tiers.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells
    for profile in (*PROFILES.values(), profile_for("fuse")):
        cells = rows[profile.fstype]
        assert cells[3:7] == [f"`{profile.extent}`", f"`{profile.residency}`",
                              f"`{profile.keep}`", "yes" if profile.hold else "no"], cells


def test_a_fuse_root_starts_each_worker_at_its_share_of_max_background() -> None:
    from kvprefetchd.roots.rootset import RootState

    fuse = rule_of("/mnt/s3", "fuse.s3fs", "auto", facts=MountFacts(max_background=12))
    assert fuse.start_depth == 12
    assert RootState(0, "/mnt/s3", "auto", workers=2, rule=fuse).tier.depth == 6
    unknown = rule_of("/mnt/x", "fuse.other", "auto")  # fusectl not mounted: the default
    assert RootState(0, "/mnt/x", "auto", workers=5, rule=unknown).tier.depth == 3
    local = rule_of("/kv", "ext4", "auto")
    assert RootState(0, "/kv", "auto", workers=2, rule=local).tier.depth == 0


def test_a_fuse_root_hands_its_workers_the_connection_that_counts_its_requests() -> None:
    """Admission judges a FUSE root by its connection's `waiting` (native/gauge.c): the
    worker is told where; a root on any other file system keeps no such count."""
    from kvprefetchd.roots.rootset import RootState

    facts = MountFacts(max_background=12, connection="/sys/fs/fuse/connections/41")
    fuse = rule_of("/mnt/s3", "fuse.s3fs", "auto", facts=facts)
    assert RootState(0, "/mnt/s3", "auto", workers=2, rule=fuse).tier.gauge == \
        "/sys/fs/fuse/connections/41"
    for fstype in ("ext4", "nfs4", "lustre"):
        rule = rule_of("/kv", fstype, "auto", facts=facts)
        assert RootState(0, "/kv", "auto", workers=2, rule=rule).tier.gauge == ""


def test_a_network_root_starts_deep_and_a_local_one_at_initial_depth() -> None:
    """No ramp on a tier whose reads wait on a server (issue 25): its start is trusted
    from the profile; a local root climbs from initial_depth in microseconds."""
    from kvprefetchd.roots.residency import NETWORK_START_DEPTH
    from kvprefetchd.roots.rootset import RootState

    for fstype in ("nfs4", "gpfs", "lustre"):
        rule = rule_of("/mnt/kv", fstype, "auto")
        assert rule.start_depth == NETWORK_START_DEPTH
        assert RootState(0, "/mnt/kv", "auto", workers=2, rule=rule).tier.depth == \
            NETWORK_START_DEPTH // 2
    assert rule_of("/kv", "xfs", "auto").start_depth == 0
