/*
 * kvprefetch.h: the whole boundary between Python and C.
 *
 * This file is read twice: by the C compiler (every native C file includes it,
 * through internal.h) and by cffi's cdef (build_native.py feeds it, minus the
 * preprocessor lines, to ffibuilder.cdef).  Keep it to plain declarations cffi
 * understands: fixed width integers, structs, #define'd integer constants,
 * function prototypes.
 *
 * Python hands C files as arrays of kvp_item, never one call per file.  Every
 * engine is a row of one table (kvp_engines), of one of two kinds: a queue
 * engine (pread, fadvise) runs in an asynchronous queue (kvp_queue_*), which
 * takes files at once and hands back outcomes as reads finish; a batch engine
 * (io_uring) runs in a context (kvp_run_batch), which opens, checks, warms and
 * closes every file of a batch in one call with the GIL released.  Crossing the boundary
 * once per array (not once per file) is what lets the Python daemon run at the
 * speed of a hand-written C program.
 *
 * Python reads the constants below from the built module (lib.KVP_*), never
 * copies them: each prefix's names, lower-cased without the prefix, are the
 * names Python uses (KVP_OUT_READ is the outcome "read", KVP_RES_TIER the
 * residency rule "tier").
 */

/* Per-file outcomes: the protocol's outcome names (docs/protocol.md, "Per-file
 * outcomes"), of which these are the ones a worker settles. */
#define KVP_OUT_READ 0      /* head warmed (read, or advised and confirmed resident) */
#define KVP_OUT_RESIDENT 1  /* skipped: residency rule says already warm, nothing read */
#define KVP_OUT_MISSING 2   /* ENOENT / ENOTDIR on the path: not an error */
#define KVP_OUT_REJECTED 3  /* escapes the root, a symlink out, not a regular file, bad name */
#define KVP_OUT_FAILED 4    /* I/O error while opening (other than the above) or reading */
#define KVP_OUT_EXPIRED 5   /* its deadline passed before its read was issued: nothing read */

/* Residency rule applied before any read (per item: it depends on the root's
 * fs): the config's residency names (off, tier, pagecache). */
#define KVP_RES_OFF 0        /* always warm */
#define KVP_RES_TIER 1       /* storage-tier rule from st_blocks (HSM / AFM stubs) */
#define KVP_RES_PAGECACHE 2  /* page-cache rule: cachestat, mincore where it is missing */

struct kvp_item {
    int32_t root_fd;      /* in: O_PATH|O_DIRECTORY fd of the allowed root */
    int32_t residency;    /* in: KVP_RES_* */
    const char *rel;      /* in: NUL-terminated path relative to root_fd, never starting with '/' */
    uint64_t read_bytes;  /* in: the request's read_bytes: how much of the head to warm */
    int32_t outcome;      /* out: KVP_OUT_* */
    int32_t err;          /* out: errno behind MISSING/REJECTED/FAILED, else 0 */
    uint64_t size;        /* out: st_size, when the file could be stat'ed */
    uint64_t done;        /* out: bytes read (READ), or bytes found resident (RESIDENT) */
    int64_t deadline_ns;  /* in: CLOCK_MONOTONIC ns; past it, the read is not issued
                             (EXPIRED, err 0); 0: no deadline */
    int32_t flags;        /* in: KVP_ITEM_* */
    /* in, the queue engines only (native/schedule.c): which request the file came
     * with (a later group is a newer request, served first among files without a
     * deadline; 0: none, first come first served) and who asked (clients waiting on
     * one root take turns). */
    uint32_t group;
    uint32_t client;
    /* in, the queue engines only: the file's place in its request, 0 the first its
     * consumer reads (it reads them in order: schedule.c's admission). */
    uint32_t position;
};

/* Item flags.  KVP_ITEM_NOATIME: read through an O_NOATIME fd where the kernel
 * permits it (the owner of the file, or CAP_FOWNER); otherwise read anyway,
 * counted in kvp_noatime_fallbacks. */
#define KVP_ITEM_NOATIME 1
/* KVP_ITEM_HOLD (the queue engines): a file READ, or found RESIDENT in the page cache,
 * keeps the fd it was read or looked at through open and hands it to the reaper in
 * kvp_done.fd, for file systems that keep a file's data only while someone has it open,
 * or answer an open cheaply only then (s3fs: daemon/kvprefetchd/worker/holds.py). */
