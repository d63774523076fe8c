/*
 * kvprefetch.h: the whole boundary between Python and C.
 *
 * This file is read twice: by the C compiler (prefetch.c includes it) and by
 * cffi's cdef (build_native.py feeds it, minus the preprocessor lines, to
 * ffibuilder.cdef).  Keep it to plain declarations cffi understands: fixed
 * width integers, structs, #define'd integer constants, function prototypes.
 *
 * The unit of work is a *batch*: Python hands C an array of kvp_item, C opens,
 * checks, warms and closes every file in it and fills in the outcome fields,
 * all in one call with the GIL released.  Crossing the boundary once per batch
 * (not once per file) is what lets the Python daemon run at the speed of a
 * hand-written C program.
 */

/* Per-file outcomes.  Mirror the protocol's outcome names (design/protocol.md). */
#define KVP_OUT_READ 0      /* head warmed (read, or advised and confirmed resident) */
#define KVP_OUT_RESIDENT 1  /* skipped: residency rule says already warm, nothing read */
#define KVP_OUT_MISSING 2   /* ENOENT / ENOTDIR on the path: not an error */
#define KVP_OUT_REJECTED 3  /* escapes the root, a symlink out, not a regular file, bad name */
#define KVP_OUT_FAILED 4    /* I/O error while opening (other than the above) or reading */

/* How to warm a head. */
#define KVP_ENGINE_PREAD 0          /* blocking pread loop, spread over cfg.threads threads */
#define KVP_ENGINE_FADVISE 1        /* posix_fadvise(WILLNEED) every head, then confirm */
#define KVP_ENGINE_URING_READ 2     /* io_uring IORING_OP_READ of every head in chunks */
#define KVP_ENGINE_URING_FADVISE 3  /* io_uring IORING_OP_FADVISE(WILLNEED), then confirm */

/* Residency rule applied before any read (per item: it depends on the root's fs). */
#define KVP_RES_NONE 0       /* always warm */
#define KVP_RES_TIER 1       /* storage-tier rule from st_blocks (HSM / AFM stubs) */
#define KVP_RES_PAGECACHE 2  /* page-cache rule: cachestat, mincore where it is missing */

struct kvp_item {
    int32_t root_fd;     /* in: O_PATH|O_DIRECTORY fd of the allowed root */
    int32_t residency;   /* in: KVP_RES_* */
    const char *rel;     /* in: NUL-terminated path relative to root_fd, never starting with '/' */
    uint64_t want;       /* in: head length to warm, bytes (read_bytes) */
    int32_t outcome;     /* out: KVP_OUT_* */
    int32_t err;         /* out: errno behind MISSING/REJECTED/FAILED, else 0 */
    uint64_t size;       /* out: st_size, when the file could be stat'ed */
    uint64_t done;       /* out: bytes read (READ), or bytes found resident (RESIDENT) */
};

struct kvp_config {
    int32_t engine;        /* KVP_ENGINE_* */
    int32_t fadv_random;   /* nonzero: POSIX_FADV_RANDOM on every fd before reading */
    uint32_t chunk;        /* bytes per read request (pread loop and io_uring) */
    uint32_t queue_depth;  /* io_uring: reads kept in flight; also SQ ring size */
    uint32_t threads;      /* PREAD engine: threads per batch (1 = plain loop) */
    uint32_t max_open;     /* files held open at once inside a batch (fd budget) */
};

struct kvp_ctx;  /* opaque: the ring, scratch buffers, resolved kernel features */

/* Create a context for cfg; NULL with *err = errno when it cannot be made (for
 * the io_uring engines: ring setup refused, e.g. ENOSYS/EPERM under seccomp). */
struct kvp_ctx *kvp_ctx_new(const struct kvp_config *cfg, int *err);
void kvp_ctx_free(struct kvp_ctx *ctx);

/* Warm a batch.  Every item gets an outcome.  Returns 0, or -errno if the
 * batch as a whole could not run (items then all FAILED with that errno). */
int kvp_run_batch(struct kvp_ctx *ctx, struct kvp_item *items, size_t n);

/* Probe io_uring once: 1 if a ring can be set up and supports READ, FADVISE
 * and OPENAT2-free operation on this kernel; 0 otherwise with a human reason
 * written to why (NUL-terminated, at most whylen bytes).  0 with reason
 * "built without liburing" when the extension was compiled without it. */
int kvp_uring_probe(char *why, size_t whylen);

/* Residency of [off, off+len) of an open fd, for tests and for the supervisor-
 * free paths: pages resident via cachestat (Linux 6.5+), falling back to
 * mincore.  Returns resident bytes (rounded to whole pages, capped at len) or
 * -errno.  uptodate != 0 forces mincore, which (unlike cachestat) does not
 * count pages whose read is still in flight. */
int64_t kvp_resident_bytes(int fd, uint64_t off, uint64_t len, int32_t uptodate);

/* Which residency mechanism kvp_resident_bytes uses here: 1 cachestat, 0 mincore. */
int kvp_have_cachestat(void);

/* Testing aid (added by the native engineer): make this ctx behave as if the
 * kernel lacked openat2 (KVP_FALLBACK_OPENAT2: component walk from root_fd,
 * refusing ".." and every symlink) and/or /proc (KVP_FALLBACK_PROC: reopen by a
 * second path resolution plus a dev/ino check), so the fallbacks can be tested
 * on a kernel that has both.  Bits only ever turn features off. */
#define KVP_FALLBACK_OPENAT2 1
#define KVP_FALLBACK_PROC 2
void kvp_ctx_force_fallback(struct kvp_ctx *ctx, int32_t which);
