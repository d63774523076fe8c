/*
 * schedule.c: which waiting file of a root the queue starts next.
 *
 * A router asks for a request's files a few hundred milliseconds before its GPU
 * reads them; a file warmed after that read is worth little.  First come, first
 * served made every new request wait behind the whole backlog of older ones,
 * which at that point are already at their GPU or past their deadline (issue 25).
 * So, per root:
 *
 * - Clients take turns (round robin, one file each): a bulk CLI run of 100,000
 *   files shares a root's depth with the router instead of taking it.  A client
 *   is who sent the request (the supervisor's number for a Unix peer's process or
 *   a TCP peer's address); the first KVP_QUEUE_MAX_CLIENTS a root sees are kept
 *   apart, later ones share the last slot.
 * - A request's files with a deadline are judged when they arrive, together
 *   (they share the request's deadline), each by its place in the request: its
 *   consumer reads them in order, starting at the deadline, and for each file
 *   it finds cold it fetches it itself, which takes at least the tier's fastest
 *   fetch (depthctl.c's floor).  So file k is wanted no sooner than the deadline
 *   plus k such fetches when the files before it are late.  When a read takes
 *   longer on the root now (an average moved by every read, the tier's own
 *   queue included: depthctl.c's read_ns) than is left until then, the file is
 *   not read: it settles EXPIRED at once and is left to its consumer, taking no
 *   read ahead of a request that can still make it.  A request whose first
 *   file cannot make it may still have its later files warm when its consumer
 *   gets to them (measured in the router replay, docs/bench/replay.md); one
 *   whose read time is past every file's is refused whole.  When none of the root's
 *   reads is out and none waits, they go through whatever the average says, so
 *   it cannot stay stale.  On an overloaded tier this is what counts: the queue that decides
 *   is the tier's own, first come, first served, shared with the consumers, and
 *   a read taken by a doomed request is a slot lost to one that can still be
 *   warm in time (bench/replay_bound.py models it; docs/bench/replay.md).
 * - Where the tier counts its own requests (a FUSE connection: gauge.c), that
 *   count judges instead of the average, which lags the tier's queue by a read.
 *   The request goes whole when its last file, behind everything the tier has
 *   not answered, would be back by the deadline.  When not, its files that
 *   would be back before the consumer gets to them (each one refused adds a
 *   fetch to the consumer's way) go, but only while the tier's queue is shorter
 *   than PARTIAL_FETCHES fetches and the consumer that many away: in overload,
 *   a part of a request that cannot be warm whole takes the slots a whole one
 *   needs (at 150% load, 2.2-3.3x the FIFO pool's requests fully warm on
 *   time, against 1.3-2.0x by the average).  The price was at moderate load:
 *   the consumer of a request refused whole fetched its files one by one
 *   through the tier's queue (docs/bench/replay.md, 0.10.0).  So a file refused
 *   there is not dropped: it stands by (the root's standby list, oldest first)
 *   and is read when the tier has a slot free, its count under the fetches it
 *   serves at once (the rate times the floor), until its consumer could have
 *   got to it: the deadline plus a fetch for it and each file before it.  A
 *   free slot takes nothing from a request to come; in overload there is none.
 *   A thread with nothing else to do looks (at a submission, a tick, as its
 *   read ends), at most once a STANDBY_LOOK_NS after finding the slots busy;
 *   a file just taken counts as a busy slot until its read can be in the count.
 * - The files that went through are read at once, not held behind the root's
 *   depth: on a first-come, first-served tier, entering early is what counts,
 *   and the admission already bounds them.  The depth (depthctl.c) caps the
 *   reads without a deadline only.
 * - Within a client, files with a deadline go first, earliest deadline first,
 *   but only those that can still be read in time: one whose deadline is nearer
 *   than a read takes on the root now would be late however soon it started, so
 *   every file that can still make it goes before it.  The mean, not the tier's
 *   fastest fetch: where other readers queue in the tier too, a file judged by
 *   the fastest fetch is read first (its deadline is nearest) and is late all
 *   the same, and so, in turn, is the file that waited for it.
 * - Then the files without a deadline, the newest request first and each
 *   request's files in their own order: the newest request is the one whose
 *   consumer is furthest from reading.  Group 0 (a caller that names no request)
 *   is first come, first served, after them.
 * - Last, the files too late to be read in time, in deadline order.  They are
 *   not dropped: a read still shortens its consumer's (who waits on the read in
 *   flight).  Past its deadline a file is dropped unread (EXPIRED, queue.c's
 *   sweep).
 *
 * Everything here runs under the queue's mutex.  Insertion is O(1) when a
 * request's files share one deadline (they do: the request's) and deadlines
 * arrive in order; the pick walks at most SKIP_MAX late files.
 */
#include "queue.h"

