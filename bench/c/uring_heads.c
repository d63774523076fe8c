/*
 * uring_heads.c: warm the heads of a list of files, the hand-written way.
 * The reference kvprefetchd's native engines (native/engine_*.c) must match.
 *
 * Build:  gcc -O2 -Wall -Wextra -o uring_heads bench/c/uring_heads.c -luring -lpthread
 * Usage:  uring_heads [options] [-f LIST | PATH...]
 *   -f LIST   read paths from LIST, one a line ("-" = stdin)
 *   -m MODE   read (io_uring, default) | fadvise (posix_fadvise WILLNEED, then
 *             pread to confirm) | pread (blocking pread, -t threads)
 *   -b BYTES  head bytes per file (default 1M; k/m/g suffixes)
 *   -c BYTES  bytes per read request (default 1M)
 *   -q N      io_uring queue depth: reads kept in flight (default 128)
 *   -t N      threads for pread, and for fadvise's confirm pass (default 32 / 1);
 *             read: N threads, each with its own ring of -q entries (default 1)
 *   -o N      files open at once (default 1024)
 *   -d N      read: chunks in flight per file, 0 = all at once (default 1)
 *   -R        POSIX_FADV_RANDOM on every fd before reading
 *   -B        read: register the scratch buffer (IORING_OP_READ_FIXED)
 *   -F        read: register each file (IOSQE_FIXED_FILE) and close its fd at once
 *   -A        read: IOSQE_ASYNC on every read (force the io-wq punt)
 *   -w N      read: io_uring_register_iowq_max_workers(bounded = N)
 *   -S        open like the engine: openat2(O_PATH) + fstat + /proc/self/fd reopen
 *   -P        open and close every file first, untimed: metadata warm, data
 *             still cold (isolates the per-file open cost): preopen_seconds
 * Prints one JSON line: {"files", "bytes", "seconds", ...}.
 *
 * Measured (Linux 6.18, 2-vCPU Firecracker VM, ext4 on virtio, cold cache:
 * sync; echo 3 > drop_caches; sleep 4; medians of 5 interleaved runs via
 * bench/c/cold_matrix.py on a shared, noisy machine: +-30% between runs):
 * 2000 x 4 MiB files, 1 MiB heads, -R: -q128 -c1M 1.73 s; -B 2.20 s; -F 2.07 s;
 * -q256 -c128k -d1 2.13 s, -d0 2.17 s; -S 1.96 s.  Registered buffers, files,
 * or all chunks at once bring nothing measurable here, so the engine uses
 * none of them.  Without -R a 1 MiB head costs 2 MiB of I/O (1 MiB reads) or
 * 3 MiB (256 KiB reads) through the readahead window (read_ahead_kb 8192).
 * 20000 x 256 KiB, whole files: pread -t32 5.6 s; one ring -q128 6.3-9.6 s;
 * one ring + -A 5.2 s; -t2 (two rings) 5.2 s.  The one-ring deficit is CPU on
 * the submitting thread: buffered reads complete inline (async buffered reads,
 * no io-wq worker seen) and their copy to the buffer (_copy_to_iter, 73% of
 * that thread's samples) runs there, one vCPU; here the first touch of a page
 * the host took back after drop_caches makes that copy costly (without the
 * sleep 4, one ring matches pread).  -P (metadata warm) did not close the gap.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <liburing.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static char **paths;
static size_t npaths, head = 1 << 20, chunk = 1 << 20;
static unsigned qd = 128, nthreads = 0, max_open = 1024, per_file = 1, iowq = 0;
static int rnd, fixed_buf, fixed_files, force_async, safe_open, preopen;
static atomic_size_t next_path;
static atomic_ullong total_bytes;
static atomic_ullong iowq_max_seen;

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void die(const char *what, int e)
{
    fprintf(stderr, "uring_heads: %s: %s\n", what, strerror(e));
    exit(1);
}

static size_t parse_size(const char *s)
{
    char *end;
    unsigned long long v = strtoull(s, &end, 0);
    switch (*end) {
    case 'g': case 'G': v <<= 10; /* fallthrough */
    case 'm': case 'M': v <<= 10; /* fallthrough */
    case 'k': case 'K': v <<= 10;
    }
    return (size_t)v;
}

