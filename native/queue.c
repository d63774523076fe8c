/*
 * queue.c: the asynchronous warm-up queue.  Files are submitted and their
 * outcomes reaped as they complete: persistent threads, no batch boundary, and
 * as many reads in flight per root as that root's file system rewards.
 *
 * What a thread does with each file it has opened is its engine's (struct
 * kvp_engine's warm: pread, or fadvise then a confirming read; engine_pread.c);
 * the threads, depth, schedule and lanes here are the same for every engine.
 *
 * Why not a fixed pool: on a tier whose first read waits 10-200 ms for a remote
 * fetch, warm-up time is files x latency / reads in flight (Little's law), so a
 * fixed 16 threads per worker left a tier with room for hundreds of fetches
 * idle (issue 13: 12.9 s where a 256-thread pool took 1.9 s); on a local disk,
 * hundreds of threads only queue behind the device.  So each root gets its own
 * depth, moved by depthctl.c from the service time of its reads; which of a
 * root's waiting files starts next is schedule.c's choice (clients in turn, the
 * deadlines that can still be met, then the newest request).  A request's files
 * with a deadline are judged on arrival (schedule.c): those that cannot be read
 * in time settle EXPIRED at once (or, judged by the tier's count, stand by for a
 * slot it has free), the others start without waiting for depth.
 *
 * A root that hangs (a dead tier) keeps the threads it holds, but those reads
 * stop counting against its depth once they have been running longer than the
 * stall time, and other roots are served by other threads: one root cannot
 * take the worker.  A file not finished by the deadline is settled FAILED with
 * ETIMEDOUT at once; its thread, stuck in the kernel, frees it when (if) the
 * read returns.  Threads are bounded by max_threads; the files waiting by the
 * supervisor's queue_limit; every outcome crosses to Python through reap.
 *
 * Names behind another mount beneath their root (a FUSE or NFS mount in a
 * subdirectory) have a lane of their own.  A root's one FIFO put them ahead of
 * the root's own files, and each took a thread once the one before it had
 * stalled: a hung FUSE server under an ext4 root, sent 1,100 such names in one
 * fire-and-forget request, left 0 of 16 healthy files of that root served in
 * 5 s (still 0 after 23 s) and 192 threads stuck per worker.  So the roots'
 * lanes resolve on each root's own mount only (base.no_xdev: RESOLVE_NO_XDEV,
 * open.c), which stops a walk at a mount point before the mounted file system
 * is asked anything; a name refused there (FAILED, EXDEV: never otherwise)
 * moves, at the cost of two lookups on the root's own file system, to the
 * other-mount lane: one FIFO for every root, read across mounts by at most
 * cfg.other_mount_threads threads (4 by default) apart from max_threads.  The
 * probe cannot tell these names apart (under RESOLVE_CACHED a mount point and
 * a cold dentry both say EAGAIN), the lookup here can, for every root, probed
 * or not.  The lane's reads stall after max(2 s, 20 x its service time), like
 * a root's, but a stalled one keeps its thread and its slot: the lane never
 * holds more than its cap.  Once every slot is held by a stalled read, the
 * lane is stuck: the files waiting and every name that comes after are settled
 * FAILED with EHOSTDOWN (`mount_unresponsive`) at once, instead of queueing
 * until file_timeout; a read that returns reopens it.  The root's own files
 * are served at full depth whatever the lane does; the price is that a hung
 * mount stops warm-ups on every other mount beneath any root of the worker
 * while it hangs (list such a mount as a root of its own: it then has a lane,
 * a depth and a stall count of its own).
 */
#include "internal.h"
#include "queue.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define KVP_QUEUE_STACK (128u << 10)  /* a worker thread's stack: it calls no deep code */
#define KVP_QUEUE_SCRATCH 16u         /* read buffers shared by all threads (see below) */

#define now_ns kvp_now_ns

static void *thread_main(void *arg);
static void *lane_main(void *arg);

/* Threads decided on under the lock, started once it is released: pthread_create
 * (an mmap of the stack, a clone) is not done holding the lock every thread and
 * the reaper wait on.  They are counted in q->threads or q->lane.threads from
 * the moment they are decided on, so the rules that decide see them at once. */
struct spawn {
    uint32_t roots, lane;  /* threads to start for the roots' lanes and the other-mount lane */
};

