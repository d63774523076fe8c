/*
 * prefetch.c: the C half of kvprefetchd._native (contract: kvprefetch.h): the
 * engine table, the batch context, kvp_run_batch.  The files (build_native.py
 * compiles every C file here into the one module):
 *   kvprefetch.h      the boundary with Python: cffi's cdef, every API below
 *   internal.h        what the C files share, and the engine skeleton (struct kvp_engine)
 *   prefetch.c        the engine table; kvp_run_batch hands a batch to its context's engine
 *   engine_pread.c    pread/read and fadvise/advise, the queue's engines (one file
 *                     each), and kvp_read_head, the head read every blocking reader shares
 *   engine_uring.c    io_uring/read and io_uring/advise, batch engines: one ring per context
 *   advise.c          io_uring/advise's advise-then-confirm loop
 *   pool.c            the confirming threads of a batch
 *   queue.c           the asynchronous queue (kvp_queue_*) that runs the queue engines:
 *                     persistent threads, files in as they come, outcomes out as they finish
 *   queue.h           the queue's insides, shared with depthctl.c, gauge.c and schedule.c
 *   depthctl.c        the queue's reads in flight per root (Little's law)
 *   gauge.c           when a read asked for now would be back, by the tier's own count
 *   schedule.c        which waiting file of a root the queue starts next
 *   open.c            per item: resolve beneath the root, classify, reopen
 *   residency.c       per item: already warm? (cachestat / mincore, tier rule)
 *   probe.c           the worker's fast path for warm heads, before any engine
 *   nodev.c           a root's view on a nodev mount, where the probe opens in one step
 *   inspect.c         check and evict: look at files, or drop their pages, reading nothing
 *   admit.c           the supervisor's admission: lexical gate, shard, queue room
 *   watch.c           inotify on held files: who else opens them
 * Per item: resolve rel beneath root_fd (openat2 RESOLVE_BENEATH, O_PATH),
 * fstat, refuse anything but a regular file, apply the residency rule, reopen
 * the verified inode for reading, warm [0, span) with span = min(st_size,
 * read_bytes), close.
 * kvp_item.err is the kernel's errno, except: a non-regular file is REJECTED
 * with EISDIR (directory), ELOOP (symlink, openat2-less walk only) or ENODEV
 * (FIFO, socket, device); an empty rel or unknown residency with EINVAL; an
 * inode swapped under the /proc-less reopen with ESTALE; a name behind another
 * mount beneath the root, on a ctx that stays on the root's mount (no_xdev),
 * FAILED with EXDEV.
 * A kvp_ctx runs one batch at a time: it is not thread-safe (a queue's threads
 * share theirs read-only).
 */
#include "internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>

/* The engines, each defined in an engine_*.c file.  To add one: a const
 * struct kvp_engine of either kind (internal.h documents the skeleton), its
 * line here, and its configured name in the Python registry's table
 * (daemon/kvprefetchd/engines/__init__.py), which asks this table whether an
 * engine can run here and which kind it is. */
static const struct kvp_engine *const engines[] = {
    &kvp_engine_pread,
    &kvp_engine_fadvise,
    &kvp_engine_uring_read,
    &kvp_engine_uring_fadvise,
};
#define KVP_NENGINES (sizeof engines / sizeof *engines)

const struct kvp_engine *kvp_engine_lookup(const char *name, const char *warm_mode)
{
    for (size_t i = 0; name && warm_mode && i < KVP_NENGINES; i++)
        if (!strcmp(engines[i]->name, name) && !strcmp(engines[i]->warm_mode, warm_mode))
            return engines[i];
    return NULL;
}

size_t kvp_engines(struct kvp_engine_name *out, size_t n)
{
    for (size_t i = 0; i < n && i < KVP_NENGINES; i++)
        out[i] = (struct kvp_engine_name){ engines[i]->name, engines[i]->warm_mode,
                                           engines[i]->warm != NULL };
    return KVP_NENGINES;
}

int kvp_engine_detect(const char *engine, const char *warm_mode, char *why, size_t whylen)
{
    char none[1];
    const struct kvp_engine *e = kvp_engine_lookup(engine, warm_mode);
    if (!why || whylen == 0)
        why = none, whylen = sizeof none;
    if (!e) {
        snprintf(why, whylen, "no engine %s with warm mode %s", engine ? engine : "(null)",
                 warm_mode ? warm_mode : "(null)");
        return 0;
    }
    if (e->detect)
        return e->detect(why, whylen);
    why[0] = '\0';
    return 1;
}

void kvp_ctx_free(struct kvp_ctx *c)
{
    if (!c)
        return;
    if (c->engine->teardown)
        c->engine->teardown(c);
    if (c->scratch)
        munmap(c->scratch, c->scratch_len);
    free(c);
}

struct kvp_ctx *kvp_ctx_new(const struct kvp_config *cfg, int *err)
{
    struct kvp_ctx *c = NULL;
    struct rlimit rl;
    const struct kvp_engine *engine = cfg ? kvp_engine_lookup(cfg->engine, cfg->warm_mode) : NULL;
    int e = EINVAL;
    if (!engine || !engine->run || cfg->chunk == 0 || cfg->chunk > KVP_MAX_CHUNK ||
        cfg->max_open == 0)
        goto fail;
    if (!(c = calloc(1, sizeof *c)) && (e = ENOMEM))
        goto fail;
    e = ENOMEM;
    c->engine = engine;
    c->cfg = *cfg;
    c->cfg.engine = engine->name;  /* the table's: the caller's strings may go */
    c->cfg.warm_mode = engine->warm_mode;
    c->cfg.threads = cfg->threads == 0 ? 1 : MIN(cfg->threads, (uint32_t)KVP_MAX_THREADS);
    /* The fd budget: each thread holds one fd beyond the window while reopening. */
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur > 0) {
        rlim_t room = rl.rlim_cur - MIN(rl.rlim_cur - 1, (rlim_t)(KVP_FD_RESERVE + c->cfg.threads));
        c->cfg.max_open = (uint32_t)MIN((rlim_t)c->cfg.max_open, room);
    }
    c->cfg.threads = MIN(c->cfg.threads, c->cfg.max_open);
    kvp_open_detect(c);
    c->scratch_len = (size_t)c->cfg.threads * c->cfg.chunk;
    c->scratch = mmap(NULL, c->scratch_len, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (c->scratch == MAP_FAILED) {
        c->scratch = NULL;
        goto fail;
    }
    if (engine->setup && (e = engine->setup(c)) != 0)
        goto fail;
    return c;
fail:
    kvp_ctx_free(c);
    if (err)
        *err = e;
    return NULL;
}

int kvp_run_batch(struct kvp_ctx *c, struct kvp_item *items, size_t n)
{
    int e = !c ? EINVAL : c->broken;
    if (n && !items)
        return -EINVAL;
    for (size_t i = 0; i < n; i++) {
        items[i].outcome = KVP_OUT_FAILED;  /* every path below overwrites it */
        items[i].err = e;
        items[i].size = items[i].done = 0;
    }
    if (e || n == 0)
        return -e;
    return c->engine->run(c, items, n);
}

void kvp_ctx_force_fallback(struct kvp_ctx *c, int32_t which)
{
    if (c && (which & KVP_FALLBACK_OPENAT2))
        c->have_openat2 = 0;
    if (c && (which & KVP_FALLBACK_PROC))
        c->have_proc = 0;
}