#define KVP_ITEM_HOLD 2

/* Reads that asked for O_NOATIME and were refused it (EPERM), since the module loaded. */
uint64_t kvp_noatime_fallbacks(void);

/*
 * Engines are named, not numbered: a (engine, warm_mode) pair of strings picks
 * an entry of the C table (native/prefetch.c), and kvp_engines lists that table.
 * So the Python registry is driven by C's own table: there is no engine code to
 * keep in step on both sides, an engine added in C is listed (and tested) from
 * Python without a new constant, and an unknown pair is refused in one place
 * (kvp_ctx_new: EINVAL).  The names are the ones the config, the log, `ping`
 * and `stats` already say.  A name is looked up once per context, never per
 * batch or per file, so strings cost nothing on the hot path.
 */
struct kvp_engine_name {
    const char *engine;     /* "pread", "fadvise", "io_uring" */
    const char *warm_mode;  /* "read" (the engine reads every head) or "advise"
                               (it asks the kernel to read, then confirms) */
    int32_t queued;         /* 1: a queue engine (kvp_queue_new); 0: a batch
                               engine (kvp_ctx_new, kvp_run_batch) */
};

/* The engine table: fills out[0 .. min(n, count)) and returns count (out may be
 * NULL when n is 0).  The strings are static: they outlive every context. */
size_t kvp_engines(struct kvp_engine_name *out, size_t n);

/* 1 when the engine can run here; 0 otherwise with a human reason written to
 * why (NUL-terminated, at most whylen bytes): e.g. io_uring refused by the
 * kernel or seccomp, "built without liburing", or an unknown engine. */
int kvp_engine_detect(const char *engine, const char *warm_mode, char *why, size_t whylen);

struct kvp_config {
    const char *engine;     /* a batch engine of the table (kvp_engines), e.g. "io_uring" */
    const char *warm_mode;  /* its warm mode, "read" or "advise" */
    int32_t fadv_random;    /* nonzero: POSIX_FADV_RANDOM on every fd before reading */
    uint32_t chunk;         /* bytes per read request (pread loop and io_uring) */
    uint32_t queue_depth;   /* io_uring: reads kept in flight; also SQ ring size */
    uint32_t threads;       /* pread threads per batch (1 = plain loop); the advice
                               engines' confirming reads too */
    uint32_t max_open;      /* files held open at once inside a batch (fd budget) */
};

struct kvp_ctx;  /* opaque: the engine, its ring or window, scratch buffers, kernel features */

/* Create a context for cfg; NULL with *err = errno when it cannot be made:
 * EINVAL for a bad config, an unknown engine or a queue engine, ENOSYS for io_uring in a build
 * without liburing, or the ring setup's refusal (e.g. ENOSYS/EPERM under
 * seccomp).  cfg's strings may be freed once this returns. */
struct kvp_ctx *kvp_ctx_new(const struct kvp_config *cfg, int *err);
void kvp_ctx_free(struct kvp_ctx *ctx);

/* Warm a batch.  Every item gets an outcome.  Returns 0, or -errno if the
 * batch as a whole could not run (items then all FAILED with that errno). */
int kvp_run_batch(struct kvp_ctx *ctx, struct kvp_item *items, size_t n);

/*
 * The asynchronous queue (native/queue.c): files are submitted and their
 * outcomes reaped as they complete, from persistent threads whose reads in
 * flight follow each root's file system (native/depthctl.c).  A worker polls
 * kvp_queue_fd (an eventfd, readable while outcomes wait), reaps, and calls
 * kvp_queue_tick a few times a second while files are out, which marks stalled
 * reads and settles those past the deadline (FAILED, ETIMEDOUT).  Files behind
 * another mount beneath their root are read in a lane of their own with a few
 * threads, never ahead of the root's own files (queue.c's header).
 */
struct kvp_queue_config {
    const char *engine;      /* a queue engine of the table (kvp_engines), e.g. "pread" */
    const char *warm_mode;   /* its warm mode, "read" or "advise" */
    int32_t fadv_random;     /* nonzero: POSIX_FADV_RANDOM before reading (not for an
                                advise engine, whose WILLNEED says what to read) */
    uint32_t chunk;          /* bytes per read request */
    uint32_t initial_depth;  /* reads in flight per root to start from */
    uint32_t max_threads;    /* threads at most, stalled ones included (at most 4096) */
    uint64_t timeout_ns;     /* a file not settled this long after submission fails; 0: never */
    uint32_t other_mount_threads;  /* the other-mount lane's threads, stuck ones included,
                                      apart from max_threads (at most 4096; 0: 4) */
};
#define KVP_QUEUE_MAX_THREADS 4096
#define KVP_QUEUE_OTHER_MOUNT_THREADS 4  /* the lane's threads when the config says 0 */