/* Start what was decided on; called without the lock, by a thread the queue
 * cannot be freed under (a counted one, or the caller of submit and tick).  A
 * thread the system refuses is uncounted again. */
static void start_threads(struct kvp_queue *q, struct spawn *sp)
{
    uint32_t refused_roots = 0, refused_lane = 0;
    pthread_t tid;
    for (; sp->roots > 0; sp->roots--)
        refused_roots += pthread_create(&tid, &q->attr, thread_main, q) != 0;
    for (; sp->lane > 0; sp->lane--)
        refused_lane += pthread_create(&tid, &q->attr, lane_main, q) != 0;
    if (refused_roots + refused_lane == 0)
        return;
    pthread_mutex_lock(&q->mu);
    q->threads -= refused_roots;  /* the system refused: serve with what there is */
    q->lane.threads -= refused_lane;
    q->spawn_failures += refused_roots + refused_lane;
    pthread_cond_broadcast(&q->exited);
    pthread_mutex_unlock(&q->mu);
}

/* Lists (schedule.c's kvp_list_*): pending per root and in the lane, running, done. */

/* The completion list went from empty to not: wake the reaper's poll. */
static void done_push(struct kvp_queue *q, struct qitem *it)
{
    int was_empty = q->done.n == 0;
    kvp_list_push(&q->done, it);
    if (was_empty) {
        uint64_t one = 1;
        ssize_t w = write(q->efd, &one, sizeof one);
        (void)w;  /* EAGAIN only when the counter is full: it is readable anyway */
    }
}

/* ---- roots ---------------------------------------------------------------- */
static struct qroot *root_of(struct kvp_queue *q, int fd)
{
    for (uint32_t i = 0; i < q->nroots; i++)
        if (q->roots[i].fd == fd)
            return &q->roots[i];
    if (q->nroots == KVP_QUEUE_MAX_ROOTS)
        return &q->roots[KVP_QUEUE_MAX_ROOTS - 1];  /* shares the last slot's depth */
    struct qroot *r = &q->roots[q->nroots++];
    memset(r, 0, sizeof *r);
    r->fd = fd;
    kvp_depth_init(&r->depth, q->cfg.initial_depth, q->cfg.max_threads);
    kvp_gauge_init(&r->gauge);
    return r;
}

/* May the root start another read?  Stalled reads hold threads, not depth; files
 * with a deadline, admitted on arrival, are not held by it (schedule.c). */
static int root_ready(const struct qroot *r)
{
    return kvp_sched_ready(r);
}

/* The next file to start, taking the roots in turn; NULL when none may start.
 * A standby file only when no root has another: it goes into a slot the tier
 * has free now, and only a thread with nothing else to do looks (it reads the
 * tier's count: schedule.c). */
static struct qitem *next_item(struct kvp_queue *q)
{
    for (uint32_t k = 0; k < q->nroots; k++) {
        struct qroot *r = &q->roots[(q->turn + k) % q->nroots];
        if (root_ready(r)) {
            q->turn = (q->turn + k + 1) % q->nroots;
            return kvp_sched_take(r, now_ns());
        }
    }
    for (uint32_t k = 0; k < q->nroots; k++) {
        struct qitem *qi = q->roots[k].standby.n ? kvp_sched_standby_take(&q->roots[k], now_ns())
                                                 : NULL;
        if (qi) {
            q->standby_reads++;
            return qi;
        }
    }
    return NULL;
}

static int work_waiting(const struct kvp_queue *q)
{
    for (uint32_t k = 0; k < q->nroots; k++)
        if (root_ready(&q->roots[k]))
            return 1;
    return 0;
}

/* Files wait beside this one: on its root, or in the other-mount lane. */
static int backlog_of(const struct kvp_queue *q, const struct qitem *qi)
{
    return qi->other_mount ? q->lane.pending.n > 0 : q->roots[qi->root].npending > 0;
}

/* A pending file off its list: its root's (schedule.c), or the lane's. */
static void unpend(struct kvp_queue *q, struct qitem *qi)
{
    if (qi->other_mount) {
        kvp_list_unlink(&q->lane.pending, qi);
    } else if (qi->standby) {
        kvp_list_unlink(&q->roots[qi->root].standby, qi);
        qi->standby = 0;
    } else {
        kvp_sched_unlink(&q->roots[qi->root], qi);
    }
}

