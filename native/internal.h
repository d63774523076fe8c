/*
 * internal.h: what the native files share.  cffi never reads it: the boundary
 * with Python is kvprefetch.h alone.  Include it first (it sets _GNU_SOURCE);
 * prefetch.c's header comment maps the files.
 */
#ifndef KVP_INTERNAL_H
#define KVP_INTERNAL_H

#define _GNU_SOURCE
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include "kvprefetch.h"

/* ---- limits shared by several files (each engine's own are in its file) -- */
#define KVP_MAX_CHUNK (64u << 20)     /* bytes per request; scratch is threads x chunk */
#define KVP_MAX_THREADS 256           /* confirming threads per batch (pool.c) */
#define KVP_FD_RESERVE 64             /* RLIMIT_NOFILE share left to the rest of the process */
#define KVP_RETRIES 8                 /* EAGAIN from openat2 or a read before FAILED */

#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))

#include <time.h>
static inline int64_t kvp_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

#pragma GCC visibility push(hidden)  /* none of this is the module's API */

struct kvp_engine;

struct kvp_ctx {
    struct kvp_config cfg;           /* validated copy; its names point into the table */
    const struct kvp_engine *engine;
    void *engine_data;               /* the engine's own: its setup makes it, teardown frees */
    /* Probed once; kvp_*_force_fallback may clear them while the queue's or the
     * prober's threads read them, hence atomic (a plain load on x86-64 and arm64). */
    atomic_int have_openat2;         /* openat2(2) is Linux 5.6+ */
    atomic_int have_proc;            /* /proc/self/fd usable for the race-free reopen */
    int no_xdev;                     /* resolve on root_fd's own mount only (open.c resolve) */
    int broken;                      /* errno that made the engine unusable; later batches fail */
    char *scratch;                   /* threads x chunk; the data is thrown away */
    size_t scratch_len;
};

/*
 * An engine, in the manner of fio's ioengines: one const instance per engine,
 * listed in prefetch.c's table (kvp_engines, kvp_engine_detect).  Two kinds, as
 * fio's sync and async: a batch engine (run; kvp_ctx_new, kvp_run_batch) or a
 * queue engine (warm; kvp_queue_new: queue.c's persistent threads call warm
 * for each file they have opened).  Only name, warm_mode and one of run or
 * warm are required.  The context calls detect (kvp_engine_detect), then, for a
 * batch engine, per context, setup once, run once per batch, teardown once
 * (also after a failed setup).
 */
struct kvp_engine {
    const char *name;       /* kvp_config.engine */
    const char *warm_mode;  /* kvp_config.warm_mode: "read" or "advise" */
    /* 1 when it can run here, else 0 and why (NUL-terminated, at most whylen
     * bytes, whylen > 0).  NULL: it can always run. */
    int (*detect)(char *why, size_t whylen);
    /* ---- a batch engine ---- */
    /* Validate the cfg fields only this engine reads and make c->engine_data
     * (cfg is already validated and clamped otherwise): 0 or an errno. */
    int (*setup)(struct kvp_ctx *c);
    /* Warm n > 0 items, which arrive FAILED with err 0 and size = done = 0, and
     * settle every one: 0, or -errno when the engine itself failed (every item
     * not warmed is then FAILED with that errno; set c->broken if later
     * batches cannot run either). */
    int (*run)(struct kvp_ctx *c, struct kvp_item *items, size_t n);
    /* Free what setup made, however far it got. */
    void (*teardown)(struct kvp_ctx *c);
    /* ---- a queue engine ---- */
    /* Warm one open file: fd is the read fd of a verified regular file
     * (kvp_item_open), span the bytes to warm, buf cfg.chunk bytes of scratch
     * (thrown away; other threads may write it too).  Settle the item READ
     * (done: bytes read) or FAILED, and return its errno (0: READ).  fd stays
     * open: the queue closes it, or holds it (KVP_ITEM_HOLD).  Called by many
     * threads at once with the same c, which it only reads. */
    int (*warm)(const struct kvp_ctx *c, struct kvp_item *it, int fd, uint64_t span, char *buf);
};

extern const struct kvp_engine kvp_engine_pread;          /* engine_pread.c */
extern const struct kvp_engine kvp_engine_fadvise;        /* engine_pread.c */
extern const struct kvp_engine kvp_engine_uring_read;     /* engine_uring.c */
extern const struct kvp_engine kvp_engine_uring_fadvise;  /* engine_uring.c */