#define SKIP_MAX 64  /* late files the pick walks past before it takes one anyway */
/* Where the tier keeps a count, a request that cannot be warm whole gets files only
 * while the tier's queue is shorter than this many fetches and its consumer is at
 * least this many fetches away (the header). */
#define PARTIAL_FETCHES 2
#define GAUGE_STALE_NS 1000000000  /* a gauge's rate no read has taught for 1 s */
/* After finding every slot of the tier busy, the standby list is not looked at again
 * for this long (a submission wakes every idle thread, and each look reads the count);
 * a file taken counts as a slot for this long, until its read is in the count. */
#define STANDBY_LOOK_NS 1000000

void kvp_list_push(struct qlist *l, struct qitem *it)
{
    it->next = NULL;
    it->prev = l->tail;
    if (l->tail)
        l->tail->next = it;
    else
        l->head = it;
    l->tail = it;
    l->n++;
}

/* Put it after `at` (NULL: at the head). */
static void insert_after(struct qlist *l, struct qitem *at, struct qitem *it)
{
    if (!at) {
        it->prev = NULL;
        it->next = l->head;
        if (l->head)
            l->head->prev = it;
        else
            l->tail = it;
        l->head = it;
    } else {
        it->prev = at;
        it->next = at->next;
        if (at->next)
            at->next->prev = it;
        else
            l->tail = it;
        at->next = it;
    }
    l->n++;
}

void kvp_list_unlink(struct qlist *l, struct qitem *it)
{
    if (it->prev)
        it->prev->next = it->next;
    else
        l->head = it->next;
    if (it->next)
        it->next->prev = it->prev;
    else
        l->tail = it->prev;
    it->next = it->prev = NULL;
    l->n--;
}

static struct qclient *client_of(struct qroot *r, uint32_t id)
{
    for (uint32_t i = 0; i < r->nclients; i++)
        if (r->clients[i].id == id)
            return &r->clients[i];
    if (r->nclients == KVP_QUEUE_MAX_CLIENTS)
        return &r->clients[KVP_QUEUE_MAX_CLIENTS - 1];
    struct qclient *c = &r->clients[r->nclients++];
    *c = (struct qclient){ .id = id };
    return c;
}

static int64_t deadline_of(const struct qitem *qi)
{
    return qi->it.deadline_ns;
}

/* A file with a deadline: after the last one whose deadline is not later. */
static void push_timed(struct qclient *c, struct qitem *qi)
{
    struct qitem *at = c->last_timed;
    while (at && deadline_of(at) > deadline_of(qi))
        at = at->prev;
    insert_after(&c->pending, at, qi);
    if (at == c->last_timed)
        c->last_timed = qi;
}

/* A file without one: its request's files stay in order, a newer request goes
 * ahead of every older one, group 0 at the end. */
static void push_untimed(struct qclient *c, struct qitem *qi)
{
    uint32_t group = qi->it.group;
    if (group == 0) {
        kvp_list_push(&c->pending, qi);
        return;
    }
    struct qitem *at = group == c->group && c->newest ? c->newest : c->last_timed;
    insert_after(&c->pending, at, qi);
    c->group = group;
    c->newest = qi;
}

void kvp_sched_push(struct qroot *r, struct qitem *qi)
{
    struct qclient *c = client_of(r, qi->it.client);
    qi->client = (uint8_t)(c - r->clients);
    if (deadline_of(qi) > 0) {
        push_timed(c, qi);
        r->ntimed++;
    } else {
        push_untimed(c, qi);
    }
    r->npending++;
}

void kvp_sched_unlink(struct qroot *r, struct qitem *qi)
{
    struct qclient *c = &r->clients[qi->client];
    struct qitem *prev = qi->prev;
    if (c->last_timed == qi)
        c->last_timed = prev;  /* timed files are a prefix: prev is timed or NULL */
    if (c->newest == qi)
        c->newest = prev && deadline_of(prev) == 0 && prev->it.group == c->group ? prev : NULL;
    kvp_list_unlink(&c->pending, qi);
    r->npending--;
    r->ntimed -= deadline_of(qi) > 0;
}

struct kvp_judgement kvp_sched_judge(const struct qroot *r, int64_t deadline_ns, uint32_t files,
                                     int64_t now)
{
    struct kvp_judgement j = {
        .read_ns = kvp_depth_read_ns(&r->depth),
        .floor_ns = kvp_depth_floor_ns(&r->depth),
        .through = r->running - r->stalled == 0 && r->ntimed == 0,  /* nothing out */
        .waiting = kvp_gauge_waiting(&r->gauge),  /* read even unlearned: reads teach it */
    };
    if (j.waiting < 0 || r->gauge.rate <= 0 || j.floor_ns <= 0)
        return j;  /* no count, or nothing learned yet: by the reads' own times */
    j.gauge = &r->gauge;
    j.probe = j.through && now - r->gauge.sampled_ns > GAUGE_STALE_NS;
    int64_t last = kvp_gauge_back_ns(&r->gauge, j.waiting + (files ? files - 1 : 0), j.floor_ns);
    int64_t first = kvp_gauge_back_ns(&r->gauge, j.waiting, j.floor_ns);
    j.whole = now + last <= deadline_ns;
    j.partial = first - j.floor_ns < PARTIAL_FETCHES * j.floor_ns
                && deadline_ns - now >= PARTIAL_FETCHES * j.floor_ns;
    j.reach = deadline_ns;
    return j;
}