/* ---- the other-mount lane ---------------------------------------------------- */
/* Every slot held by a read past the lane's stall time: nothing more starts. */
static int lane_stuck(const struct qlane *l)
{
    return l->running >= l->cap && l->stalled >= l->running;
}

/* Settled now, unread: the lane cannot start it (its server is not answering). */
static void lane_refuse(struct kvp_queue *q, struct qitem *qi)
{
    settle(&qi->it, KVP_OUT_FAILED, EHOSTDOWN);
    q->lane.refused++;
    done_push(q, qi);
}

/* Called with the lock held, as maybe_spawn is, for the lane's own threads. */
static void lane_spawn(struct kvp_queue *q, struct spawn *sp)
{
    struct qlane *l = &q->lane;
    if (l->threads > l->running || l->threads >= l->cap || q->stopping || l->pending.n == 0)
        return;
    l->threads++;
    sp->lane++;
}

/* A file a root's lane found behind another mount: to the other-mount lane, or
 * refused at once when that lane is stuck.  Called with the lock held. */
static void lane_take(struct kvp_queue *q, struct qitem *qi, struct spawn *sp)
{
    struct qlane *l = &q->lane;
    l->moved++;
    qi->other_mount = 1;
    qi->stalled = 0;
    qi->it.outcome = KVP_OUT_FAILED;
    qi->it.err = 0;
    qi->it.size = qi->it.done = 0;
    if (lane_stuck(l)) {
        lane_refuse(q, qi);
        return;
    }
    q->deadlines += qi->it.deadline_ns > 0;
    kvp_list_push(&l->pending, qi);
    lane_spawn(q, sp);
    pthread_cond_signal(&q->lane_work);
}

/* ---- the work of one file ---------------------------------------------- */
/* A root's lane resolves on the root's own mount (base); the other-mount lane
 * crosses mounts (across).  The engine warms into a shared scratch buffer: the
 * bytes are thrown away, so threads may overwrite each other's data; sixteen
 * buffers keep two cores off the same cache lines while a thousand threads
 * cost sixteen chunks of memory, not a thousand. */
static void process(struct kvp_queue *q, struct qitem *qi, const struct kvp_gauge *gauge)
{
    struct kvp_ctx *c = qi->other_mount ? &q->across : &q->base;
    char *buf = q->scratch + (size_t)(qi->seq % KVP_QUEUE_SCRATCH) * c->cfg.chunk;
    uint64_t span = 0;
    /* On a hold root a file found warm is held too: its consumer's open then
     * finds it open, which is what spares that open a round trip to the
     * server (s3fs: a HEAD, as long as to fetch a small object). */
    int fd = kvp_item_open(c, &qi->it, &span,
                           (qi->it.flags & KVP_ITEM_HOLD) ? &qi->held_fd : NULL);
    if (fd < 0)
        return;
    if (gauge && qi->ahead >= 0) {
        /* What is ahead of its read as it goes to the tier, the open done: other readers
         * (the other workers, the consumers) may have gone since it was admitted, and
         * a burst's reads are in by now.  Not less than at its admission: its request's
         * files admitted before it may not have reached the tier yet. */
        int64_t waiting = kvp_gauge_waiting(gauge);
        if (waiting > qi->ahead)
            qi->ahead = waiting > INT32_MAX ? INT32_MAX : (int32_t)waiting;
        qi->asked = now_ns();
    }
    if (c->engine->warm(c, &qi->it, fd, span, buf) == 0 && (qi->it.flags & KVP_ITEM_HOLD))
        qi->held_fd = fd;  /* the reaper's now (serve() closes it if nobody will reap it) */
    else
        close(fd);
}

/* ---- threads ---------------------------------------------------------------- */

/* Called with the lock held: one more thread (started once the lock is
 * released: start_threads) when work waits, every thread holds a file, and the
 * cap allows.  One at a time: the new thread, once it has a file, spawns the
 * next if work still waits, so a burst grows the pool at thread-creation
 * speed.  Not "none is idle": a thread between two files (on the lock) is
 * neither, and files that take microseconds (resident, missing, or moved to
 * the other-mount lane) grew the pool far past the depth that way: 1,100 names
 * under another mount gave 200-500 threads per worker. */
static void maybe_spawn(struct kvp_queue *q, struct spawn *sp)
{
    if (q->threads > q->busy || q->threads >= q->cfg.max_threads || q->stopping ||
        !work_waiting(q))
        return;
    q->threads++;
    sp->roots++;  /* started by start_threads once the lock is released */
}

