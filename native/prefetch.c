/*
 * prefetch.c: the C half of kvprefetchd._native (contract: kvprefetch.h).
 * Per item: resolve rel beneath root_fd (openat2 RESOLVE_BENEATH, O_PATH),
 * fstat, refuse anything but a regular file, apply the residency rule, reopen
 * the verified inode for reading, warm [0, min(size, want)), close.
 * kvp_item.err is the kernel's errno, except: a non-regular file is REJECTED
 * with EISDIR (directory), ELOOP (symlink, openat2-less walk only) or EINVAL
 * (FIFO, socket, device); an empty rel or unknown residency with EINVAL; an
 * inode swapped under the /proc-less reopen with ESTALE.
 * A kvp_ctx runs one batch at a time: it is not thread-safe.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/magic.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef KVP_HAVE_LIBURING
#include <liburing.h>
#endif
#include "kvprefetch.h"

/* ---- limits ------------------------------------------------------------- */
#define KVP_MAX_CHUNK (64u << 20)     /* bytes per request; scratch is threads x chunk */
#define KVP_MAX_THREADS 256           /* PREAD / confirm threads per batch */
#define KVP_MAX_QD 4096               /* io_uring SQ entries (the kernel allows 32768) */
#define KVP_FD_RESERVE 64             /* RLIMIT_NOFILE share left to the rest of the process */
#define KVP_RETRIES 8                 /* EAGAIN from openat2 or a read before FAILED */
#define KVP_FADV_PIECE (1u << 30)     /* IORING_OP_FADVISE length is the 32-bit sqe->len */
#define KVP_MINCORE_VEC 4096          /* pages per mincore() call (vector on the stack) */
#define KVP_THREAD_STACK (256u << 10)
/* io_uring reads in flight per file: 1 = a file's next chunk is submitted when
 * the previous one completes, queue_depth spread over more files.  "All chunks
 * at once" measured no better (bench/c/uring_heads.c -d 0; see its header). */
#define KVP_URING_PER_FILE 1

#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* cachestat(2), Linux 6.5 (commit cf264e1329fb), is not in Debian 12's
 * headers: 451 on every architecture using the generic table. */
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
struct kvp_cachestat_range { uint64_t off, len; };
struct kvp_cachestat { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; };

#ifdef KVP_HAVE_LIBURING
struct ureq { uint32_t slot, len; uint64_t off; };  /* one read in flight */
struct uslot {                                     /* one open file being read */
    struct kvp_item *it;                           /* NULL: slot free */
    uint64_t head, next, done;
    int fd, err, eof, tries, queued;
    uint32_t inflight;
};
#endif

struct kvp_ctx {
    struct kvp_config cfg;  /* validated copy */
    int have_openat2;       /* probed once: openat2(2) is Linux 5.6+ */
    int have_proc;          /* /proc/self/fd usable for the race-free reopen */
    int broken;             /* errno that made the ring unusable; later batches fail */
    char *scratch;          /* threads x chunk; the data is thrown away */
    size_t scratch_len;
    int *fds;               /* max_open: one window of open files (FADVISE engines) */
    uint64_t *heads;
#ifdef KVP_HAVE_LIBURING
    struct io_uring ring;
    int ring_ok;
    struct ureq *reqs;      /* queue_depth requests; free ones stacked in rfree */
    uint32_t *rfree, nrfree;
    struct uslot *slots;    /* max_open slots; free ones stacked in sfree */
    uint32_t *sfree, nsfree;
    uint32_t *ready, rhead, rlen;  /* FIFO of slots that may take another chunk */
#endif
};

static int settle(struct kvp_item *it, int outcome, int err)
{
    it->outcome = outcome;
    it->err = err;
    return -1;
}

/* errno from resolving or opening the path -> outcome (kvprefetch.h). */
static int classify(int e)
{
    if (e == ENOENT || e == ENOTDIR)
        return KVP_OUT_MISSING;
    if (e == EXDEV || e == ELOOP || e == ENAMETOOLONG || e == EINVAL || e == ESTALE)
        return KVP_OUT_REJECTED;  /* escapes the root, symlink loop, bad name, swapped */
    return KVP_OUT_FAILED;        /* EACCES/EPERM too: operational, the operator must see it */
}

