/*
 * probe.c: the fast path for heads that are already warm.
 *
 * Most files a router asks for are resident (popular prefixes), and saying so
 * through the queue cost a worker ~18 us per file: a record, a thread hand-off
 * and a Python object each way.  kvp_probe answers them in one call on the
 * worker's own thread, with the syscalls a confined residency check needs and
 * nothing else: openat2(O_PATH, RESOLVE_BENEATH | RESOLVE_CACHED), statx,
 * then (page-cache rule) the /proc reopen of the verified inode and cachestat;
 * ~4 us per file here.  Beneath a root's nodev view (nodev.c), where no open
 * can reach a device, the page-cache rule opens the file for reading at once
 * and checks it after: one open instead of two, -37% of the probe's CPU.  The
 * reopen is relative to a held fd of /proc/self/fd (proc_fd): the absolute
 * "/proc/self/fd/N" walked /proc and resolved the "self" link for every file,
 * measured at ~40% of the probe's CPU (docs/bench/hot.md, issue 25).  It
 * settles RESIDENT, and MISSING where the dentry
 * cache itself says the name does not exist (ENOENT under RESOLVE_CACHED: a
 * negative dentry, which a local file system keeps exact; the router asks for
 * blocks not written yet all the time).  Every other file (cold, rejected, a
 * name outside the dentry cache) goes on to the queue, which decides it
 * exactly as before.
 *
 * It must never block the worker's thread: the queue is there so that a hung
 * tier holds threads, not the worker.  So it probes only roots on file systems
 * whose lookups and opens are answered by this kernel (local block file
 * systems, tmpfs: kvp_probe_root_local), and never leaves the root's own
 * mount: RESOLVE_NO_XDEV stops a walk at a mount point beneath the root (a
 * FUSE or NFS mount in a subdirectory, judged by nothing here) before the
 * mounted file system is asked anything; under RESOLVE_CACHED that comes as
 * EAGAIN, not EXDEV (the refusal needs to leave RCU walk, which
 * RESOLVE_CACHED forbids: fs/namei.c handle_mounts), and either way the name
 * is the queue's.  RESOLVE_CACHED refuses any walk that would need I/O, statx
 * asks with AT_STATX_DONT_SYNC, and the /proc reopen (which asks the file
 * system: FUSE's permission check may send GETATTR) only ever reopens an inode
 * of the root's own mount; a call stops at its CPU budget or at the first
 * file that took longer than KVP_PROBE_SLOW_NS because it waited (not because
 * a busy host preempted it), leaving the rest to the queue.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <linux/openat2.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#ifndef RESOLVE_CACHED
#define RESOLVE_CACHED 0x20  /* Linux 5.12 */
#endif
#ifndef XFS_SUPER_MAGIC
#define XFS_SUPER_MAGIC 0x58465342
#endif
#ifndef F2FS_SUPER_MAGIC
#define F2FS_SUPER_MAGIC 0xF2F52010
#endif

#define KVP_PROBE_SLOW_NS 1000000  /* one file slower than this: the rest go to the queue */
#define KVP_PROBE_CPU_EVERY 32     /* files between two looks at the call's CPU time */

/* A file that took longer than KVP_PROBE_SLOW_NS either waited (a lock, a
 * fault, a file system's reply: the thread slept, a voluntary context switch)
 * or was only preempted on a busy host (an involuntary one).  Only the first
 * says the next files may wait too: stopping at a preemption sent the rest of
 * the call through the queue, which costs the busy host ~3x the CPU (issue 25:
 * at load 30 on 2 CPUs half the resident files of a wait request went there).
 * getrusage(RUSAGE_THREAD) counts this thread's voluntary switches (Linux
 * 2.6.26+); it is asked once a call and again only after a slow file.  -1: no
 * count, every slow file stops the call as before. */
static long sleeps(void)
{
    struct rusage ru;
    return getrusage(RUSAGE_THREAD, &ru) == 0 ? ru.ru_nvcsw : -1;
}

/* The budget is this thread's CPU time, not the wall clock's: it bounds the
 * work one call does (~10,000 resident files), which a preempted call on a busy
 * host did not do while its wall clock ran. */
static int64_t thread_cpu_ns(void)
{
    struct timespec ts;
    if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) < 0)
        return kvp_now_ns();
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

struct kvp_prober {
    struct kvp_ctx base;  /* only its kernel features: have_openat2, have_proc */
    int have_cached;      /* openat2 takes RESOLVE_CACHED (Linux 5.12+) */
    int proc_fd;          /* O_PATH fd of /proc/self/fd as process proc_pid saw it; -1: none */
    pid_t proc_pid;
    const char *stx_path; /* NULL where statx takes it with AT_EMPTY_PATH (6.11+), else "" */
};