/* The table's row for (name, warm_mode), or NULL (prefetch.c). */
const struct kvp_engine *kvp_engine_lookup(const char *name, const char *warm_mode);

/* ---- engine_pread.c ------------------------------------------------------- */
/* The head read: [0, span) of fd into buf, cfg.chunk bytes at a time, retrying
 * EINTR and (O_NONBLOCK dropped) EAGAIN; settles the item READ or FAILED and
 * returns its errno.  fd stays open.  The pread engine's warm, and the confirm
 * of io_uring/advise (pool.c). */
int kvp_read_head(const struct kvp_ctx *c, struct kvp_item *it, int fd, uint64_t span, char *buf);

/* Settle an item; -1, so item_open can `return settle(...)`. */
static inline int settle(struct kvp_item *it, int outcome, int err)
{
    it->outcome = outcome;
    it->err = err;
    return -1;
}

/* ---- open.c ------------------------------------------------------------- */
/* Probe openat2 and /proc once, for c->have_openat2 and c->have_proc. */
void kvp_open_detect(struct kvp_ctx *c);
/* Open, classify and check one item: a read fd and *span (the bytes to warm:
 * min(st_size, read_bytes)), or -1 when the item is settled (RESIDENT /
 * MISSING / REJECTED / FAILED).  keep (NULL: none) takes the read fd of a
 * file the page cache already holds, settled RESIDENT, instead of its close:
 * for a caller that holds warm files open for their consumer (KVP_ITEM_HOLD). */
int kvp_item_open(struct kvp_ctx *c, struct kvp_item *it, uint64_t *span, int *keep);
/* Resolve and verify one item: an O_PATH fd of a regular file, its stat in *st
 * and it->size set; or -1 with the item settled (MISSING / REJECTED / FAILED).
 * With c->no_xdev, a name on another mount beneath the root is settled FAILED
 * with EXDEV without a call into that mount's file system; an escape (a
 * symlink out of the root) stays REJECTED with EXDEV. */
int kvp_item_lookup(const struct kvp_ctx *c, struct kvp_item *it, struct stat *st);
/* Reopen lookup's O_PATH fd (closed here) as a read fd (O_NOATIME with
 * KVP_ITEM_NOATIME where permitted): the fd, or -errno. */
int kvp_item_reopen(const struct kvp_ctx *c, int pfd, const struct kvp_item *it,
                    const struct stat *st);
/* Drop O_NONBLOCK from fd (see open.c): 0, or -1 with errno. */
int kvp_clear_nonblock(int fd);

/* ---- residency.c -------------------------------------------------------- */
/* The storage-tier rule: 1 when st says [0, read_bytes) is on the near tier. */
int kvp_tier_resident(const struct stat *st, uint64_t read_bytes);

/* ---- pool.c ------------------------------------------------------------- */
/* Read each open item's head over cfg.threads threads: fds[i] (-1: settled
 * already) is item i's read fd and spans[i] its span.  Every fd is closed. */
void kvp_run_pool(struct kvp_ctx *c, struct kvp_item *items, size_t n,
                  const int *fds, const uint64_t *spans);

/* ---- advise.c: io_uring/advise's advise-then-confirm loop ----------------- */
/* A window of up to max_open open files, advised, then confirmed. */
struct kvp_window {
    int *fds;         /* read fd per item, -1 where the item settled on open */
    uint64_t *spans;  /* its span */
};
int kvp_window_alloc(struct kvp_window *w, uint32_t max_open);  /* 0 or ENOMEM */
void kvp_window_free(struct kvp_window *w);
/* How an advice engine advises: per file as soon as it is open (NULL: no
 * such step), and per window once all of it is open (NULL: none), the latter
 * returning 0 or -errno, which fails every item not yet confirmed. */
struct kvp_advice {
    void (*file)(struct kvp_ctx *c, int fd, uint64_t span);
    int (*window)(struct kvp_ctx *c, const int *fds, const uint64_t *spans, size_t m);
};
int kvp_advise_and_confirm(struct kvp_ctx *c, struct kvp_window *w, const struct kvp_advice *how,
                           struct kvp_item *items, size_t n);

#pragma GCC visibility pop

#endif
