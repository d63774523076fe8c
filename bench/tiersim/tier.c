/* The near side of the tier: which chunks are fetched, and serving reads.
 *
 * A READ whose chunks are all fetched is answered at once from the backing
 * file, by the FUSE thread that received it.  Otherwise it waits, without a
 * thread: it is attached to one fetch per missing chunk (a fetch already in
 * flight for the chunk is shared; fetch.c), and the FUSE thread goes back to
 * reading requests; when its last fetch completes, a reply thread answers it.
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

static pthread_t *reply_threads;
static unsigned reply_started;

/* ---- chunk bitmap ---------------------------------------------------------- */

bool chunk_is_fetched_locked(const struct node *node, uint64_t c)
{
    return c / 64 < node->fetched_words && (node->fetched[c / 64] >> (c % 64) & 1);
}

void chunk_mark_fetched_locked(struct node *node, uint64_t c)
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
    if (chunk_is_fetched_locked(node, last))
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

/* ---- reads ---------------------------------------------------------------- */

/* fsize: the file's size when the READ arrived, read under g.lock, for the counters. */
static void reply_data(fuse_req_t req, uint64_t fsize, int fd, off_t off, size_t size)
{
    struct fuse_bufvec buf = FUSE_BUFVEC_INIT(size);
    buf.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
    buf.buf[0].fd = fd;
    buf.buf[0].pos = off;
    /* Splice moves the backing file's pages into /dev/fuse without a copy
     * through this process (libfuse fuse_send_data_iov); it needs
     * FUSE_CAP_SPLICE_WRITE, negotiated in INIT. */
    uint64_t end = (uint64_t)off + size;
    uint64_t bytes = (uint64_t)off >= fsize ? 0 : (end < fsize ? end : fsize) - (uint64_t)off;
    /* Counted before the reply: once the reader has its data, a stats query
     * it sends next must see the read (counting after left a window where the
     * consumer finished but read_bytes was one reply short).  A failed reply
     * takes its count back. */
    __atomic_fetch_add(&g.n.reads, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&g.n.read_bytes, bytes, __ATOMIC_RELAXED);
    int res = fuse_reply_data(req, &buf, g.cfg.splice ? FUSE_BUF_SPLICE_MOVE : FUSE_BUF_NO_SPLICE);
    if (res != 0) {
        __atomic_fetch_sub(&g.n.reads, 1, __ATOMIC_RELAXED);
        __atomic_fetch_sub(&g.n.read_bytes, bytes, __ATOMIC_RELAXED);
        __atomic_fetch_add(&g.n.read_errors, 1, __ATOMIC_RELAXED);
    }
}

static void pending_run(struct work *w)
{
    struct pending_read *p = (struct pending_read *)w;
    reply_data(p->req, p->fsize, p->fd, p->off, p->size);
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
        if (chunk_is_fetched_locked(node, c))
            continue;
        struct fetch *f = fetch_find_locked(node, c);
        if (!f && fetch_is_instant_locked()) {
            uint64_t start = c * cb;
            chunk_mark_fetched_locked(node, c);
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
                                        .node = node, .fsize = node->size, .fd = fd,
                                        .off = off, .size = size };
            g.n.pending_reads++;
        }
        fetch_add_waiter_locked(f, p);
    }
    uint64_t fsize = node->size;
    pthread_mutex_unlock(&g.lock);
    if (marked)
        fetch_notify_attrs(node);  /* before the reply: see fetch.c batch_finish_locked */
    if (!p)
        reply_data(req, fsize, fd, off, size);
}

/* ---- threads -------------------------------------------------------------- */

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
    pthread_cond_init(&g.work_cv, NULL);
    int err = fetch_timer_start();
    if (err)
        return err;
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
    fetch_timer_join();
    for (unsigned i = 0; i < reply_started; i++)
        pthread_join(reply_threads[i], NULL);
    free(reply_threads);

    pthread_mutex_lock(&g.lock);
    fetch_cancel_all_locked();
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
