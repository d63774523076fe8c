/*
 * engine_uring.c: engines io_uring/read (IORING_OP_READ of every head in
 * chunks, queue_depth in flight) and io_uring/advise (IORING_OP_FADVISE
 * WILLNEED, then the confirm of advise.c).  The ring is made once per
 * context and reused for every batch.  The only file that knows liburing:
 * built without it, both engines say so from detect and refuse setup (ENOSYS).
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef KVP_HAVE_LIBURING
#include <liburing.h>
#endif

#define KVP_MAX_QD 4096            /* io_uring SQ entries (the kernel allows 32768) */
#define KVP_FADV_PIECE (1u << 30)  /* IORING_OP_FADVISE length is the 32-bit sqe->len */
/* io_uring reads in flight per file: 1 = a file's next chunk is submitted when
 * the previous one completes, queue_depth spread over more files.  "All chunks
 * at once" measured no better (bench/c/uring_heads.c -d 0; see its header). */
#define KVP_URING_PER_FILE 1

static int uring_detect(char *why, size_t whylen)
{
    const char *msg = "built without liburing";
    int ok = 0;
#ifdef KVP_HAVE_LIBURING
    struct io_uring ring;
    struct io_uring_probe *p = NULL;
    /* ENOSYS: no io_uring; EPERM: kernel.io_uring_disabled, or seccomp. */
    int r = io_uring_queue_init(4, &ring, 0);
    if (r < 0)
        msg = strerror(-r);
    else if (!(p = io_uring_get_probe_ring(&ring)))
        msg = "io_uring_get_probe failed (kernel < 5.6)";
    else if (!io_uring_opcode_supported(p, IORING_OP_READ))
        msg = "IORING_OP_READ not supported (kernel < 5.6)";
    else if (!io_uring_opcode_supported(p, IORING_OP_FADVISE))
        msg = "IORING_OP_FADVISE not supported (kernel < 5.6)";
    else
        ok = 1, msg = "";
    if (p)
        io_uring_free_probe(p);
    if (r == 0)
        io_uring_queue_exit(&ring);
    if (r < 0) {
        snprintf(why, whylen, "io_uring_queue_init: %s", msg);
        return 0;
    }
#endif
    snprintf(why, whylen, "%s", msg);
    return ok;
}

#ifdef KVP_HAVE_LIBURING
struct ureq { uint32_t slot, len; uint64_t off; };  /* one read in flight */
struct uslot {                                     /* one open file being read */
    struct kvp_item *it;                           /* NULL: slot free */
    uint64_t span, next, done;
    int fd, err, eof, tries, queued;
    uint32_t inflight;
};

struct uring {  /* c->engine_data */
    struct io_uring ring;
    int ring_ok;
    /* io_uring/read: */
    struct ureq *reqs;      /* queue_depth requests; free ones stacked in rfree */
    uint32_t *rfree, nrfree;
    struct uslot *slots;    /* max_open slots; free ones stacked in sfree */
    uint32_t *sfree, nsfree;
    uint32_t *ready, rhead, rlen;  /* FIFO of slots that may take another chunk */
    /* io_uring/advise: */
    struct kvp_window window;
};

/* At most queue_depth reads are outstanding and every submit flushes the SQ
 * (queue_depth entries), so io_uring_get_sqe() cannot return NULL here. */
static void uring_prep(struct kvp_ctx *c, uint32_t r, uint32_t si, uint64_t off, uint32_t len)
{
    struct uring *u = c->engine_data;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
    u->reqs[r] = (struct ureq){ si, len, off };
    /* Every read targets the same scratch: the bytes are thrown away, only the
     * page-cache side effect matters, so concurrent reads may overwrite each
     * other there.  Registered buffers (READ_FIXED) and registered files
     * measured no faster (bench/c/uring_heads.c -B, -F), so plain READ. */
    io_uring_prep_read(sqe, u->slots[si].fd, c->scratch, len, off);
    io_uring_sqe_set_data64(sqe, r);
    u->slots[si].inflight++;
}

static void ready_push(struct kvp_ctx *c, uint32_t si)
{
    struct uring *u = c->engine_data;
    struct uslot *s = &u->slots[si];
    if (!s->queued && !s->eof && !s->err && s->next < s->span && s->inflight < KVP_URING_PER_FILE) {
        u->ready[(u->rhead + u->rlen++) % c->cfg.max_open] = si;
        s->queued = 1;
    }
}

static void slot_finish(struct uring *u, uint32_t si)
{
    struct uslot *s = &u->slots[si];
    s->it->done = s->done;
    settle(s->it, s->err ? KVP_OUT_FAILED : KVP_OUT_READ, s->err);
    close(s->fd);
    s->it = NULL;
    u->sfree[u->nsfree++] = si;
}

