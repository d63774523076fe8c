/*
 * queue.h: the asynchronous queue's insides (queue.c) and its depth controller
 * (depthctl.c).  Internal, like internal.h: cffi reads only kvprefetch.h.
 */
#ifndef KVP_QUEUE_H
#define KVP_QUEUE_H

#include "internal.h"

#include <pthread.h>

#define KVP_QUEUE_MAX_ROOTS 64  /* roots tracked apart; more share the last slot */
#define KVP_QUEUE_MAX_CLIENTS 8 /* clients a root keeps apart; more share the last slot */

#pragma GCC visibility push(hidden)

/* ---- depthctl.c: how many reads a root keeps in flight -------------------- */
#define KVP_DEPTH_HISTORY 16  /* windows remembered for the uncongested service time */

struct kvp_depth {
    double limit;          /* reads in flight allowed now */
    uint32_t max;          /* never more: the queue's max_threads */
    int slow_start;        /* doubling until the service time first rises */
    int64_t window_start;  /* ns */
    uint64_t window_n, window_sum_ns;
    uint32_t window_peak;  /* most reads in flight during the window */
    int window_backlog;    /* files were waiting for depth during the window */
    int64_t history[KVP_DEPTH_HISTORY];  /* mean service time of recent windows, ns */
    uint32_t history_n, history_at;
    int64_t rtt_ns;        /* the last window's mean service time */
    double best_rate;      /* the most reads per second a window has seen (decaying) */
    double best_depth;     /* the depth that window ran at */
    int64_t window_min_ns; /* the window's fastest fetch (1 ms or more) */
    int64_t floor_ns;      /* the fastest fetch remembered: the tier's own latency */
    double best_served;    /* the most reads the tier served at once lately (decaying) */
    int trusted;           /* a remote root, started at the depth its profile gave */
    int64_t read_ns;       /* a read's time, averaged per read (0.7/0.3): admission's */
};

void kvp_depth_init(struct kvp_depth *d, uint32_t initial, uint32_t max);
/* Start at a depth the root's tier profile trusts (a remote tier: no ramp); its
 * first full window brings it down to what the tier served (Little's law). */
void kvp_depth_trust(struct kvp_depth *d, uint32_t initial, uint32_t max);
uint32_t kvp_depth_limit(const struct kvp_depth *d);
/* One read finished after service_ns, with in_flight reads (itself included)
 * running and files waiting (backlog) when it ended. */
void kvp_depth_sample(struct kvp_depth *d, int64_t service_ns, uint32_t in_flight, int backlog,
                      int64_t now);
/* A read running longer than this is stalled: it keeps its thread but not its
 * root's depth, so a hung tier cannot hold every slot. */
int64_t kvp_depth_stall_ns(const struct kvp_depth *d);
int64_t kvp_depth_rtt_ns(const struct kvp_depth *d);
/* A read's time lately, moved by every read (not once a window): what a file asked
 * for now waits, the tier's queue included (schedule.c's admission; 0: none yet). */
int64_t kvp_depth_read_ns(const struct kvp_depth *d);
/* The tier's fastest fetch remembered (0: none yet). */
int64_t kvp_depth_floor_ns(const struct kvp_depth *d);

/* ---- gauge.c: when a read asked for now would be back, from the tier's count -- */
struct kvp_gauge {
    int fd;                /* the FUSE connection's fusectl directory (O_PATH), -1: none */
    double rate;           /* requests a second the tier answers (0: not learned yet) */
    int64_t sampled_ns;    /* when a read last taught it (CLOCK_MONOTONIC) */
};

void kvp_gauge_init(struct kvp_gauge *g);
/* Count by the FUSE connection's fusectl directory (/sys/fs/fuse/connections/N): 0,
 * or -errno (fusectl not mounted, not readable): the root then has no gauge. */
