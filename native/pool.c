/*
 * pool.c: blocking reads of a window of open heads (kvp_read_head), spread
 * over cfg.threads threads: io_uring/advise's confirm (advise.c).  The threads
 * live for one batch; the queue (queue.c) keeps its own.
 */
#include "internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#define KVP_THREAD_STACK (256u << 10)

struct pool {
    struct kvp_ctx *c;
    struct kvp_item *items;
    size_t n;
    const int *fds;  /* item i's read fd, -1 where it settled on open */
    const uint64_t *spans;
    atomic_size_t next;
};
struct worker { struct pool *p; char *buf; pthread_t tid; };

static void *work(void *arg)
{
    struct worker *w = arg;
    struct pool *p = w->p;
    size_t i;
    while ((i = atomic_fetch_add(&p->next, 1)) < p->n)
        if (p->fds[i] >= 0) {
            kvp_read_head(p->c, &p->items[i], p->fds[i], p->spans[i], w->buf);
            close(p->fds[i]);
        }
    return NULL;
}

/* Items spread over cfg.threads threads by an atomic next index, the caller's
 * thread being one (threads == 1: a plain loop, no thread created).  Each has
 * its own scratch so two cores never write the same cache lines. */
void kvp_run_pool(struct kvp_ctx *c, struct kvp_item *items, size_t n,
                  const int *fds, const uint64_t *spans)
{
    struct worker w[KVP_MAX_THREADS];
    struct pool p = { c, items, n, fds, spans, 0 };
    size_t nth = MIN((size_t)c->cfg.threads, n), started = 1;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, KVP_THREAD_STACK);
    for (size_t t = 0; t < nth; t++)
        w[t] = (struct worker){ &p, c->scratch + t * c->cfg.chunk, 0 };
    while (started < nth && pthread_create(&w[started].tid, &attr, work, &w[started]) == 0)
        started++;  /* fewer threads if the system refuses more */
    pthread_attr_destroy(&attr);
    work(&w[0]);
    for (size_t t = 1; t < started; t++)
        pthread_join(w[t].tid, NULL);
}
