/* The tier model: which chunks are near, fetching the others, serving reads.
 *
 * A READ whose chunks are all fetched is answered at once from the backing
 * file, by the FUSE thread that received it.  Otherwise it waits, without a
 * thread: it is attached to one fetch per missing chunk (a fetch already in
 * flight for the chunk is shared), and the FUSE thread goes back to reading
 * requests.  A fetch holds a slot from its start until its data is "here":
 *     ready = start + latency + uniform(0, jitter)
 * and, with a bandwidth cap, its bytes then cross one serial link:
 *     ready = max(ready, link_free) + bytes / bandwidth;  link_free = ready
 * so the sum over all fetches never exceeds the cap.  One timer thread pops
 * fetches in ready order, marks their chunks fetched, and hands the reads that
 * no longer wait for anything to a small pool of reply threads.  So 1,024
 * fetches of 100 ms in flight cost 1,024 small structs, not 1,024 threads.
 *
 * Bounds.  Threads: the FUSE loop's (--threads), one timer, --reply-threads,
 * one control thread.  Memory: one pending_read per deferred READ and one
 * fetch per missing chunk those reads need; deferred READs are bounded by the
 * kernel: background (readahead, async) requests by max_background
 * (fs/fuse/dev.c fuse_request_queue_background), synchronous ones by the
 * number of blocked callers.  Reply buffers: libfuse copies a READ reply
 * through a malloc of its size (<= max_pages x 4 KiB = 1 MiB) when it does not
 * splice, one per replying thread at a time.
 */
#include "tiersim.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static pthread_t timer_thread;
static pthread_t *reply_threads;
static unsigned reply_started;
static bool timer_started;

/* ---- chunk bitmap ---------------------------------------------------------- */

static bool is_fetched(const struct node *node, uint64_t c)
{
    return c / 64 < node->fetched_words && (node->fetched[c / 64] >> (c % 64) & 1);
}

static void mark_fetched(struct node *node, uint64_t c)
{
    uint64_t word = c / 64;
    if (word >= node->fetched_words) {
        uint64_t words = node->fetched_words ? node->fetched_words : 1;
        while (words <= word)
            words *= 2;
        node->fetched = xrealloc(node->fetched, words * sizeof(uint64_t));
        memset(node->fetched + node->fetched_words, 0,
               (words - node->fetched_words) * sizeof(uint64_t));
        node->fetched_words = words;
    }
    uint64_t bit = 1ull << (c % 64);
    if (!(node->fetched[word] & bit)) {
        node->fetched[word] |= bit;
        node->fetched_chunks++;
    }
}

uint64_t tier_fetched_bytes(const struct node *node)
{
    if (!node->fetched_chunks || !node->size)
        return 0;
    uint64_t cb = g.cfg.chunk_bytes, bytes = node->fetched_chunks * cb;
    uint64_t last = (node->size - 1) / cb;
    if (is_fetched(node, last))
        bytes -= (last + 1) * cb - node->size;  /* the last chunk is short */
    return bytes < node->size ? bytes : node->size;  /* chunks past a shrunk EOF */
}

uint64_t tier_evict_locked(struct node *node)
{
    uint64_t chunks = node->fetched_chunks;
    if (node->fetched)
        memset(node->fetched, 0, node->fetched_words * sizeof(uint64_t));
    node->fetched_chunks = 0;
    if (chunks) {
        g.n.evictions++;
        g.n.evicted_chunks += chunks;
    }
    return chunks;
}

/* ---- the work queue ------------------------------------------------------- */

void work_push_locked(struct work *work)
{
    work->next = NULL;
    if (g.work_tail)
        g.work_tail->next = work;
    else
        g.work_head = work;
    g.work_tail = work;
    pthread_cond_signal(&g.work_cv);
}

static struct work *work_pop_locked(void)
{
    struct work *w = g.work_head;
    if (w && !(g.work_head = w->next))
        g.work_tail = NULL;
    return w;
}

/* ---- fetches: the heap of started ones, the queue for slots ---------------- */

static void heap_swap(uint64_t a, uint64_t b)
{
    struct fetch *t = g.heap[a];
    g.heap[a] = g.heap[b];
    g.heap[b] = t;
}

static void heap_push_locked(struct fetch *f)
{
    if (g.heap_len == g.heap_cap) {
        g.heap_cap = g.heap_cap ? g.heap_cap * 2 : 256;
        g.heap = xrealloc(g.heap, g.heap_cap * sizeof(*g.heap));
    }
    uint64_t i = g.heap_len++;
    g.heap[i] = f;
    while (i && g.heap[(i - 1) / 2]->ready_at > g.heap[i]->ready_at) {
        heap_swap(i, (i - 1) / 2);
        i = (i - 1) / 2;
    }
}