/* ---- residency ---------------------------------------------------------- */
int kvp_have_cachestat(void)
{
    static atomic_int known = -1;  /* benign race: every thread computes the same */
    int v = atomic_load(&known);
    if (v < 0) {
        struct kvp_cachestat_range r = { 0, 0 };
        struct kvp_cachestat cs;
        /* fd -1 tells EBADF (present) from ENOSYS (kernel < 6.5, or seccomp). */
        v = !(syscall(__NR_cachestat, -1, &r, &cs, 0) < 0 && errno == ENOSYS);
        atomic_store(&known, v);
    }
    return v;
}

/* Since Linux 5.2 (commit 134fca9063ad, "mm/mincore.c: make mincore() more
 * conservative") mincore reports the page cache only for files the caller
 * owns (or has CAP_FOWNER over) or could open for writing; for any other file
 * it claims every page resident (do_mincore: memset(vec, 1, pages)).  That lie
 * would make the PAGECACHE rule skip cold files, so such files get -EPERM, as
 * cachestat itself gives since 6.14 (commit 5f537664e705).  Approximated here
 * from the mode bits (ACLs ignored: an ACL-only writer is refused, which only
 * costs a warm that was not needed) and root standing in for CAP_FOWNER. */
static int mincore_trusted(int fd, const struct stat *st)
{
    struct statvfs sv;
    uid_t uid = geteuid();
    if (uid == 0 || uid == st->st_uid)
        return 1;
    if (fstatvfs(fd, &sv) == 0 && (sv.f_flag & ST_RDONLY))
        return 0;  /* MAY_WRITE fails with EROFS whatever the mode */
    return group_member(st->st_gid) ? !!(st->st_mode & S_IWGRP) : !!(st->st_mode & S_IWOTH);
}

/* mincore(2) counts only uptodate pages (mm/mincore.c mincore_page), not reads
 * in flight, over a mapping of the range. */
static int64_t mincore_bytes(int fd, uint64_t off, uint64_t len)
{
    unsigned char vec[KVP_MINCORE_VEC];
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    struct stat st;
    uint64_t start = off & ~(uint64_t)(pg - 1), end, count = 0;
    int e = 0;
    if (fstat(fd, &st) < 0)
        return -errno;
    if (!mincore_trusted(fd, &st))
        return -EPERM;
    end = (uint64_t)st.st_size;  /* no page beyond EOF can be cached */
    if (off >= end)
        return 0;
    end = MIN(end, off + MIN(len, end - off));
    size_t maplen = (size_t)(end - start), npages = (maplen + pg - 1) / pg;
    void *m = mmap(NULL, maplen, PROT_READ, MAP_SHARED, fd, (off_t)start);
    if (m == MAP_FAILED)
        return -errno;
    for (size_t p = 0; p < npages && !e; p += KVP_MINCORE_VEC) {
        size_t k = MIN(npages - p, (size_t)KVP_MINCORE_VEC);
        if (mincore((char *)m + p * pg, k * pg, vec) < 0)
            e = errno;
        for (size_t i = 0; i < k && !e; i++)
            count += vec[i] & 1;
    }
    munmap(m, maplen);
    return e ? -e : (int64_t)MIN(count * pg, len);
}

int64_t kvp_resident_bytes(int fd, uint64_t off, uint64_t len, int32_t uptodate)
{
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    if (len == 0)
        return 0;
    if (!uptodate && kvp_have_cachestat()) {
        struct kvp_cachestat_range r = { off, len };
        struct kvp_cachestat cs;
        /* cachestat counts every folio in the range, uptodate or still being
         * read (mm/filemap.c filemap_cachestat): right for "skip, it's coming".
         * EPERM (6.14+, see mincore_trusted) is returned as is: never resident. */
        if (syscall(__NR_cachestat, fd, &r, &cs, 0) == 0)
            return (int64_t)MIN(cs.nr_cache * pg, len);
        if (errno != ENOSYS && errno != EOPNOTSUPP)
            return -errno;
    }
    return mincore_bytes(fd, off, len);
}