/* Called with the lock held, at a submission and a tick: while files stand by, a
 * thread with nothing else to do looks at the tier's count (next_item); one is
 * started when there is none.  A thread reading looks again as its read ends. */
static void standby_look(struct kvp_queue *q, struct spawn *sp)
{
    uint32_t k = 0;
    while (k < q->nroots && q->roots[k].standby.n == 0)
        k++;
    if (k == q->nroots || q->stopping)
        return;  /* nothing stands by */
    if (q->threads == 0) {
        q->threads++;
        sp->roots++;
    }
    pthread_cond_signal(&q->work);
}

/* The next file for a thread of the roots' lanes (lane 0) or of the other-mount
 * lane (1); NULL when none may start. */
static struct qitem *take_next(struct kvp_queue *q, int lane)
{
    struct qitem *qi;
    if (!lane)
        return next_item(q);
    if (!(qi = q->lane.pending.head))
        return NULL;
    kvp_list_unlink(&q->lane.pending, qi);
    return qi;
}

/* One thread of either lane: take a file, read it unlocked, settle it.  A file
 * a root's lane finds behind another mount moves to the other lane instead. */
static void serve(struct kvp_queue *q, int lane)
{
    struct qlane *l = &q->lane;
    uint32_t *idle = lane ? &l->idle : &q->idle;
    pthread_cond_t *work = lane ? &q->lane_work : &q->work;
    struct spawn sp = { 0, 0 };
    pthread_mutex_lock(&q->mu);
    for (;;) {
        struct qitem *qi;
        while (!q->stopping && !(qi = take_next(q, lane))) {
            if (sp.roots + sp.lane > 0) {  /* decided on last round: start them, then look again */
                pthread_mutex_unlock(&q->mu);
                start_threads(q, &sp);
                pthread_mutex_lock(&q->mu);
                continue;
            }
            (*idle)++;
            pthread_cond_wait(work, &q->mu);
            (*idle)--;
        }
        if (q->stopping)
            break;
        if (qi->it.deadline_ns > 0) {
            q->deadlines--;
            if (now_ns() > qi->it.deadline_ns) {
                settle(&qi->it, KVP_OUT_EXPIRED, 0);  /* no read, no depth taken */
                done_push(q, qi);
                continue;
            }
        }
        struct qroot *r = &q->roots[qi->root];
        struct kvp_depth *depth = lane ? &l->depth : &r->depth;
        uint32_t *running = lane ? &l->running : &r->running;
        uint32_t *stalled = lane ? &l->stalled : &r->stalled;
        (*running)++;
        q->busy += !lane;
        if (!lane && qi->it.deadline_ns > 0) {
            qi->timed_live = 1;
            r->timed_live++;
        }
        qi->started = now_ns();
        kvp_list_push(&q->running, qi);
        if (lane)
            lane_spawn(q, &sp);
        else
            maybe_spawn(q, &sp);
        struct kvp_gauge gauge = r->gauge;  /* its fd stays while the queue does */
        pthread_mutex_unlock(&q->mu);
        start_threads(q, &sp);

        process(q, qi, lane || gauge.fd < 0 ? NULL : &gauge);

        int64_t finished = now_ns();
        pthread_mutex_lock(&q->mu);
        kvp_list_unlink(&q->running, qi);
        (*running)--;
        q->busy -= !lane;
        if (qi->timed_live) {
            qi->timed_live = 0;
            r->timed_live--;
        }
        if (qi->stalled)
            (*stalled)--;
        /* Only reads that did I/O tell the depth anything: a resident check or
         * a missing file costs microseconds whatever the depth. */
        if (qi->it.outcome == KVP_OUT_READ && qi->it.done > 0) {
            kvp_depth_sample(depth, finished - qi->started, *running - (lane ? 0 : *stalled) + 1,
                             backlog_of(q, qi), finished);
            if (!lane && qi->asked > 0)  /* counted as it went to the tier (process) */
                kvp_gauge_sample(&r->gauge, qi->ahead, finished - qi->asked,
                                 kvp_depth_floor_ns(&r->depth), finished);
        }
        if (qi->abandoned) {
            if (qi->held_fd >= 0)
                close(qi->held_fd);
            free(qi);  /* settled ETIMEDOUT already; the reaper has its answer */
        }
        else if (!lane && qi->it.outcome == KVP_OUT_FAILED && qi->it.err == EXDEV)
            lane_take(q, qi, &sp);  /* behind another mount: unlooked at (open.c) */
        else
            done_push(q, qi);
        if (lane ? l->pending.n > 0 : work_waiting(q))
            pthread_cond_signal(work);  /* a freed slot or a grown limit */
    }
    /* Stopping: threads decided on and not started never will be; once this one is
     * uncounted, the queue may be freed under it, so nothing after the unlock. */
    q->threads -= sp.roots;
    l->threads -= sp.lane;
    if (lane)
        l->threads--;
    else
        q->threads--;
    pthread_cond_broadcast(&q->exited);
    pthread_mutex_unlock(&q->mu);
}

