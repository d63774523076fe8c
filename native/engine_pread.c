/*
 * engine_pread.c: engines pread/read and fadvise/advise, the queue's (queue.c):
 * each is the work of a queue thread on one open file (struct kvp_engine's
 * warm), the queue's threads and depth being the same for both.  And the one
 * head read every blocking reader shares (kvp_read_head): these engines, and
 * the confirming threads of io_uring/advise (pool.c).
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

/* Read [0, span) of fd into buf (cfg.chunk bytes at a time, thrown away: only
 * the page-cache side effect matters) and settle the item. */
int kvp_read_head(const struct kvp_ctx *c, struct kvp_item *it, int fd, uint64_t span, char *buf)
{
    uint64_t off = 0;
    int e = 0, tries = 0;
    while (off < span) {
        ssize_t r = pread(fd, buf, (size_t)MIN(span - off, (uint64_t)c->cfg.chunk), (off_t)off);
        if (r > 0)
            off += (uint64_t)r;  /* a short read continues from where it stopped */
        else if (r == 0)
            break;  /* EOF: the file shrank since fstat */
        else if (errno != EINTR && !(errno == EAGAIN && tries++ < KVP_RETRIES && !kvp_clear_nonblock(fd))) {
            e = errno;
            break;
        }
    }
    it->done = off;
    settle(it, e ? KVP_OUT_FAILED : KVP_OUT_READ, e);
    return e;
}

/* Advice first: one WILLNEED asks for the whole head as large requests
 * (mm/fadvise.c force_page_cache_readahead), which the confirming reads then
 * wait for instead of requesting chunk by chunk.  cachestat counts pages whose
 * read is still in flight, so only a read can confirm (advise.c). */
static int fadvise_warm(const struct kvp_ctx *c, struct kvp_item *it, int fd, uint64_t span,
                        char *buf)
{
    (void)posix_fadvise(fd, 0, (off_t)span, POSIX_FADV_WILLNEED);  /* advisory */
    return kvp_read_head(c, it, fd, span, buf);
}

/* Neither has a detect: pread(2) and posix_fadvise(2) are nothing a kernel or
 * seccomp profile that runs the daemon at all refuses. */
const struct kvp_engine kvp_engine_pread = {
    .name = "pread",
    .warm_mode = "read",
    .warm = kvp_read_head,
};

const struct kvp_engine kvp_engine_fadvise = {
    .name = "fadvise",
    .warm_mode = "advise",
    .warm = fadvise_warm,
};