int kvp_gauge_open(struct kvp_gauge *g, const char *connection);
void kvp_gauge_close(struct kvp_gauge *g);
/* The tier's requests not answered yet, every reader's; -1 when there is no gauge. */
int64_t kvp_gauge_waiting(const struct kvp_gauge *g);
/* A read asked for with `ahead` requests before it took service_ns. */
void kvp_gauge_sample(struct kvp_gauge *g, int64_t ahead, int64_t service_ns, int64_t floor_ns,
                      int64_t now);
/* When a read asked for now, behind `ahead` requests, is back (g->rate > 0). */
int64_t kvp_gauge_back_ns(const struct kvp_gauge *g, int64_t ahead, int64_t floor_ns);
/* The fetches the tier serves at once: its rate times its fastest fetch (0: unknown). */
int64_t kvp_gauge_slots(const struct kvp_gauge *g, int64_t floor_ns);

/* ---- queue.c ------------------------------------------------------------ */
struct qitem {
    struct kvp_item it;      /* it.rel points at rel[] below */
    uint64_t tag;            /* the caller's, returned with the outcome */
    uint64_t seq;            /* submission order: picks a scratch buffer */
    int64_t submitted, started;  /* CLOCK_MONOTONIC ns */
    uint16_t root;           /* index in kvp_queue.roots */
    uint8_t stalled;         /* counted in its lane's stalled reads */
    uint8_t abandoned;       /* settled by timeout; its thread frees it */
    uint8_t other_mount;     /* behind another mount beneath its root: the other-mount lane's */
    uint8_t client;          /* its client's slot in its root (schedule.c) */
    uint8_t timed_live;      /* running, with a deadline, not stalled: in its root's timed_live */
    uint8_t standby;         /* refused on arrival, on its root's standby list (schedule.c) */
    int held_fd;             /* KVP_ITEM_HOLD: the fd a READ kept open for the reaper, else -1 */
    int32_t ahead;           /* the tier's requests before its read (gauge.c), -1: unknown */
    int64_t asked;           /* when its read went to the tier, ahead counted (ns) */
    struct qitem *next, *prev;
    char rel[];
};

struct qlist {
    struct qitem *head, *tail;
    uint32_t n;
};

/* One client's files waiting on one root, in the order schedule.c serves them:
 * those with a deadline, earliest first; then the others, newest request first and
 * each request's files in their own order (group 0: at the end, as they came). */
struct qclient {
    uint32_t id;             /* kvp_item.client */
    struct qlist pending;
    struct qitem *last_timed;  /* the last file with a deadline (NULL: none waits) */
    struct qitem *newest;    /* the last file of the newest group (NULL: none waits) */
    uint32_t group;          /* that group */
};

struct qroot {
    int fd;                  /* the root's fd, as items name it */
    struct qclient clients[KVP_QUEUE_MAX_CLIENTS];
    uint32_t nclients, turn; /* clients seen; the one whose turn is next */
    uint32_t npending;       /* files waiting for a thread and depth, all clients */
    uint32_t running, stalled;
    uint32_t ntimed;         /* of npending, files with a deadline (admitted: schedule.c) */
    uint32_t timed_live;     /* of running - stalled, reads of files with a deadline */
    struct kvp_depth depth;
    struct kvp_gauge gauge;  /* the tier's own count, where it keeps one (FUSE) */
    struct qlist standby;    /* refused on arrival, read if the tier frees a slot in time */
    int64_t standby_look_ns; /* not looked at again before (schedule.c) */
    int64_t standby_taken_ns;  /* when a standby file was last taken */
    uint32_t standby_taken;  /* files taken since, maybe not in the tier's count yet */
};

/* The other-mount lane (queue.c's header): one FIFO for every root's names behind
 * another mount beneath it, read by at most cap threads of its own. */
struct qlane {
    struct qlist pending;    /* FIFO: waiting for a thread */
    uint32_t cap;            /* threads at most, stuck ones included */
    uint32_t threads, idle, running, stalled;
    struct kvp_depth depth;  /* only its service time, for its stall time */
    uint64_t moved, refused, stalls;
};