static void uring_complete(struct kvp_ctx *c, uint32_t r, int res)
{
    struct uring *u = c->engine_data;
    struct ureq *q = &u->reqs[r];
    struct uslot *s = &u->slots[q->slot];
    s->inflight--;
    if ((res == -EINTR || res == -EAGAIN) && s->tries++ < KVP_RETRIES &&
        (res == -EINTR || !kvp_clear_nonblock(s->fd))) {
        uring_prep(c, r, q->slot, q->off, q->len);  /* resubmit as is */
        return;
    }
    if (res > 0 && (uint32_t)res < q->len) {  /* short read: continue from there */
        s->done += (uint64_t)res;
        uring_prep(c, r, q->slot, q->off + (uint64_t)res, q->len - (uint32_t)res);
        return;
    }
    if (res > 0)
        s->done += (uint64_t)res;
    else if (res == 0)
        s->eof = 1;  /* EOF: the file shrank since fstat */
    else if (!s->err)
        s->err = -res;
    u->rfree[u->nrfree++] = r;
    if (s->inflight == 0 && (s->eof || s->err || s->next >= s->span))
        slot_finish(u, q->slot);
    else
        ready_push(c, q->slot);
}

/* Wait for at least one completion and hand every CQE to fn (NULL: count
 * only).  Returns the number reaped, or -errno if the ring itself failed. */
static int uring_reap(struct kvp_ctx *c, void (*fn)(struct kvp_ctx *, uint32_t, int))
{
    struct uring *u = c->engine_data;
    struct io_uring_cqe *cqe;
    unsigned h, seen = 0;
    int r = io_uring_submit_and_wait(&u->ring, 1);
    if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY)
        return c->broken = -r, r;  /* requests may still complete: ctx unusable */
    io_uring_for_each_cqe(&u->ring, h, cqe) {
        if (fn)
            fn(c, (uint32_t)io_uring_cqe_get_data64(cqe), cqe->res);
        seen++;
    }
    io_uring_cq_advance(&u->ring, seen);
    return (int)seen;
}

static int uring_read(struct kvp_ctx *c, struct kvp_item *items, size_t n)
{
    struct uring *u = c->engine_data;
    size_t i = 0;
    for (;;) {
        /* Fill the ring: chunks of open files first (finishing files frees
         * fds), then open more files (synchronously), max_open at most. */
        while (u->nrfree > 0) {
            if (u->rlen > 0) {
                uint32_t si = u->ready[u->rhead];
                struct uslot *s = &u->slots[si];
                u->rhead = (u->rhead + 1) % c->cfg.max_open;
                u->rlen--;
                s->queued = 0;
                if (!s->it || s->eof || s->err || s->next >= s->span)
                    continue;  /* settled while queued (possible if PER_FILE > 1) */
                uint32_t len = (uint32_t)MIN(s->span - s->next, (uint64_t)c->cfg.chunk);
                uring_prep(c, u->rfree[--u->nrfree], si, s->next, len);
                s->next += len;
                ready_push(c, si);
            } else if (u->nsfree > 0 && i < n) {
                uint64_t span;
                int fd = kvp_item_open(c, &items[i], &span, NULL);
                if (fd >= 0) {
                    uint32_t si = u->sfree[--u->nsfree];
                    int queued = u->slots[si].queued;  /* a stale FIFO entry serves it */
                    u->slots[si] = (struct uslot){ .it = &items[i], .span = span, .fd = fd,
                                                   .queued = queued };
                    ready_push(c, si);
                }
                i++;
            } else {
                break;
            }
        }
        if (u->nrfree == c->cfg.queue_depth)
            return 0;  /* nothing in flight, nothing left to open */
        int r = uring_reap(c, uring_complete);
        if (r < 0) {  /* settle what is open and what is left */
            for (uint32_t si = 0; si < c->cfg.max_open; si++)
                if (u->slots[si].it) {
                    u->slots[si].err = -r;
                    slot_finish(u, si);
                }
            for (; i < n; i++)
                settle(&items[i], KVP_OUT_FAILED, -r);
            return r;
        }
    }
}

/* IORING_OP_FADVISE(WILLNEED) for a window of open files.  The kernel always
 * punts WILLNEED to an io-wq worker (io_uring/advise.c io_fadvise_force_async),
 * so the ring only moves readahead submission off this thread.  Results are
 * advisory: the confirm pass decides the outcome. */