static void *thread_main(void *arg)
{
    serve(arg, 0);
    return NULL;
}

static void *lane_main(void *arg)
{
    serve(arg, 1);
    return NULL;
}

/* ---- the API (kvprefetch.h) -------------------------------------------------- */
void kvp_queue_free(struct kvp_queue *q)
{
    if (!q)
        return;
    pthread_mutex_lock(&q->mu);
    q->stopping = 1;
    pthread_cond_broadcast(&q->work);
    pthread_cond_broadcast(&q->lane_work);
    /* Threads stuck in the kernel (a hung tier) cannot be joined: wait a moment,
     * then leave the queue to them (leaked, not freed under their feet).  The
     * process is normally exiting when this runs. */
    struct timespec until;  /* CLOCK_MONOTONIC, as q->exited waits (kvp_queue_new) */
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += 1;
    while (q->threads + q->lane.threads > 0
           && pthread_cond_timedwait(&q->exited, &q->mu, &until) == 0)
        ;
    int left = (int)(q->threads + q->lane.threads);
    pthread_mutex_unlock(&q->mu);
    if (left > 0)
        return;
    while (q->done.head) {
        struct qitem *it = q->done.head;
        kvp_list_unlink(&q->done, it);
        free(it);
    }
    for (uint32_t i = 0; i < q->nroots; i++)
        for (uint32_t c = 0; c < q->roots[i].nclients; c++) {
            struct qlist *l = &q->roots[i].clients[c].pending;
            while (l->head) {
                struct qitem *it = l->head;
                kvp_list_unlink(l, it);
                free(it);
            }
        }
    while (q->lane.pending.head) {
        struct qitem *it = q->lane.pending.head;
        kvp_list_unlink(&q->lane.pending, it);
        free(it);
    }
    for (uint32_t i = 0; i < q->nroots; i++) {
        struct qlist *l = &q->roots[i].standby;
        while (l->head) {
            struct qitem *it = l->head;
            kvp_list_unlink(l, it);
            free(it);
        }
        kvp_gauge_close(&q->roots[i].gauge);
    }
    pthread_attr_destroy(&q->attr);
    if (q->efd >= 0)
        close(q->efd);
    if (q->scratch)
        munmap(q->scratch, q->scratch_len);
    free(q);
}

