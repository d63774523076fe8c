/*
 * gauge.c: when a read asked for now would be back, from the tier's own count.
 *
 * Admission (schedule.c) needs, for a request's files, when a read started now
 * would be back.  A root's own reads say what the tier did for them one read
 * ago; where the tier's queue is shared with the consumers fetching what was not
 * warmed, that lags by a whole queue, and in overload the queue grows faster than
 * the average follows.  In the router replay's model of a first-come, first-served
 * tier (bench/replay_bound.py, 30 streams), admission by the reads' own times had
 * twice the pool's requests fully warm at 150% load in none; by this count, in 28.
 *
 * A FUSE connection counts the requests it has not answered yet (fusectl's
 * `waiting`: queued in the file system or being served), every reader's, now.
 * The other half is the rate the tier answers them at, learned from this root's
 * own reads: each carries the requests ahead of it (`ahead`: the count as its read
 * goes to the tier, its open done, or at its admission plus its place in its
 * request, whichever is more: a burst's reads may not all be in yet) and took `t`
 * from there.
 * - Well over the tier's fastest fetch (the floor: SATURATED times it), the read
 *   queued: the tier served its `ahead` and it in t.  (ahead + 1) / t is the rate,
 *   averaged over such reads (0.7/0.3, as the depth's read time).
 * - About the floor, the tier was not the limit: it could have served more, so the
 *   rate is at least (ahead + 1) / t.
 * - Much under the floor (JOINED), the read found the fetch already out (another
 *   reader's) and says nothing.
 * A read asked for now, behind n requests, is back after max(floor, (n + 1) / rate).
 * Only reads teach the rate, and a rate learned too low would refuse every read
 * that could correct it: when no read has taught it for a second and none of the
 * root's is out, a request's first file goes through whatever it says
 * (schedule.c's probe).
 *
 * Only FUSE keeps such a count; elsewhere (NFS, Lustre, a local disk) admission
 * goes on with the reads' own times (schedule.c).  Everything here runs under the
 * queue's mutex but the count read before a read: an open, a read and a close of a
 * fusectl file (it cannot seek), once per request judged, once per cold file read
 * (next to a fetch, nothing) and, under the mutex too, once per look at a root's
 * standby list (schedule.c: at most one a STANDBY_LOOK_NS while every slot is busy,
 * else one per file it takes).
 */
#include "queue.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#define SATURATED 1.25  /* a read this many floors long queued in the tier */
#define JOINED 0.8      /* a read under this many floors joined a fetch already out */

void kvp_gauge_init(struct kvp_gauge *g)
{
    *g = (struct kvp_gauge){ .fd = -1 };
}

int kvp_gauge_open(struct kvp_gauge *g, const char *connection)
{
    if (g->fd >= 0)
        return 0;  /* a root's fd names one mount: its connection does not change */
    int fd = open(connection, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    struct kvp_gauge trial = { .fd = fd };
    if (kvp_gauge_waiting(&trial) < 0) {
        int e = errno ? errno : EINVAL;
        close(fd);
        return -e;
    }
    g->fd = fd;
    return 0;
}

void kvp_gauge_close(struct kvp_gauge *g)
{
    if (g->fd >= 0)
        close(g->fd);
    g->fd = -1;
}

int64_t kvp_gauge_waiting(const struct kvp_gauge *g)
{
    char buf[32];
    if (g->fd < 0)
        return -1;
    /* fusectl's files cannot seek (no pread, no lseek): a fresh open each time */
    int fd = openat(g->fd, "waiting", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;  /* the connection went (unmounted): as if there were no gauge */
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = '\0';
    char *end;
    long long v = strtoll(buf, &end, 10);
    return end == buf || v < 0 ? -1 : (int64_t)v;
}

void kvp_gauge_sample(struct kvp_gauge *g, int64_t ahead, int64_t service_ns, int64_t floor_ns,
                      int64_t now)
{
    if (ahead < 0 || floor_ns <= 0 || service_ns < (int64_t)(JOINED * (double)floor_ns))
        return;
    g->sampled_ns = now;
    double rate = (double)(ahead + 1) * 1e9 / (double)service_ns;
    if ((double)service_ns > SATURATED * (double)floor_ns)
        g->rate = g->rate > 0 ? 0.7 * g->rate + 0.3 * rate : rate;
    else if (rate > g->rate)
        g->rate = rate;
}

int64_t kvp_gauge_back_ns(const struct kvp_gauge *g, int64_t ahead, int64_t floor_ns)
{
    int64_t served = (int64_t)((double)(ahead + 1) * 1e9 / g->rate);
    return served > floor_ns ? served : floor_ns;
}

int64_t kvp_gauge_slots(const struct kvp_gauge *g, int64_t floor_ns)
{
    if (g->rate <= 0 || floor_ns <= 0)
        return 0;
    return (int64_t)(g->rate * (double)floor_ns / 1e9 + 0.5);
}