static int uring_fadvise(struct kvp_ctx *c, const int *fds, const uint64_t *spans, size_t m)
{
    struct uring *u = c->engine_data;
    uint32_t inflight = 0;
    size_t k = 0;
    uint64_t off = 0;
    for (;;) {
        for (; inflight < c->cfg.queue_depth; inflight++) {
            for (; k < m && (fds[k] < 0 || off >= spans[k]); k++)
                off = 0;
            if (k == m)
                break;
            uint64_t len = MIN(spans[k] - off, (uint64_t)KVP_FADV_PIECE);
            io_uring_prep_fadvise(io_uring_get_sqe(&u->ring), fds[k], off, (off_t)len, POSIX_FADV_WILLNEED);
            off += len;
        }
        if (inflight == 0)
            return 0;
        int r = uring_reap(c, NULL);
        if (r < 0)
            return r;
        inflight -= (uint32_t)r;
    }
}

static int uring_advise(struct kvp_ctx *c, struct kvp_item *items, size_t n)
{
    static const struct kvp_advice how = { .window = uring_fadvise };
    struct uring *u = c->engine_data;
    return kvp_advise_and_confirm(c, &u->window, &how, items, n);
}

/* The read engine's slots, requests and index arrays, in one block. */
static int uring_slots_alloc(struct kvp_ctx *c, struct uring *u)
{
    uint32_t qd = c->cfg.queue_depth, mo = c->cfg.max_open;
    /* one block: slots, then requests, then the three index arrays */
    if (!(u->slots = calloc(1, mo * sizeof *u->slots + qd * sizeof *u->reqs +
                               (qd + 2 * (size_t)mo) * sizeof(uint32_t))))
        return ENOMEM;
    u->reqs = (struct ureq *)(u->slots + mo);
    u->rfree = (uint32_t *)(u->reqs + qd);
    u->sfree = u->rfree + qd;
    u->ready = u->sfree + mo;
    for (u->nrfree = 0; u->nrfree < qd; u->nrfree++)
        u->rfree[u->nrfree] = qd - 1 - u->nrfree;
    for (u->nsfree = 0; u->nsfree < mo; u->nsfree++)
        u->sfree[u->nsfree] = mo - 1 - u->nsfree;
    return 0;
}

/* The ring, and what the engine's run needs around it (reads: slots and
 * requests; advice: a window of fds). */
static int ring_setup(struct kvp_ctx *c, int reads)
{
    struct uring *u = calloc(1, sizeof *u);
    if (!(c->engine_data = u))
        return ENOMEM;
    int e = reads ? uring_slots_alloc(c, u) : kvp_window_alloc(&u->window, c->cfg.max_open);
    if (e)
        return e;
    /* COOP_TASKRUN (5.19): buffered-read completions run as task_work when
     * we wait in io_uring_enter anyway, without an IPI; older kernels
     * refuse the flag with EINVAL: retry without it. */
    int r = io_uring_queue_init(c->cfg.queue_depth, &u->ring, IORING_SETUP_COOP_TASKRUN);
    if (r == -EINVAL)
        r = io_uring_queue_init(c->cfg.queue_depth, &u->ring, 0);
    if (r < 0)
        return -r;
    u->ring_ok = 1;
    return 0;
}

static void uring_teardown(struct kvp_ctx *c)
{
    struct uring *u = c->engine_data;
    if (!u)
        return;
    if (u->ring_ok)
        io_uring_queue_exit(&u->ring);
    free(u->slots);
    kvp_window_free(&u->window);
    free(u);
}

#else  /* built without liburing: setup refuses both engines, so run is never called */
static int ring_setup(struct kvp_ctx *c, int reads)
{
    (void)c, (void)reads;
    return ENOSYS;
}

static void uring_teardown(struct kvp_ctx *c)
{
    (void)c;
}

static int uring_read(struct kvp_ctx *c, struct kvp_item *items, size_t n)
{
    (void)c, (void)items, (void)n;
    return -ENOSYS;
}

static int uring_advise(struct kvp_ctx *c, struct kvp_item *items, size_t n)
{
    return uring_read(c, items, n);
}
#endif

/* Both engines: queue_depth is theirs to check, before the ring (so a bad
 * config is EINVAL in every build). */
static int uring_setup(struct kvp_ctx *c, int reads)
{
    if (c->cfg.queue_depth == 0)
        return EINVAL;
    c->cfg.queue_depth = MIN(c->cfg.queue_depth, (uint32_t)KVP_MAX_QD);
    return ring_setup(c, reads);
}

static int uring_read_setup(struct kvp_ctx *c) { return uring_setup(c, 1); }
static int uring_advise_setup(struct kvp_ctx *c) { return uring_setup(c, 0); }

const struct kvp_engine kvp_engine_uring_read = {
    .name = "io_uring",
    .warm_mode = "read",
    .detect = uring_detect,
    .setup = uring_read_setup,
    .run = uring_read,
    .teardown = uring_teardown,
};

const struct kvp_engine kvp_engine_uring_fadvise = {
    .name = "io_uring",
    .warm_mode = "advise",
    .detect = uring_detect,
    .setup = uring_advise_setup,
    .run = uring_advise,
    .teardown = uring_teardown,
};