/* Plain open, or the engine's safe open (to price the safety). */
static int open_file(const char *p)
{
    if (!safe_open)
        return open(p, O_RDONLY | O_CLOEXEC);
    struct open_how how = { .flags = O_PATH | O_CLOEXEC, .resolve = RESOLVE_NO_MAGICLINKS };
    struct stat st;
    char proc[32];
    int pfd = (int)syscall(SYS_openat2, AT_FDCWD, p, &how, sizeof how);
    if (pfd < 0 || fstat(pfd, &st) < 0 || !S_ISREG(st.st_mode)) {
        if (pfd >= 0)
            close(pfd);
        return -1;
    }
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", pfd);
    int fd = open(proc, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    close(pfd);
    return fd;
}

static int open_head(const char *p)
{
    int fd = open_file(p);
    if (fd < 0)
        fprintf(stderr, "uring_heads: %s: %s\n", p, strerror(errno));
    else if (rnd)
        posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
    return fd;
}

static uint64_t pread_head(int fd, char *buf)
{
    uint64_t off = 0;
    while (off < head) {
        size_t n = head - off < chunk ? head - off : chunk;
        ssize_t r = pread(fd, buf, n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        off += (uint64_t)r;
    }
    return off;
}

/* ---- pread threads (also fadvise's confirm pass over pre-opened fds) ---- */
static int *confirm_fds;

static void *pread_worker(void *arg)
{
    char *buf = malloc(chunk);
    size_t i;
    (void)arg;
    while ((i = atomic_fetch_add(&next_path, 1)) < npaths) {
        int fd = confirm_fds ? confirm_fds[i] : open_head(paths[i]);
        if (fd < 0)
            continue;
        atomic_fetch_add(&total_bytes, pread_head(fd, buf));
        close(fd);
    }
    free(buf);
    return NULL;
}

static void run_threads(unsigned n)
{
    pthread_t tid[1024];
    n = n ? (n > 1024 ? 1024 : n) : 1;
    atomic_store(&next_path, 0);
    for (unsigned t = 1; t < n; t++)
        pthread_create(&tid[t], NULL, pread_worker, NULL);
    pread_worker(NULL);
    for (unsigned t = 1; t < n; t++)
        pthread_join(tid[t], NULL);
}

static void run_fadvise(void)
{
    confirm_fds = calloc(npaths, sizeof *confirm_fds);
    for (size_t base = 0; base < npaths; base += max_open) {
        size_t m = npaths - base < max_open ? npaths - base : max_open;
        for (size_t k = 0; k < m; k++) {
            confirm_fds[k] = open_head(paths[base + k]);
            if (confirm_fds[k] >= 0)
                posix_fadvise(confirm_fds[k], 0, (off_t)head, POSIX_FADV_WILLNEED);
        }
        char **save = paths;
        size_t savedn = npaths;
        paths += base;
        npaths = m;
        run_threads(nthreads ? nthreads : 1);
        paths = save;
        npaths = savedn;
    }
}

/* ---- io_uring reads ---- */
struct slot { int fd, busy, eof, queued; uint64_t next; unsigned inflight; };
struct req { unsigned slot, len; uint64_t off; };

static unsigned count_iowq(void)  /* iou-wrk-* threads of this process right now */
{
    char path[300], name[32];
    unsigned n = 0;
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
        FILE *f = e->d_name[0] != '.' ? fopen(path, "r") : NULL;
        if (!f)
            continue;
        if (fgets(name, sizeof name, f) && !strncmp(name, "iou-wrk", 7))
            n++;
        fclose(f);
    }
    if (d)
        closedir(d);
    return n;
}

static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;
static double open_total;

/* One ring per thread; threads share the path list through next_path. */
static void *run_uring(void *arg)
{
    double open_secs = 0;
    struct io_uring ring;
    struct slot *slots = calloc(max_open, sizeof *slots);
    struct req *reqs = calloc(qd, sizeof *reqs);
    unsigned *sfree = malloc(max_open * sizeof *sfree), nsfree = max_open;
    unsigned *rfree = malloc(qd * sizeof *rfree), nrfree = qd;
    char *buf = aligned_alloc(4096, (chunk + 4095) / 4096 * 4096);
    size_t i = 0, done_files = 0;
    int exhausted = 0;
    unsigned *ready = malloc(max_open * sizeof *ready), rhead = 0, rlen = 0, last_iowq_check = 0;
    int r = io_uring_queue_init(qd, &ring, IORING_SETUP_COOP_TASKRUN);
    if (r < 0)
        die("io_uring_queue_init", -r);
    for (unsigned k = 0; k < max_open; k++)
        sfree[k] = max_open - 1 - k;
    for (unsigned k = 0; k < qd; k++)
        rfree[k] = qd - 1 - k;
    if (iowq) {
        unsigned v[2] = { iowq, 0 };
        if ((r = io_uring_register_iowq_max_workers(&ring, v)) < 0)
            die("io_uring_register_iowq_max_workers", -r);
    }
    if (fixed_buf) {
        struct iovec iov = { buf, chunk };
        if ((r = io_uring_register_buffers(&ring, &iov, 1)) < 0)
            die("io_uring_register_buffers", -r);
    }
    if (fixed_files && (r = io_uring_register_files_sparse(&ring, max_open)) < 0)
        die("io_uring_register_files_sparse", -r);
    for (;;) {
        /* fill the ring: next chunks of open files first, then open more
         * files (synchronously) while requests are free, like the engine */
        while (nrfree > 0) {
            if (rlen > 0) {
                unsigned s = ready[rhead];
                struct slot *sl = &slots[s];
                rhead = (rhead + 1) % max_open;
                rlen--;
                sl->queued = 0;
                if (!sl->busy || sl->eof || sl->next >= head)
                    continue;  /* finished while queued */
                unsigned q = rfree[--nrfree];
                unsigned len = head - sl->next < chunk ? (unsigned)(head - sl->next) : (unsigned)chunk;
                struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
                int target = fixed_files ? (int)s : sl->fd;
                if (fixed_buf)
                    io_uring_prep_read_fixed(sqe, target, buf, len, sl->next, 0);
                else
                    io_uring_prep_read(sqe, target, buf, len, sl->next);
                sqe->flags |= (fixed_files ? IOSQE_FIXED_FILE : 0) | (force_async ? IOSQE_ASYNC : 0);
                io_uring_sqe_set_data64(sqe, q);
                reqs[q] = (struct req){ s, len, sl->next };
                sl->next += len;
                sl->inflight++;
                if (sl->next < head && (per_file == 0 || sl->inflight < per_file)) {
                    /* all-at-once (-d 0) stays on this file: push it to the front */
                    sl->queued = 1;
                    if (per_file == 0) {
                        rhead = (rhead + max_open - 1) % max_open;
                        ready[rhead] = s;
                        rlen++;
                    } else {
                        ready[(rhead + rlen++) % max_open] = s;
                    }
                }
            } else if (nsfree > 0 && !exhausted) {
                if ((i = atomic_fetch_add(&next_path, 1)) >= npaths) {
                    exhausted = 1;
                    continue;
                }
                double t0 = now();
                int fd = open_head(paths[i]);
                open_secs += now() - t0;
                if (fd < 0) {
                    done_files++;
                    continue;
                }
                unsigned s = sfree[--nsfree];
                int was_queued = slots[s].queued;  /* its stale entry now serves this file */
                slots[s] = (struct slot){ fd, 1, 0, 1, 0, 0 };
                if (fixed_files) {
                    if ((r = io_uring_register_files_update(&ring, s, &fd, 1)) < 0)
                        die("io_uring_register_files_update", -r);
                    close(fd);
                }
                if (!was_queued)
                    ready[(rhead + rlen++) % max_open] = s;
            } else {
                break;
            }
        }
        if (nrfree == qd)
            break;  /* nothing in flight and nothing left to open */
        if ((r = io_uring_submit_and_wait(&ring, 1)) < 0 && r != -EINTR)
            die("io_uring_submit_and_wait", -r);
        if (++last_iowq_check % 64 == 0) {
            unsigned n = count_iowq();
            if (n > atomic_load(&iowq_max_seen))
                atomic_store(&iowq_max_seen, n);
        }
        struct io_uring_cqe *cqe;
        unsigned h, seen = 0;
        io_uring_for_each_cqe(&ring, h, cqe) {
            unsigned q = (unsigned)io_uring_cqe_get_data64(cqe);
            struct slot *sl = &slots[reqs[q].slot];
            seen++;
            sl->inflight--;
            if (cqe->res > 0)
                atomic_fetch_add(&total_bytes, (unsigned long long)cqe->res);
            if (cqe->res <= 0 || (unsigned)cqe->res < reqs[q].len)
                sl->eof = 1;  /* good enough for a benchmark: stop this file */
            rfree[nrfree++] = q;
            if (!sl->eof && sl->next < head && per_file && !sl->queued) {
                sl->queued = 1;  /* may take one more */
                ready[(rhead + rlen++) % max_open] = reqs[q].slot;
            }
            if (sl->inflight == 0 && (sl->eof || sl->next >= head)) {
                if (fixed_files) {
                    int minus1 = -1;
                    io_uring_register_files_update(&ring, reqs[q].slot, &minus1, 1);
                } else {
                    close(sl->fd);
                }
                sl->busy = 0;
                sfree[nsfree++] = reqs[q].slot;
                done_files++;
            }
        }
        io_uring_cq_advance(&ring, seen);
    }
    io_uring_queue_exit(&ring);
    free(slots), free(reqs), free(sfree), free(rfree), free(buf), free(ready);
    (void)done_files, (void)arg;
    pthread_mutex_lock(&open_lock);
    open_total += open_secs;
    pthread_mutex_unlock(&open_lock);
    return NULL;
}

int main(int argc, char **argv)
{
    const char *mode = "read", *list = NULL;
    int opt;
    while ((opt = getopt(argc, argv, "f:m:b:c:q:t:o:d:w:RBFASP")) != -1) {
        switch (opt) {
        case 'f': list = optarg; break;
        case 'm': mode = optarg; break;
        case 'b': head = parse_size(optarg); break;
        case 'c': chunk = parse_size(optarg); break;
        case 'q': qd = (unsigned)atoi(optarg); break;
        case 't': nthreads = (unsigned)atoi(optarg); break;
        case 'o': max_open = (unsigned)atoi(optarg); break;
        case 'd': per_file = (unsigned)atoi(optarg); break;
        case 'w': iowq = (unsigned)atoi(optarg); break;
        case 'R': rnd = 1; break;
        case 'B': fixed_buf = 1; break;
        case 'F': fixed_files = 1; break;
        case 'A': force_async = 1; break;
        case 'S': safe_open = 1; break;
        case 'P': preopen = 1; break;
        default: fprintf(stderr, "see the comment at the top of uring_heads.c\n"); return 2;
        }
    }
    if (list) {
        FILE *f = strcmp(list, "-") ? fopen(list, "r") : stdin;
        char *line = NULL;
        size_t cap = 0, alloc = 0;
        ssize_t len;
        if (!f)
            die(list, errno);
        while ((len = getline(&line, &cap, f)) > 0) {
            if (line[len - 1] == '\n')
                line[--len] = '\0';
            if (!len)
                continue;
            if (npaths == alloc)
                paths = realloc(paths, (alloc = alloc ? 2 * alloc : 1024) * sizeof *paths);
            paths[npaths++] = strdup(line);
        }
        free(line);
    } else {
        paths = argv + optind;
        npaths = (size_t)(argc - optind);
    }
    if (!chunk || !head || !qd || !max_open)
        die("sizes", EINVAL);
    double open_secs = 0, preopen_secs = 0, t0;
    if (preopen) {  /* untimed: metadata (dentries, inodes) warm, data still cold */
        t0 = now();
        for (size_t k = 0; k < npaths; k++) {
            int fd = open_file(paths[k]);
            if (fd >= 0)
                close(fd);
        }
        preopen_secs = now() - t0;
    }
    t0 = now();
    if (!strcmp(mode, "pread"))
        run_threads(nthreads ? nthreads : 32);
    else if (!strcmp(mode, "fadvise"))
        run_fadvise();
    else if (!strcmp(mode, "read"))
    {
        pthread_t tid[64];
        unsigned n = nthreads ? (nthreads > 64 ? 64 : nthreads) : 1;
        for (unsigned t = 1; t < n; t++)
            pthread_create(&tid[t], NULL, run_uring, NULL);
        run_uring(NULL);
        for (unsigned t = 1; t < n; t++)
            pthread_join(tid[t], NULL);
        open_secs = open_total;
    }
    else
        die(mode, EINVAL);
    double secs = now() - t0;
    printf("{\"files\": %zu, \"bytes\": %llu, \"seconds\": %.4f, \"mode\": \"%s\", "
           "\"open_seconds\": %.4f, \"preopen_seconds\": %.4f, \"iowq_workers_max\": %llu}\n",
           npaths, (unsigned long long)atomic_load(&total_bytes), secs, mode, open_secs, preopen_secs,
           (unsigned long long)atomic_load(&iowq_max_seen));
    return 0;
}