struct kvp_done {            /* one settled file, as reaped */
    uint64_t tag;            /* the caller's tag from kvp_queue_submit */
    int32_t outcome;         /* KVP_OUT_* */
    int32_t err;             /* errno behind MISSING/REJECTED/FAILED (ETIMEDOUT: timed out;
                                EHOSTDOWN: refused by the other-mount lane, all of whose
                                threads are stuck: the protocol's `mount_unresponsive`) */
    uint64_t size;
    uint64_t done;
    int32_t fd;              /* KVP_ITEM_HOLD: the fd kept open after a READ or a
                                page-cache RESIDENT, the caller's to close; else -1 */
};

#define KVP_QUEUE_STATS_ROOTS 16
struct kvp_queue_stats {
    uint32_t threads, idle, pending, running, stalled, nroots;  /* the roots' lanes */
    uint64_t submitted, reaped, timed_out, stalls, spawn_failures;
    uint64_t standby_reads;  /* files refused on arrival, read later into a slot the tier
                                had free before their consumer could get to them */
    /* The other-mount lane: its threads, files waiting for one, reads running and those
     * of them past the lane's stall time (stuck threads); files handed to it, refused
     * by it (EHOSTDOWN) and its reads that stalled, since the queue was made. */
    uint32_t mount_threads, mount_pending, mount_running, mount_stalled;
    uint64_t mount_moved, mount_refused, mount_stalls;
    int32_t root_fd[16];     /* KVP_QUEUE_STATS_ROOTS: per root, its fd, depth, service time */
    uint32_t root_depth[16];
    uint32_t root_rtt_us[16];
    uint32_t root_served[16];  /* requests a second its tier answers, as its gauge learned
                                  (kvp_queue_root_gauge; 0: none, or nothing learned yet) */
    uint32_t root_floor_us[16];  /* its tier's fastest fetch, as depthctl.c keeps it */
};

struct kvp_queue;
/* NULL with *err = errno (EINVAL for a bad config, an unknown engine or a batch
 * engine; ENOMEM; the eventfd's errno).  cfg's strings may be freed once this returns. */
struct kvp_queue *kvp_queue_new(const struct kvp_queue_config *cfg, int *err);
/* Stops the threads; those stuck in the kernel keep the queue (it is then left). */
void kvp_queue_free(struct kvp_queue *q);
int kvp_queue_fd(const struct kvp_queue *q);
/* Take n files (copied: items and their rel may be freed on return), each with
 * its tag.  Returns how many were taken, the first ones: fewer than n only when
 * memory ran out.  Never blocks on I/O. */
size_t kvp_queue_submit(struct kvp_queue *q, const struct kvp_item *items, const uint64_t *tags,
                        size_t n);
/* Move up to max settled files into out; returns how many. */
size_t kvp_queue_reap(struct kvp_queue *q, struct kvp_done *out, size_t max);
void kvp_queue_tick(struct kvp_queue *q);
/* The reads in flight a root starts from, instead of cfg.initial_depth, trusted from its
 * tier profile so that a slow tier's first burst pays no ramp (depthctl.c; its depth
 * then follows the file system as any root's does): a FUSE mount's share of its
 * connection's max_background, past which reads only wait in the kernel, or a network
 * file system's start.  Applied while the root has nothing pending or running; 0 leaves
 * it as it is. */
void kvp_queue_root_depth(struct kvp_queue *q, int root_fd, uint32_t initial);
/* Judge the root's requests by its tier's own count of requests not answered yet:
 * connection is its FUSE connection's fusectl directory (/sys/fs/fuse/connections/N,
 * whose `waiting` is read; gauge.c).  0, or -errno from reading it (ENOENT: fusectl
 * not mounted; EACCES: the mount is another user's); -ENOSPC when the root shares
 * the queue's last slot with others. */
int kvp_queue_root_gauge(struct kvp_queue *q, int root_fd, const char *connection);
void kvp_queue_stats(struct kvp_queue *q, struct kvp_queue_stats *out);