static struct fetch *heap_pop_locked(void)
{
    struct fetch *top = g.heap[0];
    g.heap[0] = g.heap[--g.heap_len];
    for (uint64_t i = 0;;) {
        uint64_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < g.heap_len && g.heap[l]->ready_at < g.heap[m]->ready_at)
            m = l;
        if (r < g.heap_len && g.heap[r]->ready_at < g.heap[m]->ready_at)
            m = r;
        if (m == i)
            break;
        heap_swap(i, m);
        i = m;
    }
    return top;
}

static double uniform01_locked(void)
{
    g.rng ^= g.rng >> 12;  /* xorshift64* (Vigna) */
    g.rng ^= g.rng << 25;
    g.rng ^= g.rng >> 27;
    return (double)((g.rng * 0x2545F4914F6CDD1Dull) >> 11) / (double)(1ull << 53);
}

static bool slot_free_locked(void)
{
    return g.set.slots == 0 || g.n.in_flight < g.set.slots;
}

static void start_locked(struct fetch *f, double now)
{
    f->started = true;
    if (++g.n.in_flight > g.n.peak_in_flight)
        g.n.peak_in_flight = g.n.in_flight;
    double ready = now + g.set.latency_ms / 1e3;
    if (g.set.jitter_ms > 0)
        ready += uniform01_locked() * g.set.jitter_ms / 1e3;
    if (g.set.bandwidth) {
        double begin = ready > g.link_free_at ? ready : g.link_free_at;
        g.link_free_at = begin + (double)f->bytes / (double)g.set.bandwidth;
        ready = g.link_free_at;
    }
    f->ready_at = ready;
    heap_push_locked(f);
    if (g.heap[0] == f)
        pthread_cond_signal(&g.timer_cv);  /* the timer sleeps until an earlier deadline */
}

static void start_queued_locked(double now)
{
    while (g.queue_head && slot_free_locked()) {
        struct fetch *f = g.queue_head;
        if (!(g.queue_head = f->queue_next))
            g.queue_tail = NULL;
        g.n.queued--;
        start_locked(f, now);
    }
}

void tier_settings_changed_locked(void)
{
    start_queued_locked(now_s());  /* more slots (or none) may start queued fetches */
}

/* What a round of completions leaves to do once g.lock is dropped: tell the
 * kernel that st_blocks changed, then answer the reads, in that order, so a
 * caller that stats the file right after its read returns sees the blocks. */
struct batch {
    struct work *head, *tail;
    struct node *dirty;
};

static void batch_add_locked(struct batch *b, struct work *w)
{
    w->next = NULL;
    if (b->tail)
        b->tail->next = w;
    else
        b->head = w;
    b->tail = w;
}

/* The kernel caches attributes for attr_timeout (fuse_change_attributes);
 * dropping them makes the next stat ask again (GETATTR) and get the new
 * st_blocks.  Offset -1: attributes only, no page is touched, so this cannot
 * wait on a page lock (fs/fuse/inode.c fuse_reverse_inval_inode). */
void tier_notify_attrs(const struct node *node)
{
    if (g.cfg.attr_timeout > 0)
        fuse_lowlevel_notify_inval_inode(g.se, node_id(node), -1, 0);
}

/* Runs with g.lock held on entry and exit, dropping it for the notifications. */
static void batch_finish_locked(struct batch *b)
{
    if (b->dirty) {
        pthread_mutex_unlock(&g.lock);
        for (const struct node *n = b->dirty; n; n = n->dirty_next)
            tier_notify_attrs(n);  /* the dirty links are this thread's alone */
        pthread_mutex_lock(&g.lock);
        for (struct node *n = b->dirty, *next; n; n = next) {
            next = n->dirty_next;
            n->attr_dirty = false;
            n->dirty_next = NULL;
        }
    }
    for (struct work *w = b->head, *next; w; w = next) {
        next = w->next;
        work_push_locked(w);
    }
    *b = (struct batch){ NULL, NULL, NULL };
}

/* Completed (or, at shutdown, cancelled): the chunk is near; its readers that
 * wait for nothing else go to the batch. */
