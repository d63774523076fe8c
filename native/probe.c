/*
 * probe.c: the fast path for heads that are already warm.
 *
 * Most files a router asks for are resident (popular prefixes), and saying so
 * through the queue cost a worker ~18 us per file: a record, a thread hand-off
 * and a Python object each way.  kvp_probe answers them in one call on the
 * worker's own thread, with the syscalls a confined residency check needs and
 * nothing else: openat2(O_PATH, RESOLVE_BENEATH | RESOLVE_CACHED), statx,
 * then (page-cache rule) the /proc reopen of the verified inode and cachestat;
 * ~4 us per file here.  It settles RESIDENT, and MISSING where the dentry
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
 * of the root's own mount; a call stops at its time budget or at the first
 * file that took longer than KVP_PROBE_SLOW_NS, leaving the rest to the queue.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

struct kvp_prober {
    struct kvp_ctx base;  /* only its kernel features: have_openat2, have_proc */
    int have_cached;      /* openat2 takes RESOLVE_CACHED (Linux 5.12+) */
};

struct kvp_prober *kvp_prober_new(void)
{
    struct kvp_prober *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    kvp_open_probe(&p->base);
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

/* PROBE_RESIDENT when the head of rel is resident by the root's rule,
 * PROBE_MISSING when the dentry cache says rel does not exist, else PROBE_REST:
 * the queue decides (errors included: EAGAIN or EXDEV at a mount point). */
static int probe_one(const struct kvp_probe_root *root, const char *rel, uint64_t read_bytes)
{
    struct open_how how = { .flags = O_PATH | O_CLOEXEC,
                            .resolve = RESOLVE_BENEATH | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS
                                       | RESOLVE_CACHED };
    struct statx stx;
    struct stat st;
    char proc[32];
    int yes = 0;
    if (!*rel)
        return PROBE_REST;
    int pfd = (int)syscall(SYS_openat2, root->fd, rel, &how, sizeof how);
    if (pfd < 0)
        return errno == ENOENT ? PROBE_MISSING : PROBE_REST;
    if (statx(pfd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE | STATX_SIZE | STATX_BLOCKS,
              &stx) < 0 || !S_ISREG(stx.stx_mode))
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
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", pfd);
    int fd = open(proc, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
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
    int64_t start = go ? kvp_now_ns() : 0, last = start;
    for (; i < n; i++) {
        const char *rel = paths + at;
        const char *end = at < paths_len ? memchr(rel, '\0', paths_len - at) : NULL;
        if (!end)
            break;  /* fewer names than n: the rest go to the queue, which refuses them */
        at += (size_t)(end - rel) + 1;
        const struct kvp_probe_root *root = root_index[i] < nroots ? &roots[root_index[i]] : NULL;
        int verdict = PROBE_REST;
        if (go && root && root->local && root->fd >= 0 && root->residency != KVP_RES_OFF)
            verdict = probe_one(root, rel, read_bytes);
        if (verdict == PROBE_RESIDENT)
            resident_out[k++] = (uint32_t)i;
        else if (verdict == PROBE_MISSING)
            missing_out[m++] = (uint32_t)i;
        else
            rest_out[r++] = (uint32_t)i;
        if (go) {
            int64_t now = kvp_now_ns();
            if (now - last > KVP_PROBE_SLOW_NS || now - start > budget_ns)
                go = 0;  /* slow or long: what is left is the queue's */
            last = now;
        }
    }
    for (; i < n; i++)
        rest_out[r++] = (uint32_t)i;
    *nmissing = m;
    return k;
}