int kvp_sched_admits(struct kvp_judgement *j, int64_t deadline_ns, uint32_t position,
                     int64_t now, int32_t *ahead)
{
    int64_t behind = j->waiting + j->admitted;
    *ahead = -1;
    if (!j->gauge) {
        /* At best the consumer fetched each file before this one itself, at the tier's
         * fastest: it reaches this one that much after the deadline, and no sooner. */
        int64_t reached = deadline_ns + (int64_t)position * j->floor_ns;
        if (!j->through && now + j->read_ns > reached)
            return 0;
    } else if (j->probe) {
        j->probe = 0;  /* a read to learn from: the rate is stale (gauge.c) */
    } else if (!j->whole) {
        if (!j->partial)
            return 0;
        if (now + kvp_gauge_back_ns(j->gauge, behind, j->floor_ns) > j->reach) {
            j->reach += j->floor_ns;  /* left to its consumer, who fetches it first */
            return 0;
        }
    }
    if (j->waiting >= 0)
        *ahead = behind > INT32_MAX ? INT32_MAX : (int32_t)behind;
    j->admitted++;
    return 1;
}

void kvp_sched_stand_by(struct qroot *r, struct qitem *qi, const struct kvp_judgement *j)
{
    qi->standby = 1;
    qi->it.deadline_ns += (int64_t)(qi->it.position + 1) * j->floor_ns;
    kvp_list_push(&r->standby, qi);
}

struct qitem *kvp_sched_standby_take(struct qroot *r, int64_t now)
{
    struct qitem *qi = r->standby.head;
    while (qi && qi->it.deadline_ns <= now)
        qi = qi->next;  /* out of time: queue.c's sweep settles it */
    if (!qi || now < r->standby_look_ns)
        return NULL;
    int64_t slots = kvp_gauge_slots(&r->gauge, kvp_depth_floor_ns(&r->depth));
    int64_t waiting = kvp_gauge_waiting(&r->gauge);
    /* Files taken a moment ago may not be in the count yet (their threads are
     * opening them): the threads a submission wakes would all take one. */
    if (now - r->standby_taken_ns > STANDBY_LOOK_NS)
        r->standby_taken = 0;
    if (waiting < 0 || waiting + r->standby_taken >= slots) {
        /* every slot busy: a read now would queue ahead of the requests to come */
        r->standby_look_ns = now + STANDBY_LOOK_NS;
        return NULL;
    }
    kvp_list_unlink(&r->standby, qi);
    qi->standby = 0;
    waiting += r->standby_taken++;
    r->standby_taken_ns = now;
    qi->ahead = waiting > INT32_MAX ? INT32_MAX : (int32_t)waiting;
    return qi;
}

int kvp_sched_ready(const struct qroot *r)
{
    if (r->ntimed > 0)
        return 1;
    return r->npending > 0
           && r->running - r->stalled - r->timed_live < kvp_depth_limit(&r->depth);
}

/* The client's next file: the earliest deadline it can still meet; else the
 * newest request's next file; else the earliest of the late ones. */
static struct qitem *pick(struct qclient *c, int64_t now, int64_t service_ns)
{
    struct qitem *qi = c->pending.head;
    int walked = 0;
    for (; qi && deadline_of(qi) > 0; qi = qi->next) {
        if (deadline_of(qi) >= now + service_ns || ++walked > SKIP_MAX)
            return qi;
    }
    return qi ? qi : c->pending.head;
}

struct qitem *kvp_sched_take(struct qroot *r, int64_t now)
{
    int64_t service_ns = kvp_depth_rtt_ns(&r->depth);
    /* At the depth, only files with a deadline start (a timed prefix: last_timed). */
    int capped = r->running - r->stalled - r->timed_live >= kvp_depth_limit(&r->depth);
    for (uint32_t k = 0; k < r->nclients; k++) {
        uint32_t i = (r->turn + k) % r->nclients;
        struct qclient *c = &r->clients[i];
        if (c->pending.n == 0 || (capped && !c->last_timed))
            continue;
        r->turn = (i + 1) % r->nclients;
        struct qitem *qi = pick(c, now, service_ns);
        if (capped && deadline_of(qi) == 0)
            qi = c->pending.head;  /* every timed file is late: the earliest */
        kvp_sched_unlink(r, qi);
        return qi;
    }
    return NULL;
}
