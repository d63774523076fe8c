/*
 * depthctl.c: how many reads one root keeps in flight.
 *
 * Little's law: files per second = reads in flight / service time.  A warm-up
 * wants files per second; latency only matters once it stops buying throughput.
 * So the depth climbs while it pays: doubled per window at first, like TCP's
 * slow start (a tier with 100 ms fetches needs hundreds in flight, and a
 * cautious ramp would be most of a warm-up), then by a quarter.  When a deeper
 * window brought no more files per second and the service time climbed (reads
 * queue behind a saturated device, a tier's fetch slots, or the tier itself
 * running out of CPU), the depth goes back to where the best throughput was
 * seen, plus a tenth so the bottleneck never idles.  The best is forgotten
 * slowly (2% a window), so the depth probes upward again now and then and
 * follows a tier that got faster or slower.
 *
 * A window ends after max(4, depth/2) reads, or half a second with at least
 * one: about one round of reads in flight, so each step sees the effect of the
 * last.  A window whose reads never filled half the depth, or with no file
 * waiting, says nothing about more depth (the root was not the limit): the
 * depth stays.
 *
 * A ramp from 16 costs a slow tier's first burst several round trips: 64 files
 * on a 100 ms tier took 225 ms right after start, 130 ms once the depth had
 * climbed (issue 25).  So a root whose tier profile says its reads wait on a
 * remote fetch starts at the depth the profile gives (kvp_depth_trust: a FUSE
 * mount's max_background, a network file system's full depth) and pays no ramp.
 * Nothing measured that depth, so every window of such a root (4 reads or more,
 * a backlog or not) checks it with Little's law: the reads the tier served at
 * once are the window's reads per second times the tier's own latency, its
 * fastest fetch (`floor`, kept across windows and let rise 1% a window so it
 * follows a tier that got slower; reads under FETCH_MIN_NS were cache hits and
 * say nothing of it).  It falls at most 10% a window (FLOOR_FALL): a read that
 * joined a fetch already out (a consumer's) is faster than any fetch, and one
 * of those, 11 of 687 reads in the router replay, held the floor at 14-77 ms of
 * a 100 ms tier for the rest of the run, and with it every judgement made by it
 * (schedule.c).  A tier that got faster is followed in a few dozen windows.  Not
 * a rank among recent reads: in a burst on a tier of two fetch slots the third
 * fastest read had queued behind the first two.  Where the window's mean read
 * took more than QUEUED times that, reads were queueing inside the file
 * system, where no request can overtake another: the depth comes down to the
 * most the tier has served at once lately, plus headroom, and the backlog waits
 * here instead, where the most urgent file goes first (schedule.c).  Jitter
 * alone keeps the mean well under QUEUED times the floor.
 * Where the queue in the tier is other readers' (the consumers fetching what was
 * not warmed), the root keeps what the tier served it at best, and no more: a
 * consumer's read is the one a GPU waits on now.
 */
#include "queue.h"

#define WINDOW_MAX_NS 500000000  /* 0.5 s */
#define GAIN 1.05                /* a window is better when 5% faster */
#define RISE_TOLERANCE 1.15      /* service time within 15% of the best: no congestion */
#define HEADROOM 1.10            /* above the best depth, so the bottleneck stays busy */
#define FORGET 0.98              /* the best throughput decays per window */
#define STEP 1.25                /* growth per window once out of slow start */
#define MIN_DEPTH 2.0
#define STALL_MIN_NS 2000000000  /* a read is stalled after 2 s at least ... */
#define STALL_FACTOR 20          /* ... or 20 times the root's service time */
#define FETCH_MIN_NS 1000000     /* a read faster than 1 ms was a cache hit, not a fetch */
#define QUEUED 2.0               /* mean over fastest fetch: reads queued in the tier */
#define FLOOR_RISE 1.01          /* the remembered fastest fetch may rise 1% a window */
#define FLOOR_FALL 0.90          /* ... and fall 10% */

void kvp_depth_init(struct kvp_depth *d, uint32_t initial, uint32_t max)
{
    *d = (struct kvp_depth){ .limit = initial, .max = max, .slow_start = 1 };
}

void kvp_depth_trust(struct kvp_depth *d, uint32_t initial, uint32_t max)
{
    kvp_depth_init(d, initial, max);
    d->trusted = 1;  /* for good: its windows check what the tier serves */
}

/* A trusted root's window: down to what the tier served at once, when reads
 * queued inside it.  1 when it came down. */
static int cap_to_served(struct kvp_depth *d, double rate, int64_t mean)
{
    /* A window served what it was asked, not what the tier can: at a light load,
     * or while other readers hold the tier, the most the tier has served at once
     * lately is what it serves (forgotten as slowly as the best rate). */
    double served = rate * (double)d->floor_ns / 1e9;
    d->best_served = MAX(d->best_served * FORGET, served);
    served = d->best_served;
    if (d->floor_ns > 0 && (double)mean > QUEUED * (double)d->floor_ns
        && served * HEADROOM < d->limit) {
        d->limit = served * HEADROOM;
        d->slow_start = 0;
        d->best_rate = rate;
        d->best_depth = d->limit;
        return 1;
    }
    return 0;
}

