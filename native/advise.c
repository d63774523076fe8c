/*
 * advise.c: the advise-then-confirm loop of io_uring/advise (engine_uring.c):
 * a window of open files is advised, then every head confirmed by reading it.
 * (posix_fadvise's own advise mode is the queue's: queue.c advises each head
 * before its confirming read.)
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

int kvp_window_alloc(struct kvp_window *w, uint32_t max_open)
{
    w->fds = calloc(max_open, sizeof *w->fds);
    w->spans = calloc(max_open, sizeof *w->spans);
    return w->fds && w->spans ? 0 : ENOMEM;
}

void kvp_window_free(struct kvp_window *w)
{
    free(w->fds), free(w->spans);
    w->fds = NULL, w->spans = NULL;
}

/* Per window of max_open files, open and advise every head, then confirm.
 * cachestat counts pages whose read is still in flight, so it cannot confirm;
 * a pread of the range blocks until in-flight pages are uptodate and re-reads
 * any the reclaimer evicted since.  done = confirmed. */
int kvp_advise_and_confirm(struct kvp_ctx *c, struct kvp_window *w, const struct kvp_advice *how,
                           struct kvp_item *items, size_t n)
{
    for (size_t base = 0; base < n; base += c->cfg.max_open) {
        size_t m = MIN(n - base, (size_t)c->cfg.max_open);
        for (size_t k = 0; k < m; k++) {
            w->fds[k] = kvp_item_open(c, &items[base + k], &w->spans[k], NULL);
            if (w->fds[k] >= 0 && how->file)
                how->file(c, w->fds[k], w->spans[k]);
        }
        int r = how->window ? how->window(c, w->fds, w->spans, m) : 0;
        if (r < 0) {
            for (size_t k = 0; k < n - base; k++) {
                if (k < m && w->fds[k] >= 0)
                    close(w->fds[k]);
                if (k >= m || w->fds[k] >= 0)
                    settle(&items[base + k], KVP_OUT_FAILED, -r);
            }
            return r;
        }
        kvp_run_pool(c, items + base, m, w->fds, w->spans);
    }
    return 0;
}
