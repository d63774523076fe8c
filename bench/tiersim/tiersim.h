/* tiersim: a slow storage tier simulated by a read-only FUSE passthrough.
 *
 * Shared state and the seams between the modules:
 *   tiersim.c  options, mount, INIT (max_background), the FUSE loop, shutdown
 *   nodes.c    the inode table and the metadata ops (lookup, getattr, open, readdir)
 *   tier.c     the near side: fetched chunks, the read op, reply threads, eviction
 *   fetch.c    the far side: fetches, slots, the bandwidth link, the timer thread
 *   hang.c     hang rules and the requests they hold
 *   control.c  the control socket (text commands, JSON replies)
 *
 * One mutex (g.lock) guards everything below that is not fixed at start: the
 * model is cheap to update and a single lock keeps the invariants (a chunk is
 * fetched, in flight, or neither; a held request is in exactly one list) easy
 * to check.  Nothing slow runs under it: no replies, no notifications, no I/O
 * on the backing files.
 */
#ifndef TIERSIM_H
#define TIERSIM_H

#define FUSE_USE_VERSION 312 /* fuse_loop_cfg_* (libfuse 3.12+); Debian 12 has 3.14 */
#define _GNU_SOURCE

#include <fuse_lowlevel.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>

#define TIERSIM_BLOCK 4096 /* st_blocks counts fetched bytes in 4 KiB blocks */

enum hang_kind { HANG_READ, HANG_READDIR, HANG_STAT, HANG_KINDS };
extern const char *const hang_kind_names[HANG_KINDS];

/* A unit of work for the reply threads.  run() does it; cancel() answers it
 * with an error instead, at shutdown, when nothing may be fetched any more. */
struct work {
    void (*run)(struct work *);
    void (*cancel)(struct work *);
    struct work *next;
};

/* One backing file or directory, keyed by its (st_dev, st_ino).  The FUSE
 * inode number is the node's address (as libfuse's passthrough_ll does).
 * Nodes are never freed while mounted: the tier's memory of which chunks are
 * fetched belongs to the backing file, not to the kernel's inode, so a FORGET
 * (the kernel dropping its inode under memory pressure) must not make a file
 * cold again.  Bound: one node per distinct backing file looked up during the
 * mount's life, ~100 bytes + its path + one bit per chunk. */
struct node {
    dev_t dev;
    ino_t ino;
    mode_t mode;
    char *path;             /* "/a/b" from the backing root; "/" for the root */
    uint64_t nlookup;       /* the kernel's references; 0: it has no inode, nothing to invalidate */
    uint64_t size;          /* st_size at the last lookup or getattr */
    uint64_t *fetched;      /* bitmap, one bit per chunk */
    uint64_t fetched_words;
    uint64_t fetched_chunks;
    struct fetch *fetches;  /* in flight or queued for a slot, this file's */
    unsigned held_reads;    /* READs of this file held by a hang */
    bool attr_dirty;        /* st_blocks changed: the kernel's cached attributes are stale */
    struct node *dirty_next;
    struct node *hash_next;
};

/* One chunk being fetched from the simulated far tier. */
struct fetch {
    struct node *node;
    uint64_t chunk;
    uint64_t bytes;              /* the chunk's bytes within the file */
    double ready_at;             /* monotonic seconds; set when it gets a slot */
    bool started;
    struct pending_read **waiters;
    unsigned nwaiters, capwaiters;
    struct fetch *node_next;     /* in node->fetches */
    struct fetch *queue_next;    /* in the slot queue, while not started */
};

/* A READ waiting for the fetches of its chunks. */
struct pending_read {
    struct work work;
    fuse_req_t req;
    struct node *node;
    uint64_t fsize;              /* node->size when it arrived */
    int fd;
    off_t off;
    size_t size;
    unsigned outstanding;        /* fetches still to complete */
};

/* Runtime settings: `set KEY VALUE` changes them; new fetches use them. */
struct settings {
    double latency_ms;
    double jitter_ms;            /* a fetch takes latency + uniform(0, jitter) */
    unsigned slots;              /* fetches in flight at most; 0 = unlimited */
    uint64_t bandwidth;          /* bytes/s over all fetches; 0 = unlimited */
};

struct counters {
    uint64_t fetches, fetched_bytes;       /* completed fetches */
    uint64_t reads, read_bytes;            /* READ replies sent with data */
    uint64_t read_errors;
    uint64_t in_flight, peak_in_flight;    /* fetches holding a slot */
    uint64_t queued;                       /* fetches waiting for a slot */
    uint64_t pending_reads;                /* READs waiting for fetches */
    uint64_t held[HANG_KINDS];             /* requests held by hangs now */
    uint64_t held_total;                   /* requests ever held */
    uint64_t evictions, evicted_chunks;    /* files evicted, chunks forgotten */
    uint64_t lookups, getattrs, opens, readdirs;
};