/* Storage-tier rule: HSM / AFM stubs have no blocks allocated until recalled. */
static int tier_resident(const struct stat *st, uint64_t want)
{
    uint64_t blocks = (uint64_t)st->st_blocks * 512, size = (uint64_t)st->st_size;
    return size <= want ? blocks >= size : blocks > want;
}

/* ---- safe open ---------------------------------------------------------- */

/* openat2-less kernels (< 5.6): walk rel one component at a time from root,
 * refusing ".." and never following a symlink (one anywhere is REJECTED, even
 * if it stays inside): stricter than RESOLVE_BENEATH.  Mounts are crossed, as
 * with RESOLVE_BENEATH. */
static int walk(int root, const char *rel, int flags)
{
    char name[NAME_MAX + 1];
    int dir = root, fd = -EXDEV;
    struct stat st;
    while (*rel != '/') {  /* absolute: EXDEV, as RESOLVE_BENEATH says */
        size_t len = strcspn(rel, "/");
        if (len > NAME_MAX) {
            fd = -ENAMETOOLONG;
            break;
        }
        memcpy(name, rel, len);
        name[len] = '\0';
        rel += len + strspn(rel + len, "/");
        int last = !*rel;
        if (!strcmp(name, "..") && (fd = -EXDEV))
            break;
        if ((len == 0 || !strcmp(name, ".")) && !last)
            continue;
        fd = openat(dir, len ? name : ".", (last ? flags : O_PATH) | O_NOFOLLOW | O_CLOEXEC);
        if (fd < 0) {
            fd = -errno;
            break;
        }
        int e = last ? 0 : fstat(fd, &st) < 0 ? errno : S_ISLNK(st.st_mode) ? ELOOP
                : !S_ISDIR(st.st_mode) ? ENOTDIR : 0;
        if (dir != root)
            close(dir);
        dir = fd;
        if (e)
            fd = -e;
        if (last || e)
            break;
    }
    if (dir != root && (fd < 0 || dir != fd))
        close(dir);
    return fd;
}

/* Open rel beneath root with flags: fd or -errno.  No O_NOFOLLOW with openat2:
 * a leaf symlink is followed and RESOLVE_BENEATH keeps it inside the root (an
 * absolute or escaping target gives EXDEV); RESOLVE_NO_MAGICLINKS refuses
 * /proc-style links (openat2(2)). */
static int resolve(const struct kvp_ctx *c, int root, const char *rel, int flags)
{
    if (!c->have_openat2)
        return walk(root, rel, flags);
    struct open_how how = { .flags = (uint64_t)(flags | O_CLOEXEC),
                            .resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS };
    for (int t = 0; t < KVP_RETRIES; t++) {
        long fd = syscall(SYS_openat2, root, rel, &how, sizeof how);
        if (fd >= 0)
            return (int)fd;
        /* EAGAIN: a rename or mount raced the ".." check (openat2(2) ERRORS). */
        if (errno != EAGAIN && errno != EINTR)
            return -errno;
    }
    return -EAGAIN;
}

/* Reopen the verified O_PATH fd for reading; closes pfd; fd or -errno.
 * /proc/self/fd/N reopens exactly the inode we fstat'ed: a file swapped in
 * after the check is never opened.  Measured on this 6.18 VM (200k iterations
 * x 6, warm dcache, 1 and 6 components): O_PATH openat2 + fstat + /proc reopen
 * 7.3-9.1 us per file; a second openat2 + fstat + dev/ino compare 5.5-6.7 us.
 * That is ~2 us cheaper but opens whatever the path names at that instant: a
 * FIFO or device node swapped in during the race gets opened (never read)
 * before the compare rejects it, and open() of a device can have side effects
 * we must not risk for 2 us per file.  So it is only the fallback without
 * /proc.  O_NONBLOCK: a FIFO never blocks open(), and a conflicting write
 * lease gives EWOULDBLOCK instead of waiting out lease-break-time (fcntl(2)). */