/* inotify for held files (watch.c): a non-blocking inotify fd (-errno on failure); a
 * one-shot IN_OPEN | IN_DELETE_SELF watch on the inode behind an open fd (the watch
 * descriptor, or -errno); and its removal.  Events are read from the fd as the kernel
 * writes them (struct inotify_event). */
int kvp_watch_new(void);
int kvp_watch_fd(int watch, int fd);
int kvp_watch_drop(int watch, int wd);

/* Residency of [off, off+len) of an open fd, for tests and for the supervisor-
 * free paths: pages resident via cachestat (Linux 6.5+), falling back to
 * mincore.  Returns resident bytes (rounded to whole pages, capped at len) or
 * -errno.  uptodate != 0 forces mincore, which (unlike cachestat) does not
 * count pages whose read is still in flight. */
int64_t kvp_resident_bytes(int fd, uint64_t off, uint64_t len, int32_t uptodate);

/*
 * check and evict (native/inspect.c): look at files without reading them, or
 * drop their pages.  Each item is resolved and verified as the engines do
 * (beneath its root, regular files only) but on the root's own mount only: a
 * name behind another mount beneath the root is FAILED with EXDEV, its file
 * system never asked.  Nothing is read, and neither the O_PATH lookup, fstat,
 * cachestat nor fadvise changes atime.  KVP_CHK_* are the protocol's check
 * states (docs/protocol.md, "Check states").
 */
#define KVP_CHK_RESIDENT 0  /* the head is resident by the item's residency rule */
#define KVP_CHK_COLD 1      /* it is not */
#define KVP_CHK_MISSING 2
#define KVP_CHK_REJECTED 3
#define KVP_CHK_FAILED 4

#define KVP_INSPECT_CHECK 0       /* look only */
#define KVP_INSPECT_EVICT_HEAD 1  /* POSIX_FADV_DONTNEED over [0, read_bytes), then look */
#define KVP_INSPECT_EVICT_FILE 2  /* POSIX_FADV_DONTNEED over the whole file, then look */

struct kvp_inspect_out {
    int32_t state;    /* KVP_CHK_* (after eviction, for the evict actions) */
    int32_t err;      /* errno behind MISSING/REJECTED/FAILED */
    uint64_t size;    /* st_size */
    uint64_t cached;  /* page-cache bytes of the whole file */
    uint64_t tier;    /* st_blocks x 512: bytes allocated on the near tier */
};
/* Every item gets an out; items' deadline and flags are ignored.  OFF roots
 * are judged by the page cache. */
void kvp_inspect(int32_t action, const struct kvp_item *items, struct kvp_inspect_out *out,
                 size_t n);

/* Which residency mechanism kvp_resident_bytes uses here: 1 cachestat, 0 mincore. */
int kvp_have_cachestat(void);

/*
 * The fast path for warm heads (native/probe.c): a worker asks, on its own
 * thread and in one call, which files of a message are resident already (or
 * missing by the dentry cache's word), and hands only the rest to its engines.
 * It never waits on a file system: roots not on a local one
 * (kvp_probe_root_local 0), names outside the dentry cache and names behind
 * another mount beneath the root go to the queue, as does everything after a
 * slow file or past budget_ns.
 */
struct kvp_probe_root {
    int32_t fd;         /* the root's O_PATH directory fd; -1: not open (never probed) */
    int32_t residency;  /* KVP_RES_*: OFF roots are never probed (every file is read) */
    int32_t local;      /* kvp_probe_root_local(fd) */
    int32_t view;       /* kvp_nodev_view(fd): the page-cache rule opens each file once
                           beneath it; -1: none, the O_PATH check and the /proc reopen */
};
struct kvp_prober;
struct kvp_prober *kvp_prober_new(void);  /* NULL: out of memory */
void kvp_prober_free(struct kvp_prober *p);
/* 0 when this kernel lacks what the fast path needs (openat2 with
 * RESOLVE_CACHED, /proc): every file then goes to the queue. */
int kvp_prober_works(const struct kvp_prober *p);
void kvp_prober_force_fallback(struct kvp_prober *p, int32_t which);
/* 1 when root_fd's own file system is answered by this kernel alone (ext2/3/4,
 * xfs, btrfs, f2fs, tmpfs); the probe never leaves that mount. */