static void complete_locked(struct fetch *f, bool cancelled, struct batch *b)
{
    struct fetch **pp = &f->node->fetches;
    while (*pp != f)
        pp = &(*pp)->node_next;
    *pp = f->node_next;
    if (f->started)
        g.n.in_flight--;
    if (!cancelled) {
        mark_fetched(f->node, f->chunk);
        g.n.fetches++;
        g.n.fetched_bytes += f->bytes;
        if (!f->node->attr_dirty) {
            f->node->attr_dirty = true;
            f->node->dirty_next = b->dirty;
            b->dirty = f->node;
        }
    }
    for (unsigned i = 0; i < f->nwaiters; i++) {
        struct pending_read *p = f->waiters[i];
        if (--p->outstanding == 0) {
            g.n.pending_reads--;
            batch_add_locked(b, &p->work);
        }
    }
    free(f->waiters);
    free(f);
}

static struct fetch *fetch_new_locked(struct node *node, uint64_t chunk, double now)
{
    struct fetch *f = xcalloc(1, sizeof(*f));
    uint64_t cb = g.cfg.chunk_bytes, start = chunk * cb;
    f->node = node;
    f->chunk = chunk;
    f->bytes = node->size > start ? (node->size - start < cb ? node->size - start : cb) : 0;
    f->node_next = node->fetches;
    node->fetches = f;
    if (slot_free_locked() && !g.queue_head) {
        start_locked(f, now);
    } else {
        if (g.queue_tail)
            g.queue_tail->queue_next = f;
        else
            g.queue_head = f;
        g.queue_tail = f;
        g.n.queued++;
    }
    return f;
}

/* With no latency, jitter or bandwidth cap and a free slot, a fetch is done
 * the moment it starts: count it and serve the read inline, so the zero-latency
 * ceiling measures the passthrough, not a trip through the timer. */
static bool fetch_is_instant_locked(void)
{
    return g.set.latency_ms <= 0 && g.set.jitter_ms <= 0 && !g.set.bandwidth &&
           !g.queue_head && slot_free_locked();
}

/* ---- reads ---------------------------------------------------------------- */

static void reply_data(fuse_req_t req, const struct node *node, int fd, off_t off, size_t size)
{
    struct fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
    buf.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
    buf.buf[0].fd = fd;
    buf.buf[0].pos = off;
    /* Splice moves the backing file's pages into /dev/fuse without a copy
     * through this process (libfuse fuse_send_data_iov); it needs
     * FUSE_CAP_SPLICE_WRITE, negotiated in INIT. */
    int res = fuse_reply_data(req, &buf, g.cfg.splice ? FUSE_BUF_SPLICE_MOVE : FUSE_BUF_NO_SPLICE);
    uint64_t end = (uint64_t)off + size, fsize = node->size;
    uint64_t bytes = (uint64_t)off >= fsize ? 0 : (end < fsize ? end : fsize) - (uint64_t)off;
    if (res == 0) {
        __atomic_fetch_add(&g.n.reads, 1, __ATOMIC_RELAXED);
        __atomic_fetch_add(&g.n.read_bytes, bytes, __ATOMIC_RELAXED);
    } else {
        __atomic_fetch_add(&g.n.read_errors, 1, __ATOMIC_RELAXED);
    }
}

static void pending_run(struct work *w)
{
    struct pending_read *p = (struct pending_read *)w;
    reply_data(p->req, p->node, p->fd, p->off, p->size);
    free(p);
}

static void pending_cancel(struct work *w)
{
    struct pending_read *p = (struct pending_read *)w;
    fuse_reply_err(p->req, EIO);
    free(p);
}

void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi)
{
    struct node *node = node_of(ino);
    int fd = (int)fi->fh;
    pthread_mutex_lock(&g.lock);
    if (hang_matches_locked(HANG_READ, node->path)) {
        struct held h = { .kind = HANG_READ, .op = HELD_READ, .req = req, .ino = ino,
                          .size = size, .off = off, .fi = *fi, .has_fi = true, .node = node };
        hang_hold_locked(&h, node->path);
        pthread_mutex_unlock(&g.lock);
        return;
    }
    struct pending_read *p = NULL;
    bool marked = false;
    uint64_t cb = g.cfg.chunk_bytes, end = (uint64_t)off + size;
    if (end > node->size)
        end = node->size;
    double now = 0;
    for (uint64_t c = (uint64_t)off / cb; (uint64_t)off < end && c <= (end - 1) / cb; c++) {
        if (is_fetched(node, c))
            continue;
        struct fetch *f = node->fetches;
        while (f && f->chunk != c)
            f = f->node_next;
        if (!f && fetch_is_instant_locked()) {
            uint64_t start = c * cb;
            mark_fetched(node, c);
            g.n.fetches++;
            g.n.fetched_bytes += node->size - start < cb ? node->size - start : cb;
            marked = true;
            continue;
        }
        if (!f) {
            if (now == 0)
                now = now_s();
            f = fetch_new_locked(node, c, now);
        }
        if (!p) {
            p = xcalloc(1, sizeof(*p));
            *p = (struct pending_read){ .work = { pending_run, pending_cancel, NULL }, .req = req,
                                        .node = node, .fd = fd, .off = off, .size = size };
            g.n.pending_reads++;
        }
        if (f->nwaiters == f->capwaiters) {
            f->capwaiters = f->capwaiters ? f->capwaiters * 2 : 4;
            f->waiters = xrealloc(f->waiters, f->capwaiters * sizeof(*f->waiters));
        }
        f->waiters[f->nwaiters++] = p;
        p->outstanding++;
    }
    pthread_mutex_unlock(&g.lock);
    if (marked)
        tier_notify_attrs(node);  /* before the reply: see batch_finish_locked */
    if (!p)
        reply_data(req, node, fd, off, size);
}