static int reopen(const struct kvp_ctx *c, int pfd, const struct kvp_item *it,
                  const struct stat *st)
{
    const int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
    struct stat st2;
    char path[32];
    int fd;
    if (c->have_proc) {
        snprintf(path, sizeof path, "/proc/self/fd/%d", pfd);
        fd = open(path, flags);
        fd = fd < 0 ? -errno : fd;
    } else {
        fd = resolve(c, it->root_fd, it->rel, flags);
        if (fd >= 0 && (fstat(fd, &st2) < 0 || st2.st_dev != st->st_dev || st2.st_ino != st->st_ino)) {
            close(fd);
            fd = -ESTALE;  /* the path names another inode now: not what we checked */
        }
    }
    close(pfd);
    return fd;
}

/* Reading an O_NONBLOCK regular file may give EAGAIN on file systems without
 * FMODE_NOWAIT (io_uring/rw.c sets REQ_F_NOWAIT then): drop the flag, retry. */
static int clear_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
}

/* Open, classify and check one item: a read fd and *head, or -1 when the item
 * is settled (RESIDENT / MISSING / REJECTED / FAILED). */
static int item_open(struct kvp_ctx *c, struct kvp_item *it, uint64_t *head)
{
    struct stat st;
    if (!it->rel || !*it->rel || it->residency < KVP_RES_NONE || it->residency > KVP_RES_PAGECACHE)
        return settle(it, KVP_OUT_REJECTED, EINVAL);
    int fd = resolve(c, it->root_fd, it->rel, O_PATH);
    if (fd < 0)
        return settle(it, classify(-fd), -fd);
    if (fstat(fd, &st) < 0) {
        int e = errno;
        close(fd);
        return settle(it, KVP_OUT_FAILED, e);
    }
    if (!S_ISREG(st.st_mode)) {  /* FIFOs, devices, sockets: never opened for reading */
        close(fd);
        return settle(it, KVP_OUT_REJECTED,
                      S_ISDIR(st.st_mode) ? EISDIR : S_ISLNK(st.st_mode) ? ELOOP : EINVAL);
    }
    it->size = (uint64_t)st.st_size;
    *head = MIN(it->size, it->want);
    if (*head == 0 || (it->residency == KVP_RES_TIER && tier_resident(&st, it->want))) {
        close(fd);  /* the O_PATH fstat was enough: no reopen */
        it->done = *head;
        return settle(it, KVP_OUT_RESIDENT, 0);
    }
    if ((fd = reopen(c, fd, it, &st)) < 0)
        return settle(it, classify(-fd), -fd);
    /* cachestat needs this real fd: fdget() refuses O_PATH files (EBADF). */
    if (it->residency == KVP_RES_PAGECACHE && kvp_resident_bytes(fd, 0, *head, 0) >= (int64_t)*head) {
        close(fd);
        it->done = *head;
        return settle(it, KVP_OUT_RESIDENT, 0);
    }
    /* FADV_RANDOM sets FMODE_RANDOM: a read then loads what it asks for
     * (mm/readahead.c page_cache_sync_ra), not a readahead window: with
     * read_ahead_kb 8 MiB, measured on 4 MiB files with a 1 MiB head, 1 MiB
     * reads brought in 2 MiB per file and 256 KiB reads 3 MiB; with it, 1 MiB. */
    if (c->cfg.fadv_random)
        (void)posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);  /* advisory: errors ignored */
    return fd;
}

/* ---- PREAD engine, and the confirm pass of the FADVISE engines ---------- */
static void warm_read(const struct kvp_ctx *c, struct kvp_item *it, int fd, uint64_t head, char *buf)
{
    uint64_t off = 0;
    int e = 0, tries = 0;
    while (off < head) {
        ssize_t r = pread(fd, buf, (size_t)MIN(head - off, (uint64_t)c->cfg.chunk), (off_t)off);
        if (r > 0)
            off += (uint64_t)r;  /* a short read continues from where it stopped */
        else if (r == 0)
            break;  /* EOF: the file shrank since fstat */
        else if (errno != EINTR && !(errno == EAGAIN && tries++ < KVP_RETRIES && !clear_nonblock(fd))) {
            e = errno;
            break;
        }
    }
    it->done = off;
    settle(it, e ? KVP_OUT_FAILED : KVP_OUT_READ, e);
    close(fd);
}

struct pool {
    struct kvp_ctx *c;
    struct kvp_item *items;
    size_t n;
    const int *fds;  /* NULL: the workers open the items themselves */
    const uint64_t *heads;
    atomic_size_t next;
};
struct worker { struct pool *p; char *buf; pthread_t tid; };