uint32_t kvp_depth_limit(const struct kvp_depth *d)
{
    return (uint32_t)d->limit;
}

int64_t kvp_depth_rtt_ns(const struct kvp_depth *d)
{
    return d->rtt_ns;
}

int64_t kvp_depth_read_ns(const struct kvp_depth *d)
{
    return d->read_ns;
}

int64_t kvp_depth_floor_ns(const struct kvp_depth *d)
{
    return d->floor_ns;
}


int64_t kvp_depth_stall_ns(const struct kvp_depth *d)
{
    int64_t scaled = d->rtt_ns * STALL_FACTOR;
    return scaled > STALL_MIN_NS ? scaled : STALL_MIN_NS;
}

static int64_t best_recent_rtt(const struct kvp_depth *d)
{
    int64_t best = 0;
    for (uint32_t i = 0; i < d->history_n; i++)
        if (best == 0 || d->history[i] < best)
            best = d->history[i];
    return best;
}

static void close_window(struct kvp_depth *d, int64_t now)
{
    int64_t mean = (int64_t)(d->window_sum_ns / d->window_n);
    int64_t elapsed = now - d->window_start;
    double rate = elapsed > 0 ? (double)d->window_n * 1e9 / (double)elapsed : 0;
    int64_t base = best_recent_rtt(d);
    int informative = d->window_backlog && d->window_peak * 2 >= (uint32_t)d->limit;
    d->history[d->history_at] = mean;
    d->history_at = (d->history_at + 1) % KVP_DEPTH_HISTORY;
    if (d->history_n < KVP_DEPTH_HISTORY)
        d->history_n++;
    d->rtt_ns = mean;
    if (d->window_min_ns > 0 && d->floor_ns == 0) {
        d->floor_ns = d->window_min_ns;
    } else if (d->window_min_ns > 0) {  /* the fastest fetch, let rise 1% a window, fall 10% */
        double least = (double)d->floor_ns * FLOOR_FALL, most = (double)d->floor_ns * FLOOR_RISE;
        double t = (double)d->window_min_ns;
        d->floor_ns = (int64_t)(t < least ? least : t > most ? most : t);
    }
    d->best_rate *= FORGET;
    if (d->trusted && d->window_n >= 4 && cap_to_served(d, rate, mean)) {
        /* reads queued in the tier, backlog here or not: fewer in flight */
    } else if (informative) {
        if (rate > d->best_rate * GAIN || base == 0 || mean <= base * RISE_TOLERANCE) {
            if (rate > d->best_rate) {
                d->best_rate = rate;
                d->best_depth = d->limit;
            }
            d->limit = d->slow_start ? d->limit * 2 : d->limit * STEP;
        } else {
            /* No more files per second and slower reads: past the knee. */
            d->slow_start = 0;
            d->limit = d->best_depth > 0 ? d->best_depth * HEADROOM : d->limit / 2;
        }
    }
    if (d->limit > d->max)
        d->limit = d->max;
    if (d->limit < MIN_DEPTH)
        d->limit = MIN_DEPTH;
    d->window_start = now;
    d->window_n = d->window_sum_ns = 0;
    d->window_peak = 0;
    d->window_backlog = 0;
    d->window_min_ns = 0;
}

void kvp_depth_sample(struct kvp_depth *d, int64_t service_ns, uint32_t in_flight, int backlog,
                      int64_t now)
{
    /* A window starts with its first read (not at the last close): an idle spell
     * between two bursts must not count as a slow window. */
    if (d->window_n == 0 && d->window_start < now - service_ns)
        d->window_start = now - service_ns;
    d->window_n++;
    d->window_sum_ns += (uint64_t)(service_ns > 0 ? service_ns : 0);
    /* Per read, not per window: a window's mean lags a tier's growing queue by up to
     * half a second, and admitted doomed requests in the meantime (bench/replay_bound.py). */
    d->read_ns = d->read_ns > 0 ? (int64_t)(0.7 * (double)d->read_ns + 0.3 * (double)service_ns)
                                : service_ns;
    if (service_ns >= FETCH_MIN_NS && (d->window_min_ns == 0 || service_ns < d->window_min_ns))
        d->window_min_ns = service_ns;
    if (in_flight > d->window_peak)
        d->window_peak = in_flight;
    d->window_backlog |= backlog;
    uint64_t enough = (uint64_t)(d->limit / 2);
    if ((d->window_n >= 4 && d->window_n >= enough) || now - d->window_start > WINDOW_MAX_NS)
        close_window(d, now);
}