/* ---- threads -------------------------------------------------------------- */

static void *timer_main(void *arg)
{
    (void)arg;
    struct batch batch = { NULL, NULL, NULL };
    pthread_mutex_lock(&g.lock);
    while (!g.stopping) {
        if (!g.heap_len) {
            pthread_cond_wait(&g.timer_cv, &g.lock);
            continue;
        }
        double now = now_s(), due = g.heap[0]->ready_at;
        if (due > now) {
            struct timespec ts = { .tv_sec = (time_t)due,
                                   .tv_nsec = (long)((due - (double)(time_t)due) * 1e9) };
            pthread_cond_timedwait(&g.timer_cv, &g.lock, &ts);
            continue;
        }
        while (g.heap_len && g.heap[0]->ready_at <= now)
            complete_locked(heap_pop_locked(), false, &batch);
        start_queued_locked(now);
        batch_finish_locked(&batch);
    }
    pthread_mutex_unlock(&g.lock);
    return NULL;
}

static void *reply_main(void *arg)
{
    (void)arg;
    pthread_mutex_lock(&g.lock);
    for (;;) {
        while (!g.work_head && !g.stopping)
            pthread_cond_wait(&g.work_cv, &g.lock);
        if (g.stopping)
            break;  /* what is left is cancelled by tier_stop */
        struct work *w = work_pop_locked();
        pthread_mutex_unlock(&g.lock);
        w->run(w);
        pthread_mutex_lock(&g.lock);
    }
    pthread_mutex_unlock(&g.lock);
    return NULL;
}

int tier_start(void)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);  /* now_s() is CLOCK_MONOTONIC */
    pthread_cond_init(&g.timer_cv, &attr);
    pthread_condattr_destroy(&attr);
    pthread_cond_init(&g.work_cv, NULL);
    int err = pthread_create(&timer_thread, NULL, timer_main, NULL);
    if (err)
        return -err;
    timer_started = true;
    reply_threads = xcalloc(g.cfg.reply_threads, sizeof(*reply_threads));
    for (; reply_started < g.cfg.reply_threads; reply_started++)
        if ((err = pthread_create(&reply_threads[reply_started], NULL, reply_main, NULL)))
            return -err;
    return 0;
}

/* Stop the threads, then answer everything still waiting with EIO: reads
 * waiting for fetches, held requests, queued replies.  Run after the FUSE
 * loop has ended (no op runs any more) and before the session is destroyed,
 * so no reader stays blocked on a request this process has read. */
void tier_stop(void)
{
    pthread_mutex_lock(&g.lock);
    g.stopping = true;
    pthread_cond_broadcast(&g.timer_cv);
    pthread_cond_broadcast(&g.work_cv);
    pthread_mutex_unlock(&g.lock);
    if (timer_started)
        pthread_join(timer_thread, NULL);
    for (unsigned i = 0; i < reply_started; i++)
        pthread_join(reply_threads[i], NULL);
    free(reply_threads);

    struct batch batch = { NULL, NULL, NULL };
    pthread_mutex_lock(&g.lock);
    while (g.heap_len)
        complete_locked(heap_pop_locked(), true, &batch);
    while (g.queue_head) {
        struct fetch *f = g.queue_head;
        g.queue_head = f->queue_next;
        g.n.queued--;
        complete_locked(f, true, &batch);
    }
    g.queue_tail = NULL;
    batch_finish_locked(&batch);  /* cancelled: no attribute changed, nothing notified */
    hang_cancel_all_locked();
    struct work *w = g.work_head;
    g.work_head = g.work_tail = NULL;
    pthread_mutex_unlock(&g.lock);
    while (w) {
        struct work *next = w->next;
        w->cancel(w);
        w = next;
    }
}
