/*
 * engine_pread.c: engine pread/read.  Blocking reads of every head, spread over
 * cfg.threads threads that each open their own items (pool.c): the portable
 * engine, needing nothing but pread(2).  With cold metadata the opens cost more
 * than the reads, and threads open in parallel (engines/__init__.py has the
 * measurement that makes this `auto`'s first choice in read mode).
 */
#include "internal.h"

static int pread_run(struct kvp_ctx *c, struct kvp_item *items, size_t n)
{
    kvp_run_pool(c, items, n, NULL, NULL);
    return 0;
}

const struct kvp_engine kvp_engine_pread = {
    .name = "pread",
    .warm_mode = "read",
    .run = pread_run,
};