static void *work(void *arg)
{
    struct worker *w = arg;
    struct pool *p = w->p;
    size_t i;
    while ((i = atomic_fetch_add(&p->next, 1)) < p->n) {
        uint64_t head = p->fds ? p->heads[i] : 0;
        int fd = p->fds ? p->fds[i] : item_open(p->c, &p->items[i], &head);
        if (fd >= 0)
            warm_read(p->c, &p->items[i], fd, head, w->buf);
    }
    return NULL;
}

/* Items spread over cfg.threads threads by an atomic next index, the caller's
 * thread being one (threads == 1: a plain loop, no thread created).  Each has
 * its own scratch so two cores never write the same cache lines. */
static void run_pool(struct kvp_ctx *c, struct kvp_item *items, size_t n,
                     const int *fds, const uint64_t *heads)
{
    struct worker w[KVP_MAX_THREADS];
    struct pool p = { c, items, n, fds, heads, 0 };
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

/* ---- io_uring engines --------------------------------------------------- */
#ifdef KVP_HAVE_LIBURING
/* At most queue_depth reads are outstanding and every submit flushes the SQ
 * (queue_depth entries), so io_uring_get_sqe() cannot return NULL here. */
static void uring_prep(struct kvp_ctx *c, uint32_t r, uint32_t si, uint64_t off, uint32_t len)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&c->ring);
    c->reqs[r] = (struct ureq){ si, len, off };
    /* Every read targets the same scratch: the bytes are thrown away, only the
     * page-cache side effect matters, so concurrent reads may overwrite each
     * other there.  Registered buffers (READ_FIXED) and registered files
     * measured no faster (bench/c/uring_heads.c -B, -F), so plain READ. */
    io_uring_prep_read(sqe, c->slots[si].fd, c->scratch, len, off);
    io_uring_sqe_set_data64(sqe, r);
    c->slots[si].inflight++;
}

static void ready_push(struct kvp_ctx *c, uint32_t si)
{
    struct uslot *s = &c->slots[si];
    if (!s->queued && !s->eof && !s->err && s->next < s->head && s->inflight < KVP_URING_PER_FILE) {
        c->ready[(c->rhead + c->rlen++) % c->cfg.max_open] = si;
        s->queued = 1;
    }
}

static void slot_finish(struct kvp_ctx *c, uint32_t si)
{
    struct uslot *s = &c->slots[si];
    s->it->done = s->done;
    settle(s->it, s->err ? KVP_OUT_FAILED : KVP_OUT_READ, s->err);
    close(s->fd);
    s->it = NULL;
    c->sfree[c->nsfree++] = si;
}

static void uring_complete(struct kvp_ctx *c, uint32_t r, int res)
{
    struct ureq *q = &c->reqs[r];
    struct uslot *s = &c->slots[q->slot];
    s->inflight--;
    if ((res == -EINTR || res == -EAGAIN) && s->tries++ < KVP_RETRIES &&
        (res == -EINTR || !clear_nonblock(s->fd))) {
        uring_prep(c, r, q->slot, q->off, q->len);  /* resubmit as is */
        return;
    }
    if (res > 0 && (uint32_t)res < q->len) {  /* short read: continue from there */
        s->done += (uint64_t)res;
        uring_prep(c, r, q->slot, q->off + (uint64_t)res, q->len - (uint32_t)res);
        return;
    }
    if (res > 0)
        s->done += (uint64_t)res;
    else if (res == 0)
        s->eof = 1;  /* EOF: the file shrank since fstat */
    else if (!s->err)
        s->err = -res;
    c->rfree[c->nrfree++] = r;
    if (s->inflight == 0 && (s->eof || s->err || s->next >= s->head))
        slot_finish(c, q->slot);
    else
        ready_push(c, q->slot);
}

/* Wait for at least one completion and hand every CQE to fn (NULL: count
 * only).  Returns the number reaped, or -errno if the ring itself failed. */