struct kvp_queue *kvp_queue_new(const struct kvp_queue_config *cfg, int *err)
{
    struct kvp_queue *q = NULL;
    const struct kvp_engine *engine = cfg ? kvp_engine_lookup(cfg->engine, cfg->warm_mode) : NULL;
    pthread_condattr_t clock;
    int e = EINVAL;
    if (!engine || !engine->warm || cfg->chunk == 0 || cfg->chunk > KVP_MAX_CHUNK ||
        cfg->max_threads == 0 || cfg->max_threads > KVP_QUEUE_MAX_THREADS ||
        cfg->initial_depth == 0 || cfg->other_mount_threads > KVP_QUEUE_MAX_THREADS)
        goto fail;
    e = ENOMEM;
    if (!(q = calloc(1, sizeof *q)))
        goto fail;
    q->cfg = *cfg;
    q->cfg.initial_depth = MIN(cfg->initial_depth, cfg->max_threads);
    q->efd = -1;
    q->base.engine = engine;
    q->base.cfg.engine = engine->name;  /* the table's: the caller's strings may go */
    q->base.cfg.warm_mode = engine->warm_mode;
    q->cfg.engine = engine->name;
    q->cfg.warm_mode = engine->warm_mode;
    q->base.cfg.chunk = cfg->chunk;
    /* An advise engine's WILLNEED says what to read: no FADV_RANDOM (open.c) under it. */
    q->base.cfg.fadv_random = cfg->fadv_random && strcmp(engine->warm_mode, "advise") != 0;
    kvp_open_detect(&q->base);
    q->across = q->base;
    q->base.no_xdev = 1;
    q->lane.cap = cfg->other_mount_threads ? cfg->other_mount_threads
                                           : KVP_QUEUE_OTHER_MOUNT_THREADS;
    q->cfg.other_mount_threads = q->lane.cap;
    kvp_depth_init(&q->lane.depth, q->lane.cap, q->lane.cap);
    pthread_mutex_init(&q->mu, NULL);
    /* Timed waits (kvp_queue_free's) on CLOCK_MONOTONIC: a step of the wall clock
     * (NTP, an operator's date) must neither stretch nor cut them short. */
    pthread_condattr_init(&clock);
    pthread_condattr_setclock(&clock, CLOCK_MONOTONIC);
    pthread_cond_init(&q->work, &clock);
    pthread_cond_init(&q->exited, &clock);
    pthread_cond_init(&q->lane_work, &clock);
    pthread_condattr_destroy(&clock);
    pthread_attr_init(&q->attr);
    pthread_attr_setstacksize(&q->attr, KVP_QUEUE_STACK);
    pthread_attr_setdetachstate(&q->attr, PTHREAD_CREATE_DETACHED);
    q->scratch_len = (size_t)KVP_QUEUE_SCRATCH * cfg->chunk;
    q->scratch = mmap(NULL, q->scratch_len, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (q->scratch == MAP_FAILED) {
        q->scratch = NULL;
        goto fail;
    }
    if ((q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) < 0) {
        e = errno;
        goto fail;
    }
    return q;
fail:
    kvp_queue_free(q);
    if (err)
        *err = e;
    return NULL;
}

int kvp_queue_fd(const struct kvp_queue *q)
{
    return q->efd;
}

/* Whether it is a file of the request (root, client, group, deadline): one judgement.
 * Group 0 names no request: each of its files is judged alone. */
static int same_request(const struct kvp_item *it, int root_fd, uint32_t client, uint32_t group,
                        int64_t deadline)
{
    return it->root_fd == root_fd && it->client == client && it->group == group
           && it->deadline_ns == deadline && group != 0;
}

size_t kvp_queue_submit(struct kvp_queue *q, const struct kvp_item *items, const uint64_t *tags,
                        size_t n)
{
    int64_t t = now_ns();
    struct spawn sp = { 0, 0 };
    /* A request's files (one group, one deadline, one root) are judged together,
     * at the first of them, each then by its place: schedule.c's admission. */
    struct judged { int root_fd; uint32_t client, group; int64_t deadline;
                    struct kvp_judgement on; };
    struct judged last = { .root_fd = -1 };
    pthread_mutex_lock(&q->mu);
    for (size_t i = 0; i < n; i++) {
        size_t len = items[i].rel ? strlen(items[i].rel) : 0;
        struct qitem *qi = malloc(sizeof *qi + len + 1);
        if (!qi) {
            n = i;  /* out of memory: items [i, n) are not taken */
            break;
        }
        memset(qi, 0, sizeof *qi);
        qi->held_fd = -1;
        qi->ahead = -1;
        memcpy(qi->rel, items[i].rel ? items[i].rel : "", len + 1);
        qi->it = items[i];
        qi->it.rel = qi->rel;
        qi->it.outcome = KVP_OUT_FAILED;
        qi->it.err = 0;
        qi->it.size = qi->it.done = 0;
        qi->tag = tags[i];
        qi->submitted = t;
        qi->seq = q->seq++;
        struct qroot *r = root_of(q, items[i].root_fd);
        qi->root = (uint16_t)(r - q->roots);
        if (qi->it.deadline_ns > 0) {
            if (!same_request(&items[i], last.root_fd, last.client, last.group, last.deadline)) {
                uint32_t files = 1;
                while (i + files < n && same_request(&items[i + files], items[i].root_fd,
                                                     items[i].client, items[i].group,
                                                     items[i].deadline_ns))
                    files++;
                last = (struct judged){ items[i].root_fd, qi->it.client, qi->it.group,
                                        qi->it.deadline_ns,
                                        kvp_sched_judge(r, qi->it.deadline_ns, files, t) };
            }
            if (!kvp_sched_admits(&last.on, qi->it.deadline_ns, qi->it.position, t, &qi->ahead)) {
                if (last.on.gauge) {  /* read only into a slot the tier has free (schedule.c) */
                    kvp_sched_stand_by(r, qi, &last.on);
                    q->deadlines++;
                    continue;
                }
                /* cannot be read in time: expired now, unread */
                settle(&qi->it, KVP_OUT_EXPIRED, 0);
                done_push(q, qi);
                continue;
            }
        }
        q->deadlines += qi->it.deadline_ns > 0;
        kvp_sched_push(r, qi);
    }
    q->submitted += n;
    maybe_spawn(q, &sp);
    standby_look(q, &sp);
    pthread_cond_broadcast(&q->work);
    pthread_mutex_unlock(&q->mu);
    start_threads(q, &sp);
    return n;
}

size_t kvp_queue_reap(struct kvp_queue *q, struct kvp_done *out, size_t max)
{
    uint64_t count;
    size_t n = 0;
    ssize_t r = read(q->efd, &count, sizeof count);  /* clear before looking: no lost wakeup */
    (void)r;
    pthread_mutex_lock(&q->mu);
    while (n < max && q->done.head) {
        struct qitem *qi = q->done.head;
        kvp_list_unlink(&q->done, qi);
        out[n++] = (struct kvp_done){ qi->tag, qi->it.outcome, qi->it.err, qi->it.size, qi->it.done,
                                      qi->held_fd };
        free(qi);
    }
    if (q->done.n > 0) {  /* more than max: keep the fd readable */
        uint64_t one = 1;
        ssize_t w = write(q->efd, &one, sizeof one);
        (void)w;
    }
    q->reaped += n;
    pthread_mutex_unlock(&q->mu);
    return n;
}

/* Settle a file that ran out of time: a pending one is taken off its list; a
 * running one stays its thread's (abandoned) and a copy carries the outcome. */
static void expire(struct kvp_queue *q, struct qitem *qi, int running)
{
    struct qitem *copy = qi;
    if (running) {
        if (!(copy = malloc(sizeof *copy + 1)))
            return;  /* try again at the next tick */
        memset(copy, 0, sizeof *copy);
        copy->held_fd = -1;
        copy->tag = qi->tag;
        qi->abandoned = 1;
    } else {
        unpend(q, qi);
        q->deadlines -= qi->it.deadline_ns > 0;
    }
    copy->it.outcome = KVP_OUT_FAILED;
    copy->it.err = ETIMEDOUT;
    q->timed_out++;
    done_push(q, copy);
}

/* A pending file past its deadline: off its list, settled EXPIRED, unread. */
static void settle_expired(struct kvp_queue *q, struct qitem *qi)
{
    unpend(q, qi);
    settle(&qi->it, KVP_OUT_EXPIRED, 0);
    q->deadlines--;
    done_push(q, qi);
}

/* Every pending file of list l past the deadline or file_timeout settled.  Not
 * in submission order (schedule.c), so the whole list is looked at, once a tick. */
static void sweep(struct kvp_queue *q, struct qlist *l, int64_t t)
{
    struct qitem *qi = l->head, *next;
    for (; qi; qi = next) {
        next = qi->next;
        if (q->cfg.timeout_ns && t - qi->submitted > (int64_t)q->cfg.timeout_ns)
            expire(q, qi, 0);
        else if (qi->it.deadline_ns > 0 && t > qi->it.deadline_ns)
            settle_expired(q, qi);
    }
}

void kvp_queue_root_depth(struct kvp_queue *q, int root_fd, uint32_t initial)
{
    if (initial == 0)
        return;
    pthread_mutex_lock(&q->mu);
    struct qroot *r = root_of(q, root_fd);
    if (r->fd == root_fd && r->running == 0 && r->npending == 0)
        kvp_depth_trust(&r->depth, MIN(initial, q->cfg.max_threads), q->cfg.max_threads);
    pthread_mutex_unlock(&q->mu);
}

int kvp_queue_root_gauge(struct kvp_queue *q, int root_fd, const char *connection)
{
    pthread_mutex_lock(&q->mu);
    struct qroot *r = root_of(q, root_fd);
    int rc = r->fd == root_fd ? kvp_gauge_open(&r->gauge, connection) : -ENOSPC;
    pthread_mutex_unlock(&q->mu);
    return rc;
}

void kvp_queue_tick(struct kvp_queue *q)
{
    int64_t t = now_ns();
    struct qlane *l = &q->lane;
    struct spawn sp = { 0, 0 };
    pthread_mutex_lock(&q->mu);
    int freed = 0;
    for (struct qitem *qi = q->running.head; qi; qi = qi->next) {
        struct qroot *r = &q->roots[qi->root];
        if (!qi->stalled && qi->other_mount && t - qi->started > kvp_depth_stall_ns(&l->depth)) {
            qi->stalled = 1;  /* holds its thread and its slot in the lane: stuck */
            l->stalled++;
            l->stalls++;
        } else if (!qi->stalled && !qi->other_mount
                   && t - qi->started > kvp_depth_stall_ns(&r->depth)) {
            qi->stalled = 1;  /* holds its thread, no longer its root's depth */
            r->stalled++;
            if (qi->timed_live) {
                qi->timed_live = 0;
                r->timed_live--;
            }
            q->stalls++;
            freed = 1;
        }
        if (!qi->abandoned && q->cfg.timeout_ns && t - qi->submitted > (int64_t)q->cfg.timeout_ns)
            expire(q, qi, 1);
    }
    /* Files past file_timeout or their deadline leave the queue now, not when
     * depth frees up behind a slow or hung root: they take no thread and no
     * fetch slot.  The lane's FIFO is in hand-over order, not submission's. */
    if (q->cfg.timeout_ns || q->deadlines) {
        for (uint32_t i = 0; i < q->nroots; i++)
            for (uint32_t c = 0; c < q->roots[i].nclients; c++)
                sweep(q, &q->roots[i].clients[c].pending, t);
        for (uint32_t i = 0; i < q->nroots; i++)
            sweep(q, &q->roots[i].standby, t);
        sweep(q, &l->pending, t);
    }
    /* A stuck lane answers what waits for it now, not at file_timeout. */
    if (lane_stuck(l))
        while (l->pending.head) {
            struct qitem *qi = l->pending.head;
            kvp_list_unlink(&l->pending, qi);
            q->deadlines -= qi->it.deadline_ns > 0;
            lane_refuse(q, qi);
        }
    if (freed) {
        maybe_spawn(q, &sp);
        pthread_cond_broadcast(&q->work);
    }
    standby_look(q, &sp);
    pthread_mutex_unlock(&q->mu);
    start_threads(q, &sp);
}

void kvp_queue_force_fallback(struct kvp_queue *q, int32_t which)
{
    kvp_ctx_force_fallback(&q->base, which);
    kvp_ctx_force_fallback(&q->across, which);
}

void kvp_queue_stats(struct kvp_queue *q, struct kvp_queue_stats *out)
{
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&q->mu);
    out->threads = q->threads;
    out->idle = q->idle;
    out->submitted = q->submitted;
    out->reaped = q->reaped;
    out->timed_out = q->timed_out;
    out->stalls = q->stalls;
    out->spawn_failures = q->spawn_failures;
    out->standby_reads = q->standby_reads;
    out->mount_threads = q->lane.threads;
    out->mount_pending = q->lane.pending.n;
    out->mount_running = q->lane.running;
    out->mount_stalled = q->lane.stalled;
    out->mount_moved = q->lane.moved;
    out->mount_refused = q->lane.refused;
    out->mount_stalls = q->lane.stalls;
    for (uint32_t i = 0; i < q->nroots; i++) {
        const struct qroot *r = &q->roots[i];
        out->pending += r->npending + r->standby.n;
        out->running += r->running;
        out->stalled += r->stalled;
        if (i < KVP_QUEUE_STATS_ROOTS) {
            out->root_fd[i] = r->fd;
            out->root_depth[i] = kvp_depth_limit(&r->depth);
            out->root_rtt_us[i] = (uint32_t)(kvp_depth_rtt_ns(&r->depth) / 1000);
            out->root_served[i] = (uint32_t)(r->gauge.rate + 0.5);
            out->root_floor_us[i] = (uint32_t)(kvp_depth_floor_ns(&r->depth) / 1000);
            out->nroots = i + 1;
        }
    }
    pthread_mutex_unlock(&q->mu);
}
