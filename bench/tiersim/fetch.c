/* The far side of the tier: fetches, their slots, the bandwidth link, the timer.
 *
 * A fetch brings one chunk near.  It holds a slot from its start until its
 * data is "here":
 *     ready = start + latency + uniform(0, jitter)
 * and, with a bandwidth cap, its bytes then cross one serial link:
 *     ready = max(ready, link_free) + bytes / bandwidth;  link_free = ready
 * so the sum over all fetches never exceeds the cap.  Without a free slot it
 * waits in a FIFO.  Started fetches sit in a min-heap by `ready`; one timer
 * thread sleeps until the earliest, marks its chunk fetched, and hands the
 * reads that wait for nothing else to the reply threads (tier.c).  A fetch is
 * a small struct, so 1,024 fetches of 100 ms in flight cost 1,024 structs and
 * one thread.
 */
#include "tiersim.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static pthread_t timer_thread;
static bool timer_started;

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

void fetch_settings_changed_locked(void)
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
void fetch_notify_attrs(const struct node *node)
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
            fetch_notify_attrs(n);  /* the dirty links are this thread's alone */
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
        chunk_mark_fetched_locked(f->node, f->chunk);
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

struct fetch *fetch_new_locked(struct node *node, uint64_t chunk, double now)
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
bool fetch_is_instant_locked(void)
{
    return g.set.latency_ms <= 0 && g.set.jitter_ms <= 0 && !g.set.bandwidth &&
           !g.queue_head && slot_free_locked();
}

struct fetch *fetch_find_locked(const struct node *node, uint64_t chunk)
{
    struct fetch *f = node->fetches;
    while (f && f->chunk != chunk)
        f = f->node_next;
    return f;
}

void fetch_add_waiter_locked(struct fetch *f, struct pending_read *p)
{
    if (f->nwaiters == f->capwaiters) {
        f->capwaiters = f->capwaiters ? f->capwaiters * 2 : 4;
        f->waiters = xrealloc(f->waiters, f->capwaiters * sizeof(*f->waiters));
    }
    f->waiters[f->nwaiters++] = p;
    p->outstanding++;
}

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

int fetch_timer_start(void)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);  /* now_s() is CLOCK_MONOTONIC */
    pthread_cond_init(&g.timer_cv, &attr);
    pthread_condattr_destroy(&attr);
    int err = pthread_create(&timer_thread, NULL, timer_main, NULL);
    if (err)
        return -err;
    timer_started = true;
    return 0;
}

/* After g.stopping is set and the timer woken. */
void fetch_timer_join(void)
{
    if (timer_started)
        pthread_join(timer_thread, NULL);
}

/* Shutdown, the timer stopped: every fetch ends without its chunk, and the
 * reads that waited for it go to the work queue, which tier_stop cancels. */
void fetch_cancel_all_locked(void)
{
    struct batch batch = { NULL, NULL, NULL };
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
}
