"""Config keys: where requests come in, and what may be warmed."""

from __future__ import annotations

from kvprefetchd.addresses import SOCKET_CHAIN, SYSTEMD_SOCKET, default_socket_path
from kvprefetchd.config_keys.key import (
    CHOICE,
    IDS,
    INT,
    MIB,
    PATH,
    ROOTS,
    SECONDS,
    SECONDS_OR_OFF,
    Flag,
    Key,
    Section,
)
from kvprefetchd.roots.tiers import WARM_EXTENTS

RESIDENCY_RULES = ("auto", "tier", "pagecache", "off")

# The llm-d fs connector's default shared_storage_path (spec §5.1): a daemon
# started with no configuration at all warms what a default connector writes.
DEFAULT_ROOT = "/tmp/shared-kv"

REQUESTS = Section("where requests come in", (
    Key("socket", PATH, default_socket_path, restart=True, shown=f'"{SYSTEMD_SOCKET}"',
        flag=Flag("--socket", "Unix socket to listen on", "PATH"), help=f"""
        The Unix socket. Default: {SOCKET_CHAIN}.
        Under socket activation (kvprefetchd.socket) the socket systemd passes is used
        and this must name the same path."""),
    Key("socket_mode", INT, 0o660, bounds=(0, 0o777), restart=True, shown="0o660", help="""
        Permissions of the socket when the daemon binds it itself (the umask is set
        around bind(), so it is never briefly more open). kvprefetchd.socket sets
        SocketMode= instead."""),
    Key("allowed_uids", IDS, (), help="""
        Peers allowed besides the daemon's own user and the socket file's group,
        checked with SO_PEERCRED/SO_PEERGROUPS on every connection (others get
        `forbidden` and are closed). Numeric ids; a reload applies them."""),
    Key("allowed_gids", IDS, ()),
    Key("max_connections", INT, 1024, bounds=(1, 65536), help="""
        At most this many client connections at once, and this many per peer uid; a
        connection over either cap gets one `overloaded` reply and is closed. 16 more are
        kept for root and the daemon's own user, so an operator's ping always gets through."""),
    Key("max_connections_per_uid", INT, 128, bounds=(1, 65536)),
    Key("idle_timeout", SECONDS_OR_OFF, 600.0, bounds=(1.0, 86400.0), help="""
        A connection that owes no reply, has nothing unsent and has sent nothing for this
        many seconds is closed (clients reconnect); 0 never. 1 to 86400."""),
    Key("frame_timeout", SECONDS_OR_OFF, 30.0, bounds=(1.0, 3600.0), help="""
        A frame must arrive whole within this many seconds of its first byte, else the
        connection is closed: a client trickling a frame holds memory (and its share of
        max_input_buffer_bytes below). 0 never. 1 to 3600."""),
))

WARMED = Section("what may be warmed", (
    Key("roots", ROOTS, (DEFAULT_ROOT,), restart=True,
        flag=Flag("--root", "allowed root directory (repeatable); replaces the configured roots",
                  "DIR"), help="""
        Absolute directories beneath which files may be warmed; any other path is
        `rejected` before any I/O. Default: the llm-d fs connector's default
        shared_storage_path. Set it to your connector's shared_storage_path(s)."""),
    Key("residency", CHOICE, "auto", choices=RESIDENCY_RULES, restart=True, help="""
        How "already warm" is decided before reading a file:
          "auto"      by file system type: "tier" on gpfs and lustre, else "pagecache"
          "tier"      st_blocks: a migrated (HSM/AFM) stub has no blocks until recalled
          "pagecache" cachestat(2) (mincore(2) before Linux 6.5) over the head
          "off"       never skip: always read
        Per root: the [residency_by_root] table at the end of this file."""),
    Key("warm_extent", CHOICE, "auto", choices=WARM_EXTENTS, restart=True, help="""
        How much of each file a warm-up reads: "head" (read_bytes), "whole" (the file), or
        "auto": the root's tier profile (docs/tiers.md): "whole" on FUSE object stores (s3fs,
        rclone, JuiceFS, gcsfuse, ...: only what is read comes near, and the consumer reads the
        whole file), "head" elsewhere (a head read recalls the file on Storage Scale and Lustre
        HSM). Per root: the [warm_extent_by_root] table."""),
    Key("hold_seconds", SECONDS, 120.0, bounds=(0.1, 86400.0), restart=True, help="""
        Hold-open warming, on roots whose file system keeps a file's data only while it is
        open (s3fs without -o kernel_cache): a warmed file stays open until another process
        opens it or hold_seconds pass, at most hold_max_files files and hold_max_bytes of
        them per daemon (the oldest let go first). `kvprefetch doctor` says which roots hold."""),
    Key("hold_max_files", INT, 4096, bounds=(0, 1 << 20), restart=True),
    Key("hold_max_bytes", INT, 64 * 1024 * MIB, bounds=(0, 1 << 50), restart=True),
))