/* Fixed at start (command line). */
struct config {
    const char *backing;
    const char *mountpoint;
    const char *control;
    const char *subtype;
    uint64_t chunk_bytes;
    unsigned max_background;
    unsigned congestion_threshold;
    unsigned max_readahead;       /* 0: keep what the kernel offers */
    unsigned fuse_threads;
    unsigned reply_threads;
    double entry_timeout, attr_timeout;
    bool splice;
    bool clone_fd;
    uint64_t seed;
    pid_t parent_pid;             /* 0: none */
};

struct tiersim {
    struct config cfg;
    int backing_fd;
    struct fuse_session *se;
    struct node *root;

    pthread_mutex_t lock;
    struct settings set;
    struct counters n;
    /* what INIT negotiated, for `stats` */
    unsigned conn_max_background, conn_congestion_threshold;
    unsigned conn_max_readahead, kernel_max_readahead;
    bool conn_splice_write;
    bool initialized;             /* INIT answered: the mount serves */

    struct node **buckets;
    uint64_t nbuckets, nnodes;

    struct fetch **heap;          /* started fetches, earliest ready_at first */
    uint64_t heap_len, heap_cap;
    struct fetch *queue_head, *queue_tail;  /* fetches waiting for a slot */
    double link_free_at;          /* the bandwidth model's serial link */
    pthread_cond_t timer_cv;

    struct work *work_head, *work_tail;
    pthread_cond_t work_cv;

    struct hang_rule *rules;
    struct held *held;

    bool stopping;
    uint64_t rng;
};

extern struct tiersim g;

/* tiersim.c */
void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
double now_s(void);
/* Allocation failure is fatal, with a message: the simulator is a test tool,
 * and its death aborts the FUSE connection, which frees every waiting reader
 * (fs/fuse/dev.c fuse_dev_release -> fuse_abort_conn), so nothing hangs. */
void *xcalloc(size_t count, size_t size);
void *xrealloc(void *ptr, size_t size);
char *xstrdup(const char *s);

/* nodes.c */
struct node *node_of(fuse_ino_t ino);
fuse_ino_t node_id(const struct node *node);
struct node *node_create_root(const struct stat *st);
struct node *node_by_path(const char *path, int *err);
const char *node_relpath(const struct node *node);
void node_fill_attr(const struct node *node, struct stat *st);  /* under g.lock */
void nodes_collect(struct node ***out, uint64_t *count);        /* under g.lock */
void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name);
void op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup);
void op_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets);
void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi);
void op_readlink(fuse_req_t req, fuse_ino_t ino);
void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi);
void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi);
void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi);
void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                struct fuse_file_info *fi);
void op_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi);
void op_statfs(fuse_req_t req, fuse_ino_t ino);

/* tier.c: the near side (*_locked: under g.lock) */
void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
             struct fuse_file_info *fi);
bool chunk_is_fetched_locked(const struct node *node, uint64_t chunk);
void chunk_mark_fetched_locked(struct node *node, uint64_t chunk);
uint64_t tier_fetched_bytes(const struct node *node);             /* under g.lock */
uint64_t tier_evict_locked(struct node *node);
void work_push_locked(struct work *work);
int tier_start(void);
void tier_stop(void);

/* fetch.c: the far side */
struct fetch *fetch_find_locked(const struct node *node, uint64_t chunk);
struct fetch *fetch_new_locked(struct node *node, uint64_t chunk, double now);
void fetch_add_waiter_locked(struct fetch *f, struct pending_read *p);
bool fetch_is_instant_locked(void);
void fetch_settings_changed_locked(void);
void fetch_notify_attrs(const struct node *node);
int fetch_timer_start(void);
void fetch_timer_join(void);
void fetch_cancel_all_locked(void);

/* hang.c */
struct held;
bool hang_matches_locked(enum hang_kind kind, const char *path);
void hang_hold_locked(struct held *args, const char *path);
int hang_parse_kind(const char *word, unsigned *kinds);
int hang_add(unsigned kinds, const char *prefix);
uint64_t hang_release(unsigned kinds, const char *prefix, bool all);
void hang_cancel_all_locked(void);
/* The arguments of a request to hold, filled by the op that defers it. */
enum held_op { HELD_LOOKUP, HELD_GETATTR, HELD_READ, HELD_OPENDIR, HELD_READDIR };
struct held {
    struct work work;
    enum hang_kind kind;
    enum held_op op;
    fuse_req_t req;
    fuse_ino_t ino;
    char *name;
    size_t size;
    off_t off;
    struct fuse_file_info fi;
    bool has_fi;
    struct node *node;  /* for READ: counts node->held_reads */
    char *path;
    struct held *next;
};

/* control.c */
int control_start(void);
void control_stop(void);

#endif