static int uring_reap(struct kvp_ctx *c, void (*fn)(struct kvp_ctx *, uint32_t, int))
{
    struct io_uring_cqe *cqe;
    unsigned h, seen = 0;
    int r = io_uring_submit_and_wait(&c->ring, 1);
    if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY)
        return c->broken = -r, r;  /* requests may still complete: ctx unusable */
    io_uring_for_each_cqe(&c->ring, h, cqe) {
        if (fn)
            fn(c, (uint32_t)io_uring_cqe_get_data64(cqe), cqe->res);
        seen++;
    }
    io_uring_cq_advance(&c->ring, seen);
    return (int)seen;
}

static int uring_read(struct kvp_ctx *c, struct kvp_item *items, size_t n)
{
    size_t i = 0;
    for (;;) {
        /* Fill the ring: chunks of open files first (finishing files frees
         * fds), then open more files (synchronously), max_open at most. */
        while (c->nrfree > 0) {
            if (c->rlen > 0) {
                uint32_t si = c->ready[c->rhead];
                struct uslot *s = &c->slots[si];
                c->rhead = (c->rhead + 1) % c->cfg.max_open;
                c->rlen--;
                s->queued = 0;
                if (!s->it || s->eof || s->err || s->next >= s->head)
                    continue;  /* settled while queued (possible if PER_FILE > 1) */
                uint32_t len = (uint32_t)MIN(s->head - s->next, (uint64_t)c->cfg.chunk);
                uring_prep(c, c->rfree[--c->nrfree], si, s->next, len);
                s->next += len;
                ready_push(c, si);
            } else if (c->nsfree > 0 && i < n) {
                uint64_t head;
                int fd = item_open(c, &items[i], &head);
                if (fd >= 0) {
                    uint32_t si = c->sfree[--c->nsfree];
                    int queued = c->slots[si].queued;  /* a stale FIFO entry serves it */
                    c->slots[si] = (struct uslot){ .it = &items[i], .head = head, .fd = fd,
                                                   .queued = queued };
                    ready_push(c, si);
                }
                i++;
            } else {
                break;
            }
        }
        if (c->nrfree == c->cfg.queue_depth)
            return 0;  /* nothing in flight, nothing left to open */
        int r = uring_reap(c, uring_complete);
        if (r < 0) {  /* settle what is open and what is left */
            for (uint32_t si = 0; si < c->cfg.max_open; si++)
                if (c->slots[si].it) {
                    c->slots[si].err = -r;
                    slot_finish(c, si);
                }
            for (; i < n; i++)
                settle(&items[i], KVP_OUT_FAILED, -r);
            return r;
        }
    }
}

/* IORING_OP_FADVISE(WILLNEED) for a window of open files.  The kernel always
 * punts WILLNEED to an io-wq worker (io_uring/advise.c io_fadvise_force_async),
 * so the ring only moves readahead submission off this thread.  Results are
 * advisory: the confirm pass decides the outcome. */
static int uring_fadvise(struct kvp_ctx *c, const int *fds, const uint64_t *heads, size_t m)
{
    uint32_t inflight = 0;
    size_t k = 0;
    uint64_t off = 0;
    for (;;) {
        for (; inflight < c->cfg.queue_depth; inflight++) {
            for (; k < m && (fds[k] < 0 || off >= heads[k]); k++)
                off = 0;
            if (k == m)
                break;
            uint64_t len = MIN(heads[k] - off, (uint64_t)KVP_FADV_PIECE);
            io_uring_prep_fadvise(io_uring_get_sqe(&c->ring), fds[k], off, (off_t)len, POSIX_FADV_WILLNEED);
            off += len;
        }
        if (inflight == 0)
            return 0;
        int r = uring_reap(c, NULL);
        if (r < 0)
            return r;
        inflight -= (uint32_t)r;
    }
}
#endif

/* FADVISE engines: per window of max_open files, open and WILLNEED every head,
 * then confirm.  cachestat counts pages whose read is still in flight, so it
 * cannot confirm; a pread of the range blocks until in-flight pages are
 * uptodate and re-reads any the reclaimer evicted since.  done = confirmed. */