int kvp_probe_root_local(int32_t root_fd);
/* An fd of root_fd's directory on a mount flagged nodev, where opening a file
 * for reading can never open a device (native/nodev.c): a dup of root_fd when
 * its mount is nodev (*detached 0), else a copy of its mount tree flagged
 * nodev and attached nowhere (*detached 1: it does not see later mounts or
 * unmounts beneath the root; make it again when the mount table changes).
 * -1 and errno when neither can be had (a copy needs CAP_SYS_ADMIN). */
int32_t kvp_nodev_view(int32_t root_fd, int32_t *detached);
/* paths: n names, each ended by NUL (paths_len bytes in all), relative to
 * roots[root_index[i]].  Fills resident_out with the indexes of the files
 * whose first read_bytes are resident by their root's rule, missing_out (and
 * *nmissing) with those that do not exist (MISSING, ENOENT), and rest_out with
 * every other index, each in order; returns how many are resident (the rest
 * are n minus both).  Each array has room for n. */
size_t kvp_probe(const struct kvp_prober *p, const struct kvp_probe_root *roots, size_t nroots,
                 const char *paths, size_t paths_len, const uint16_t *root_index, size_t n,
                 uint64_t read_bytes, int64_t budget_ns, uint32_t *resident_out,
                 uint32_t *missing_out, size_t *nmissing, uint32_t *rest_out);

/*
 * Admission (native/admit.c): the supervisor's lexical gate, canonical
 * spelling, shard and queue room for a whole request in one call.  Paths come
 * in as one buffer of n names separated by NUL (no NUL after the last); each
 * gets a KVP_ADMIT_* status, and the admitted ones land in their worker's
 * share (kvp_admission_share: relative names each ended by NUL, and their root
 * indexes), valid until the next kvp_admit.  The statuses name the refusals
 * of docs/protocol.md, "Failures", lower-cased without the prefix.
 */
#define KVP_ADMIT_ACCEPTED 0
#define KVP_ADMIT_DROPPED 1        /* its worker's queue is full */
#define KVP_ADMIT_RELATIVE 2
#define KVP_ADMIT_OUTSIDE_ROOTS 3
#define KVP_ADMIT_DOTDOT 4
#define KVP_ADMIT_TOO_LONG 5
#define KVP_ADMIT_NOT_A_FILE 6
struct kvp_admission;
/* prefixes: nroots roots, each with one trailing '/', longest first, each
 * ended by NUL; index: each one's root index.  NULL: out of memory. */
struct kvp_admission *kvp_admission_new(const char *prefixes, const uint16_t *index,
                                        uint32_t nroots, uint32_t max_path_bytes,
                                        uint32_t workers);
void kvp_admission_free(struct kvp_admission *a);
/* The worker (of workers) that owns the relative name rel (len bytes) under
 * root: stable across processes, the same for every spelling admission makes
 * canonical.  Python's gate (admit.shard_of) calls it too. */
uint32_t kvp_shard(uint32_t root, const char *rel, size_t len, uint32_t workers);
/* room[w]: files worker w may still take (decremented as they are admitted).
 * Returns the files admitted, -EINVAL when blob does not hold n names (a NUL
 * inside one), -ENOMEM. */
int64_t kvp_admit(struct kvp_admission *a, const char *blob, size_t len, size_t n,
                  int64_t *room, uint8_t *status);
/* Worker w's share of the last kvp_admit: its file count. */
uint32_t kvp_admission_share(const struct kvp_admission *a, uint32_t worker, const char **paths,
                             size_t *paths_len, const uint16_t **roots);

/* Testing aid (added by the native engineer): make this ctx behave as if the
 * kernel lacked openat2 (KVP_FALLBACK_OPENAT2: component walk from root_fd,
 * refusing ".." and every symlink) and/or /proc (KVP_FALLBACK_PROC: reopen by a
 * second path resolution plus a dev/ino check), so the fallbacks can be tested
 * on a kernel that has both.  Bits only ever turn features off, from any thread,
 * at any time: a queue's threads see them from their next file on. */
#define KVP_FALLBACK_OPENAT2 1
#define KVP_FALLBACK_PROC 2
void kvp_ctx_force_fallback(struct kvp_ctx *ctx, int32_t which);
void kvp_queue_force_fallback(struct kvp_queue *q, int32_t which);
/* The same for kvp_inspect, whose ctx is the process's: for a test's child. */
void kvp_inspect_force_fallback(int32_t which);