struct kvp_queue {
    struct kvp_ctx base;     /* what open.c needs: openat2 and /proc probes, chunk;
                                no_xdev: the roots' lanes stay on each root's own mount */
    struct kvp_ctx across;   /* the same, crossing mounts: the other-mount lane's */
    struct kvp_queue_config cfg;
    pthread_mutex_t mu;
    pthread_cond_t work, exited, lane_work;
    pthread_attr_t attr;
    struct qroot roots[KVP_QUEUE_MAX_ROOTS];
    struct qlane lane;
    uint32_t nroots, turn;
    struct qlist running, done;
    int efd;                 /* eventfd: readable while done is not empty */
    uint32_t threads, idle;
    uint32_t busy;           /* of those threads, the ones holding a file */
    int stopping;
    uint64_t seq, submitted, reaped, timed_out, stalls, spawn_failures;
    uint64_t standby_reads;  /* files read from standby (schedule.c) */
    uint32_t deadlines;      /* pending files with a deadline: the tick sweeps for them */
    char *scratch;
    size_t scratch_len;
};

/* ---- schedule.c: which waiting file of a root goes next ----------------------- */
void kvp_list_push(struct qlist *l, struct qitem *it);
void kvp_list_unlink(struct qlist *l, struct qitem *it);
void kvp_sched_push(struct qroot *r, struct qitem *qi);
void kvp_sched_unlink(struct qroot *r, struct qitem *qi);
/* A request's judgement on r, made once for all its files (kvp_sched_judge), then
 * applied to each by its place in the request (kvp_sched_admits). */
struct kvp_judgement {
    int64_t read_ns;   /* what a read takes on r now */
    int64_t floor_ns;  /* the tier's fastest fetch: a consumer's own fetch at best */
    int through;       /* nothing of r's is out: every file goes through */
    /* Where the tier keeps a count (gauge.c), the request is judged by it instead: */
    const struct kvp_gauge *gauge;  /* NULL: judged by read_ns */
    int64_t waiting;   /* the tier's requests not answered when judged */
    int whole;         /* every file would be back by the deadline: all go */
    int partial;       /* not whole, but the tier's queue is short and the consumer far */
    int64_t reach;     /* partial: when the consumer gets to the next file, at the soonest */
    int probe;         /* the rate is stale and nothing is out: the first file goes */
    uint32_t admitted; /* files let through so far */
};
/* r's judgement of a request of `files` files (those of it on r in this batch) with a
 * deadline at deadline_ns, asked for at now. */
struct kvp_judgement kvp_sched_judge(const struct qroot *r, int64_t deadline_ns, uint32_t files,
                                     int64_t now);
/* May the request's next file, `position` files into it, wait for a read?  0: it
 * cannot be read in time; the caller settles it EXPIRED at once.  *ahead: the tier's
 * requests before it (gauge.c's sample), -1 unknown.  Called for the files in order. */
int kvp_sched_admits(struct kvp_judgement *j, int64_t deadline_ns, uint32_t position,
                     int64_t now, int32_t *ahead);
/* A file the judgement refused, kept on r's standby list: its deadline moves to when
 * its consumer, fetching the files before it itself, could have got to it. */
void kvp_sched_stand_by(struct qroot *r, struct qitem *qi, const struct kvp_judgement *j);
/* The oldest standby file of r still in time, off its list, when the tier has a slot
 * free now (gauge.c: fewer requests not answered than it serves at once); else NULL. */
struct qitem *kvp_sched_standby_take(struct qroot *r, int64_t now);
/* May r start a read now: a file with a deadline waits (those go uncapped), or
 * one without does and the reads without one leave room under the depth. */
int kvp_sched_ready(const struct qroot *r);
/* The next file of r to start at `now` (kvp_sched_ready(r)), off its list. */
struct qitem *kvp_sched_take(struct qroot *r, int64_t now);

#pragma GCC visibility pop

#endif