static int run_fadvise(struct kvp_ctx *c, struct kvp_item *items, size_t n)
{
    for (size_t base = 0; base < n; base += c->cfg.max_open) {
        size_t m = MIN(n - base, (size_t)c->cfg.max_open);
        for (size_t k = 0; k < m; k++) {
            c->fds[k] = item_open(c, &items[base + k], &c->heads[k]);
            if (c->fds[k] >= 0 && c->cfg.engine == KVP_ENGINE_FADVISE)
                (void)posix_fadvise(c->fds[k], 0, (off_t)c->heads[k], POSIX_FADV_WILLNEED);
        }
#ifdef KVP_HAVE_LIBURING
        int r = c->cfg.engine == KVP_ENGINE_URING_FADVISE ? uring_fadvise(c, c->fds, c->heads, m) : 0;
        if (r < 0) {
            for (size_t k = 0; k < n - base; k++) {
                if (k < m && c->fds[k] >= 0)
                    close(c->fds[k]);
                if (k >= m || c->fds[k] >= 0)
                    settle(&items[base + k], KVP_OUT_FAILED, -r);
            }
            return r;
        }
#endif
        run_pool(c, items + base, m, c->fds, c->heads);
    }
    return 0;
}

/* ---- public API --------------------------------------------------------- */
void kvp_ctx_free(struct kvp_ctx *c)
{
    if (!c)
        return;
#ifdef KVP_HAVE_LIBURING
    if (c->ring_ok)
        io_uring_queue_exit(&c->ring);
    free(c->slots);
#endif
    if (c->scratch)
        munmap(c->scratch, c->scratch_len);
    free(c->fds), free(c->heads), free(c);
}

struct kvp_ctx *kvp_ctx_new(const struct kvp_config *cfg, int *err)
{
    struct kvp_ctx *c = NULL;
    struct rlimit rl;
    struct statfs sf;
    int e = EINVAL, uring = cfg && cfg->engine >= KVP_ENGINE_URING_READ;
    if (!cfg || cfg->engine < KVP_ENGINE_PREAD || cfg->engine > KVP_ENGINE_URING_FADVISE ||
        cfg->chunk == 0 || cfg->chunk > KVP_MAX_CHUNK || cfg->max_open == 0 ||
        (uring && cfg->queue_depth == 0))
        goto fail;
#ifndef KVP_HAVE_LIBURING
    if (uring && (e = ENOSYS))  /* built without liburing */
        goto fail;
#endif
    if (!(c = calloc(1, sizeof *c)) && (e = ENOMEM))
        goto fail;
    e = ENOMEM;
    c->cfg = *cfg;
    c->cfg.threads = cfg->threads == 0 ? 1 : MIN(cfg->threads, (uint32_t)KVP_MAX_THREADS);
    c->cfg.queue_depth = MIN(cfg->queue_depth, (uint32_t)KVP_MAX_QD);
    /* The fd budget: each thread holds one fd beyond the window while reopening. */
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur > 0) {
        rlim_t room = rl.rlim_cur - MIN(rl.rlim_cur - 1, (rlim_t)(KVP_FD_RESERVE + c->cfg.threads));
        c->cfg.max_open = (uint32_t)MIN((rlim_t)c->cfg.max_open, room);
    }
    c->cfg.threads = MIN(c->cfg.threads, c->cfg.max_open);
    /* Probe openat2 once: ENOSYS before 5.6, ENOSYS or EPERM under some seccomp filters. */
    struct open_how how = { .flags = O_PATH | O_CLOEXEC, .resolve = RESOLVE_BENEATH };
    long fd = syscall(SYS_openat2, AT_FDCWD, ".", &how, sizeof how);
    c->have_openat2 = !(fd < 0 && (errno == ENOSYS || errno == EPERM));
    if (fd >= 0)
        close((int)fd);
    /* /proc must really be procfs for the reopen to mean what we think. */
    fd = open("/proc/self/fd", O_PATH | O_DIRECTORY | O_CLOEXEC);
    c->have_proc = fd >= 0 && fstatfs((int)fd, &sf) == 0 && sf.f_type == PROC_SUPER_MAGIC;
    if (fd >= 0)
        close((int)fd);
    c->scratch_len = (size_t)c->cfg.threads * c->cfg.chunk;
    c->scratch = mmap(NULL, c->scratch_len, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (c->scratch == MAP_FAILED) {
        c->scratch = NULL;
        goto fail;
    }
    if (!(c->fds = calloc(c->cfg.max_open, sizeof *c->fds)) ||
        !(c->heads = calloc(c->cfg.max_open, sizeof *c->heads)))
        goto fail;
#ifdef KVP_HAVE_LIBURING
    if (uring) {
        uint32_t qd = c->cfg.queue_depth, mo = c->cfg.max_open;
        /* one block: slots, then requests, then the three index arrays */
        if (!(c->slots = calloc(1, mo * sizeof *c->slots + qd * sizeof *c->reqs +
                                   (qd + 2 * (size_t)mo) * sizeof(uint32_t))))
            goto fail;
        c->reqs = (struct ureq *)(c->slots + mo);
        c->rfree = (uint32_t *)(c->reqs + qd);
        c->sfree = c->rfree + qd;
        c->ready = c->sfree + mo;
        for (c->nrfree = 0; c->nrfree < qd; c->nrfree++)
            c->rfree[c->nrfree] = qd - 1 - c->nrfree;
        for (c->nsfree = 0; c->nsfree < mo; c->nsfree++)
            c->sfree[c->nsfree] = mo - 1 - c->nsfree;
        /* COOP_TASKRUN (5.19): buffered-read completions run as task_work when
         * we wait in io_uring_enter anyway, without an IPI; older kernels
         * refuse the flag with EINVAL: retry without it. */
        int r = io_uring_queue_init(qd, &c->ring, IORING_SETUP_COOP_TASKRUN);
        if (r == -EINVAL)
            r = io_uring_queue_init(qd, &c->ring, 0);
        if (r < 0) {
            e = -r;
            goto fail;
        }
        c->ring_ok = 1;
    }
#endif
    return c;
fail:
    kvp_ctx_free(c);
    if (err)
        *err = e;
    return NULL;
}

