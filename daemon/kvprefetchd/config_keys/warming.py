"""Config keys: how files are warmed (the workers, their engines and queues)."""

from __future__ import annotations

from kvprefetchd.config_keys.key import (
    BOOL,
    CHOICE,
    INT,
    KIB,
    MIB,
    SECONDS_OR_OFF,
    Flag,
    Key,
    Section,
)
from kvprefetchd.protocol import WARM_MODES

ENGINES = ("auto", "io_uring", "fadvise", "pread")

WARMING = Section("how files are warmed", (
    Key("workers", INT, 0, bounds=(0, 256), restart=True,
        flag=Flag("--workers", "worker processes (0: one per CPU)", "N"), help="""
        Worker processes (forked); a path always lands on the same worker. 0: one per CPU."""),
    Key("engine", CHOICE, "auto", choices=ENGINES, restart=True,
        flag=Flag("--engine", "how workers read (auto: the queue of pread threads for read, "
                  "fadvise for advise)"), help="""
        I/O engine: "auto" (pread in read mode, fadvise in advise mode: the adaptive queue
        below), "pread", "fadvise", or "io_uring" (a batch per native call on one ring)."""),
    Key("warm_mode", CHOICE, "read", choices=WARM_MODES, restart=True,
        flag=Flag("--warm-mode", "read: read every head (what promotes a file on a tier); "
                  "advise: hint the kernel"), help="""
        "read" reads the head (the page cache and the near tier get it now);
        "advise" asks the kernel with posix_fadvise(WILLNEED) and confirms with a read."""),
    Key("read_bytes", INT, 1 * MIB, bounds=(1, 1 << 40),
        flag=Flag("--read-bytes", "bytes warmed from the start of each file (a request may "
                  "ask for fewer)", "N"), help="""
        Bytes of each file's head to warm (1 MiB); a request may ask for its own
        `read_bytes`, up to max_read_bytes (64 MiB)."""),
    Key("max_read_bytes", INT, 64 * MIB, bounds=(1, 1 << 40)),
    Key("chunk_bytes", INT, 128 * KIB, bounds=(4 * KIB, 64 * MIB), restart=True, help="""
        Bytes per read request (128 KiB), between 4 KiB and 64 MiB."""),
    Key("initial_depth", INT, 16, bounds=(1, 4096), restart=True, help="""
        The pread and fadvise engines (what `auto` picks) are an asynchronous queue per
        worker: files start as they arrive, and the reads each root keeps in flight follow
        its file system (grown while they buy files per second, cut back once reads only
        queue: native/depthctl.c), from initial_depth up to max_in_flight threads. A slow
        tier (10-200 ms a fetch) gets hundreds in flight; a local disk what it serves best."""),
    Key("max_in_flight", INT, 512, bounds=(1, 4096), restart=True),
    Key("file_timeout", SECONDS_OR_OFF, 60.0, bounds=(0.1, 86400.0), restart=True, help="""
        A file not settled this long after its worker got it is answered `failed`, even
        while its read is still stuck in the kernel (a tier that never answers); its thread
        stays out of the count of reads in flight. 0: never. Raise it for a tape tier."""),
    Key("other_mount_threads", INT, 4, bounds=(1, 4096), restart=True, help="""
        Files behind another mount beneath a root (a FUSE or NFS file system mounted in a
        subdirectory of it) are read by a lane of their own: at most this many threads per
        worker, apart from max_in_flight, so that a mount that hangs never holds the root's
        own files back nor piles up threads. Once all of them are stuck on reads, such files
        fail at once (`mount_unresponsive`) until one returns. A real tier mounted beneath a
        root is better listed as a root of its own (its own depth); else raise this."""),
    Key("root_path_checks", BOOL, True, restart=True, help="""
        Roots are opened by helper processes (never on the supervisor's thread), walking the
        path from / without following symlinks, and walked again every 2 s and on every mount
        change (a root replaced or mounted over is reopened); a root whose path another user
        could swap (a symlink, a directory of theirs, or one writable by others that is not
        sticky) is refused with the reason (refused after start, the directory opened earlier
        stays in force). false accepts such paths (the root is still held as an fd)."""),
    Key("fs_timeout", SECONDS_OR_OFF, 10.0, bounds=(0.1, 3600.0), help="""
        How long that helper may take over one file-system task (opening a root, KV
        fingerprint discovery, a stale-profile scan) before it is presumed stuck in a file
        system that does not answer: it is replaced and the task fails (0: never)."""),
    Key("max_stuck_workers", INT, 8, bounds=(1, 1024), help="""
        Workers killed for being wedged but held back by the kernel (stuck in a file system
        that does not answer) at most; past this a dead worker's shard is not respawned (its
        files are dropped, counted) until one of them exits."""),
    Key("queue_depth", INT, 128, bounds=(1, 4096), restart=True, help="""
        io_uring submission queue entries per worker."""),
    Key("pread_threads", INT, 16, bounds=(1, 256), restart=True, help="""
        io_uring advise mode: threads per worker that confirm the advised heads."""),
    Key("fadv_random", BOOL, True, restart=True, help="""
        posix_fadvise(RANDOM) before reading, so readahead does not fetch past the head."""),
    Key("batch_files", INT, 256, bounds=(1, 65536), restart=True, help="""
        Files handed to the engine per native call, and files open at once per batch."""),
    Key("max_open_files", INT, 1024, bounds=(8, 16384), restart=True),
    Key("queue_limit", INT, 8192, bounds=(1, 10_000_000), help="""
        Files outstanding per worker before new ones are `dropped` (counted, never waited
        for)."""),
    # Measured with bench/ack_latency.py --modes busy on 2 vCPUs, 1,000-path acks while the
    # workers settle earlier requests: p99 10-12x the echo floor at nice 5, 2.2-4.0x at 10,
    # 1.7-2.2x at 19; the hot path's 150,000 files/s sustained with 0 dropped at 19 too.
    Key("worker_nice", INT, 19, bounds=(0, 19), restart=True, help="""
        Niceness added to the workers: they yield the CPU to the supervisor's acks and to
        the router on the same host (their work waits on the disk, not the scheduler, and a
        warm file costs them a few microseconds). Lower it on a host whose CPUs are saturated
        by other work, where warm-ups would otherwise only get what is left over."""),
    # A worker woken by a Warm never preempts the running task (sched(7)), so the client
    # woken by the ack is not queued behind it (EEVDF lets the worker's slice run out first;
    # a 250 Hz kernel checks at the next tick: 4 ms). Traced with bench/ack_latency.py's
    # resident set: client waits > 0.5 ms behind a worker after the ack, 17 of 400 requests
    # at nice 19 alone, 7 of 400 with SCHED_BATCH (docs/bench/ack-and-load.md).
    Key("worker_batch", BOOL, True, restart=True, help="""
        Workers run SCHED_BATCH: a worker woken by new files never preempts the running task,
        so the client woken by the ack (and the supervisor) run before it. Same CPU share."""),
    # The probe's one open (native/nodev.c): -37% of its CPU per resident file, the hot
    # path from 0.64x vmtouch's to 0.46-0.50x (docs/bench/hot.md, issue 25).
    Key("check_before_open", BOOL, False, restart=True, help="""
        Open a file for reading only once a check of its O_PATH fd said it is a regular
        file: two opens per resident file the probe looks at. Off, the probe opens a file
        once, then checks it, beneath a root it sees through a nodev mount (the root's own,
        or a copy of it the daemon can make as root): the kernel refuses every device
        there, a FIFO is opened without waiting and closed unread."""),
    # Admission by the tier's own count (native/gauge.c, schedule.c's standby): in the
    # router replay on the simulator at 150% load 2.2-3.3x the FIFO pool's requests fully
    # warm, against 1.3-2.0x by the reads' own times; at 90% a warm-hit ratio at or above
    # the pool's (docs/bench/replay.md, 0.11.0).
    Key("admit_by_tier_count", BOOL, True, restart=True, help="""
        On a FUSE root, judge a request with a deadline by the connection's count of
        requests not answered (fusectl's `waiting`, every reader's) and the rate the tier
        answers them: whole when its last file would be back in time, else only the files
        that make it while the tier's queue is short; a file refused stands by and is read
        when the tier has a fetch slot free, until its consumer could have got to it. In
        overload, more requests fully warm on time. Off, or where the count cannot be read,
        each file is judged by the root's own recent read time: more files read late, which
        the consumers of refused requests wait less for at moderate load."""),
    Key("dedup_ttl_ms", INT, 1000, bounds=(0, 3_600_000), restart=True, help="""
        A path warmed within this many milliseconds is skipped as a duplicate;
        at most dedup_entries paths, and dedup_bytes of memory for them (16 MiB), are
        remembered per worker. Every spelling of a file (`//`, `/./`) is one path."""),
    Key("dedup_entries", INT, 65536, bounds=(0, 10_000_000), restart=True),
    Key("dedup_bytes", INT, 16 * MIB, bounds=(0, 1 << 30), restart=True),
))