/* An fd's number in decimal, for the /proc/self/fd lookup (snprintf was ~2% of it). */
static void fd_name(char *out, int fd)
{
    char digits[16];
    int n = 0;
    do {
        digits[n++] = (char)('0' + fd % 10);
        fd /= 10;
    } while (fd > 0 && n < (int)sizeof digits);
    while (n > 0)
        *out++ = digits[--n];
    *out = '\0';
}

/* The held /proc/self/fd names the fd table of the process that opened it
 * ("self" is resolved at open time): in a child forked later (a prober made
 * before the fork) its "N" would be the parent's fd N.  So it is only used by
 * proc_pid; any other process reopens through the absolute path. */
static int reopen(const struct kvp_prober *p, pid_t pid, int pfd)
{
    char name[32] = "/proc/self/fd/";
    int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
    if (p->proc_fd >= 0 && pid == p->proc_pid) {
        fd_name(name, pfd);
        return openat(p->proc_fd, name, flags);
    }
    fd_name(name + strlen(name), pfd);
    return open(name, flags);
}

struct kvp_prober *kvp_prober_new(void)
{
    struct kvp_prober *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    kvp_open_detect(&p->base);
    p->proc_fd = -1;
    if (p->base.have_proc) {
        /* Must really be procfs, as kvp_open_detect checks for the absolute path. */
        struct statfs sf;
        int fd = open("/proc/self/fd", O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (fd >= 0 && fstatfs(fd, &sf) == 0 && sf.f_type == PROC_SUPER_MAGIC) {
            p->proc_fd = fd;
            p->proc_pid = getpid();
        } else if (fd >= 0) {
            close(fd);
        }
    }
    /* statx(fd, NULL, AT_EMPTY_PATH) skips copying and looking up the empty
     * name (Linux 6.11, commit 0ef625bba6fb "vfs: support statx(..., NULL,
     * AT_EMPTY_PATH, ...)"); older kernels say EFAULT. */
    struct statx stx;
    int self = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    p->stx_path = self >= 0 && statx(self, NULL, AT_EMPTY_PATH, STATX_TYPE, &stx) == 0 ? NULL : "";
    if (self >= 0)
        close(self);
    if (p->base.have_openat2) {
        struct open_how how = { .flags = O_PATH | O_CLOEXEC,
                                .resolve = RESOLVE_BENEATH | RESOLVE_NO_XDEV | RESOLVE_CACHED };
        long fd = syscall(SYS_openat2, AT_FDCWD, ".", &how, sizeof how);
        p->have_cached = fd >= 0 || errno != EINVAL;
        if (fd >= 0)
            close((int)fd);
    }
    return p;
}

void kvp_prober_free(struct kvp_prober *p)
{
    if (p && p->proc_fd >= 0 && p->proc_pid == getpid())
        close(p->proc_fd);  /* in a forked child the number may be another file by now */
    free(p);
}

void kvp_prober_force_fallback(struct kvp_prober *p, int32_t which)
{
    if (p)
        kvp_ctx_force_fallback(&p->base, which);
}

int kvp_prober_works(const struct kvp_prober *p)
{
    return p && p->base.have_openat2 && p->have_cached && p->base.have_proc;
}

int kvp_probe_root_local(int32_t root_fd)
{
    struct statfs sf;
    if (root_fd < 0 || fstatfs(root_fd, &sf) < 0)
        return 0;
    switch ((unsigned long)sf.f_type) {
    case EXT4_SUPER_MAGIC:  /* ext2 and ext3 share it */
    case XFS_SUPER_MAGIC:
    case BTRFS_SUPER_MAGIC:
    case F2FS_SUPER_MAGIC:
    case TMPFS_MAGIC:
        return 1;
    default:
        return 0;  /* FUSE, NFS, GPFS, overlays...: their opens may wait on a server */
    }
}

enum { PROBE_REST, PROBE_RESIDENT, PROBE_MISSING };

/* The page-cache rule beneath a nodev view (nodev.c): one open for reading,
 * which the kernel refuses for a device node; statx then sends anything but a
 * regular file (a FIFO, opened without waiting and closed unread) to the
 * queue.  Four syscalls where the checked way makes six, and one open of the
 * file where it makes two. */
static int probe_in_view(const struct kvp_probe_root *root, const char *rel,
                         uint64_t read_bytes, const char *stx_path)
{
    struct open_how how = { .flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY,
                            .resolve = RESOLVE_BENEATH | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS
                                       | RESOLVE_CACHED };
    struct statx stx;
    int yes = 0;
    int fd = (int)syscall(SYS_openat2, root->view, rel, &how, sizeof how);
    if (fd < 0)
        return errno == ENOENT ? PROBE_MISSING : PROBE_REST;
    if (statx(fd, stx_path, AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE | STATX_SIZE, &stx) == 0
        && S_ISREG(stx.stx_mode)) {
        uint64_t span = MIN((uint64_t)stx.stx_size, read_bytes);
        yes = span == 0 || kvp_resident_bytes(fd, 0, span, 0) >= (int64_t)span;
    }
    close(fd);
    return yes ? PROBE_RESIDENT : PROBE_REST;
}

/* PROBE_RESIDENT when the head of rel is resident by the root's rule,
 * PROBE_MISSING when the dentry cache says rel does not exist, else PROBE_REST:
 * the queue decides (errors included: EAGAIN or EXDEV at a mount point). */
static int probe_one(const struct kvp_prober *p, pid_t pid, const struct kvp_probe_root *root,
                     const char *rel, uint64_t read_bytes)
{
    struct open_how how = { .flags = O_PATH | O_CLOEXEC,
                            .resolve = RESOLVE_BENEATH | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS
                                       | RESOLVE_CACHED };
    struct statx stx;
    struct stat st;
    int yes = 0;
    if (!*rel)
        return PROBE_REST;
    if (root->residency != KVP_RES_TIER && root->view >= 0)
        return probe_in_view(root, rel, read_bytes, p->stx_path);
    int pfd = (int)syscall(SYS_openat2, root->fd, rel, &how, sizeof how);
    if (pfd < 0)
        return errno == ENOENT ? PROBE_MISSING : PROBE_REST;
    unsigned mask = STATX_TYPE | STATX_SIZE | (root->residency == KVP_RES_TIER ? STATX_BLOCKS : 0);
    if (statx(pfd, p->stx_path, AT_EMPTY_PATH | AT_STATX_DONT_SYNC, mask, &stx) < 0
        || !S_ISREG(stx.stx_mode))
        goto out;
    uint64_t span = MIN((uint64_t)stx.stx_size, read_bytes);
    if (span == 0) {
        yes = 1;  /* nothing to warm, as kvp_item_open says */
        goto out;
    }
    if (root->residency == KVP_RES_TIER) {
        memset(&st, 0, sizeof st);
        st.st_size = (off_t)stx.stx_size;
        st.st_blocks = (blkcnt_t)stx.stx_blocks;
        yes = kvp_tier_resident(&st, read_bytes);
        goto out;
    }
    /* cachestat needs a real fd of exactly the inode just checked (open.c). */
    int fd = reopen(p, pid, pfd);
    if (fd >= 0) {
        yes = kvp_resident_bytes(fd, 0, span, 0) >= (int64_t)span;
        close(fd);
    }
out:
    close(pfd);
    return yes ? PROBE_RESIDENT : PROBE_REST;
}

size_t kvp_probe(const struct kvp_prober *p, const struct kvp_probe_root *roots, size_t nroots,
                 const char *paths, size_t paths_len, const uint16_t *root_index, size_t n,
                 uint64_t read_bytes, int64_t budget_ns, uint32_t *resident_out,
                 uint32_t *missing_out, size_t *nmissing, uint32_t *rest_out)
{
    size_t k = 0, m = 0, r = 0, at = 0, i = 0;
    int go = kvp_prober_works(p);
    int64_t last = go ? kvp_now_ns() : 0, cpu0 = go ? thread_cpu_ns() : 0;
    long slept = go ? sleeps() : -1;
    pid_t pid = go ? getpid() : 0;  /* once a call: which /proc/self/fd reopen() may use */
    for (; i < n; i++) {
        const char *rel = paths + at;
        const char *end = at < paths_len ? memchr(rel, '\0', paths_len - at) : NULL;
        if (!end)
            break;  /* fewer names than n: the rest go to the queue, which refuses them */
        at += (size_t)(end - rel) + 1;
        const struct kvp_probe_root *root = root_index[i] < nroots ? &roots[root_index[i]] : NULL;
        int verdict = PROBE_REST;
        if (go && root && root->local && root->fd >= 0 && root->residency != KVP_RES_OFF)
            verdict = probe_one(p, pid, root, rel, read_bytes);
        if (verdict == PROBE_RESIDENT)
            resident_out[k++] = (uint32_t)i;
        else if (verdict == PROBE_MISSING)
            missing_out[m++] = (uint32_t)i;
        else
            rest_out[r++] = (uint32_t)i;
        if (go) {
            int64_t now = kvp_now_ns();
            if (now - last > KVP_PROBE_SLOW_NS && (slept < 0 || sleeps() != slept))
                go = 0;  /* it waited on something: what is left is the queue's */
            else if (i % KVP_PROBE_CPU_EVERY == 0 && thread_cpu_ns() - cpu0 > budget_ns)
                go = 0;  /* long: the rest too */
            last = now;
        }
    }
    for (; i < n; i++)
        rest_out[r++] = (uint32_t)i;
    *nmissing = m;
    return k;
}