int kvp_run_batch(struct kvp_ctx *c, struct kvp_item *items, size_t n)
{
    int e = !c ? EINVAL : c->broken;
    if (n && !items)
        return -EINVAL;
    for (size_t i = 0; i < n; i++) {
        items[i].outcome = KVP_OUT_FAILED;  /* every path below overwrites it */
        items[i].err = e;
        items[i].size = items[i].done = 0;
    }
    if (e || n == 0)
        return -e;
    if (c->cfg.engine == KVP_ENGINE_PREAD) {
        run_pool(c, items, n, NULL, NULL);
        return 0;
    }
#ifdef KVP_HAVE_LIBURING
    if (c->cfg.engine == KVP_ENGINE_URING_READ)
        return uring_read(c, items, n);
#endif
    return run_fadvise(c, items, n);
}

int kvp_uring_probe(char *why, size_t whylen)
{
    const char *msg = "built without liburing";
    int ok = 0;
#ifdef KVP_HAVE_LIBURING
    struct io_uring ring;
    struct io_uring_probe *p = NULL;
    /* ENOSYS: no io_uring; EPERM: kernel.io_uring_disabled, or seccomp. */
    int r = io_uring_queue_init(4, &ring, 0);
    if (r < 0)
        msg = strerror(-r);
    else if (!(p = io_uring_get_probe_ring(&ring)))
        msg = "io_uring_get_probe failed (kernel < 5.6)";
    else if (!io_uring_opcode_supported(p, IORING_OP_READ))
        msg = "IORING_OP_READ not supported (kernel < 5.6)";
    else if (!io_uring_opcode_supported(p, IORING_OP_FADVISE))
        msg = "IORING_OP_FADVISE not supported (kernel < 5.6)";
    else
        ok = 1, msg = "";
    if (p)
        io_uring_free_probe(p);
    if (r == 0)
        io_uring_queue_exit(&ring);
    if (r < 0 && why && whylen) {
        snprintf(why, whylen, "io_uring_queue_init: %s", msg);
        return 0;
    }
#endif
    if (why && whylen)
        snprintf(why, whylen, "%s", msg);
    return ok;
}

void kvp_ctx_force_fallback(struct kvp_ctx *c, int32_t which)
{
    if (c && (which & KVP_FALLBACK_OPENAT2))
        c->have_openat2 = 0;
    if (c && (which & KVP_FALLBACK_PROC))
        c->have_proc = 0;
}
