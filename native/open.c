/*
 * open.c: per item, from a name to a read fd of a verified regular file.
 * Resolve rel beneath root_fd (openat2 RESOLVE_BENEATH, O_PATH; a component
 * walk where openat2 is missing), fstat, refuse anything but a regular file,
 * apply the residency rule, reopen the verified inode for reading (through
 * /proc/self/fd; a second resolution plus a dev/ino check without /proc).
 * Errors become outcomes here (classify).  A ctx with no_xdev (check and
 * evict, which run on a worker's own thread) resolves on the root's own mount
 * only: a name behind another mount beneath the root (a FUSE or NFS mount in
 * a subdirectory, whose server may hang) is settled without asking it.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <linux/magic.h>
#include <linux/openat2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437
#endif

void kvp_open_detect(struct kvp_ctx *c)
{
    struct statfs sf;
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

/* Which mount fd is on, for the walk's RESOLVE_NO_XDEV: its mount id from
 * /proc/self/fdinfo, which the VFS answers from its own records, never asking
 * the file system (proc_fdinfo_show: mnt_id since Linux 3.15); without /proc,
 * its device, from statx with AT_STATX_DONT_SYNC (FUSE and NFS answer that
 * from their caches: fuse_update_get_attr, nfs_getattr).  0: not known. */
static uint64_t mount_of(const struct kvp_ctx *c, int fd)
{
    struct statx stx;
    if (c->have_proc) {
        char path[40], buf[512];
        snprintf(path, sizeof path, "/proc/self/fdinfo/%d", fd);
        int in = open(path, O_RDONLY | O_CLOEXEC);
        ssize_t n = in < 0 ? -1 : read(in, buf, sizeof buf - 1);
        if (in >= 0)
            close(in);
        buf[n > 0 ? n : 0] = '\0';
        const char *at = strstr(buf, "\nmnt_id:");
        return at ? strtoull(at + 8, NULL, 10) + 1 : 0;  /* + 1: id 0 is a mount too */
    }
    if (statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, 0, &stx) < 0)
        return 0;
    return ((uint64_t)stx.stx_dev_major << 32 | stx.stx_dev_minor) + 1;
}

/* openat2-less kernels (< 5.6, or a seccomp filter that refuses it): walk rel
 * one component at a time from root, refusing ".." and never following a
 * symlink (one anywhere is REJECTED, even if it stays inside): stricter than
 * RESOLVE_BENEATH.  Mounts are crossed, as with RESOLVE_BENEATH, unless
 * c->no_xdev: then a component on another mount than root's is EXDEV, found
 * before anything asks its file system (the mount point's own lookup is the
 * root's file system's; an O_PATH open calls none: do_o_path). */
static int walk(const struct kvp_ctx *c, int root, const char *rel, int flags)
{
    char name[NAME_MAX + 1];
    int dir = root, fd = -EXDEV;
    struct stat st;
    uint64_t home = c->no_xdev ? mount_of(c, root) : 0;
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
        int e = c->no_xdev && (home == 0 || mount_of(c, fd) != home) ? EXDEV
                : last ? 0 : fstat(fd, &st) < 0 ? errno : S_ISLNK(st.st_mode) ? ELOOP
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
 * /proc-style links (openat2(2)).  With c->no_xdev, RESOLVE_NO_XDEV: a walk
 * that reaches a mount point stops there with EXDEV, before the mounted file
 * system is asked anything (fs/namei.c handle_mounts: the mount is looked up
 * in the VFS's mount table, then refused). */
static int resolve(const struct kvp_ctx *c, int root, const char *rel, int flags)
{
    if (!c->have_openat2)
        return walk(c, root, rel, flags);
    struct open_how how = { .flags = (uint64_t)(flags | O_CLOEXEC),
                            .resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS
                                       | (c->no_xdev ? RESOLVE_NO_XDEV : 0) };
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

/* rel was refused with EXDEV on the root's own mount (c->no_xdev): 1 when it
 * lies on another mount beneath the root, 0 when it escapes the root (EXDEV
 * says either).  RESOLVE_IN_ROOT keeps an escape inside instead of refusing it
 * (an absolute symlink starts again at the root, ".." stops there), so EXDEV
 * under it is a mount point; the walk follows no symlink, so its EXDEV is one
 * unless rel is absolute or has a ".." component.  Neither looks past the
 * mount point.  (A symlink whose absolute target names a mount beneath the
 * root counts as a mount here, not as the escape the engines call it.) */
static int crosses_mount(const struct kvp_ctx *c, int root, const char *rel)
{
    if (!c->have_openat2) {
        for (const char *at = rel; *at; at += strspn(at, "/")) {
            size_t len = strcspn(at, "/");
            if (at == rel && len == 0)
                return 0;  /* absolute */
            if (len == 2 && at[0] == '.' && at[1] == '.')
                return 0;
            at += len;
        }
        return 1;
    }
    struct open_how how = { .flags = O_PATH | O_CLOEXEC,
                            .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS };
    for (int t = 0; t < KVP_RETRIES; t++) {
        long fd = syscall(SYS_openat2, root, rel, &how, sizeof how);
        if (fd >= 0) {
            close((int)fd);
            return 0;
        }
        if (errno != EAGAIN && errno != EINTR)
            return errno == EXDEV;
    }
    return 0;
}

static atomic_uint_fast64_t noatime_fallbacks;

uint64_t kvp_noatime_fallbacks(void)
{
    return (uint64_t)atomic_load(&noatime_fallbacks);
}

/* Open the inode pfd verified, with flags: fd or -errno; pfd stays open.
 * /proc/self/fd/N reopens exactly the inode we fstat'ed: a file swapped in
 * after the check is never opened.  Measured on this 6.18 VM (200k iterations
 * x 6, warm dcache, 1 and 6 components): O_PATH openat2 + fstat + /proc reopen
 * 7.3-9.1 us per file; a second openat2 + fstat + dev/ino compare 5.5-6.7 us.
 * That is ~2 us cheaper but opens whatever the path names at that instant: a
 * FIFO or device node swapped in during the race gets opened (never read)
 * before the compare rejects it, and open() of a device can have side effects
 * we must not risk for 2 us per file.  So it is only the fallback without
 * /proc. */
static int open_verified(const struct kvp_ctx *c, int pfd, const struct kvp_item *it,
                         const struct stat *st, int flags)
{
    struct stat st2;
    char path[32];
    int fd;
    if (c->have_proc) {
        snprintf(path, sizeof path, "/proc/self/fd/%d", pfd);
        fd = open(path, flags);
        return fd < 0 ? -errno : fd;
    }
    fd = resolve(c, it->root_fd, it->rel, flags);
    if (fd >= 0 && (fstat(fd, &st2) < 0 || st2.st_dev != st->st_dev || st2.st_ino != st->st_ino)) {
        close(fd);
        fd = -ESTALE;  /* the path names another inode now: not what we checked */
    }
    return fd;
}

/* O_NONBLOCK: a FIFO never blocks open(), and a conflicting write lease gives
 * EWOULDBLOCK instead of waiting out lease-break-time (fcntl(2)).  O_NOATIME
 * is the owner's or CAP_FOWNER's (open(2): EPERM otherwise): then the read
 * goes ahead with atime, counted. */
int kvp_item_reopen(const struct kvp_ctx *c, int pfd, const struct kvp_item *it,
                    const struct stat *st)
{
    const int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY;
    int fd;
    if (it->flags & KVP_ITEM_NOATIME) {
        fd = open_verified(c, pfd, it, st, flags | O_NOATIME);
        if (fd == -EPERM) {
            atomic_fetch_add(&noatime_fallbacks, 1);
            fd = open_verified(c, pfd, it, st, flags);
        }
    } else {
        fd = open_verified(c, pfd, it, st, flags);
    }
    close(pfd);
    return fd;
}

/* Reading an O_NONBLOCK regular file may give EAGAIN on file systems without
 * FMODE_NOWAIT (io_uring/rw.c sets REQ_F_NOWAIT then): drop the flag, retry. */
int kvp_clear_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
}

int kvp_item_lookup(const struct kvp_ctx *c, struct kvp_item *it, struct stat *st)
{
    if (!it->rel || !*it->rel || it->residency < KVP_RES_OFF || it->residency > KVP_RES_PAGECACHE)
        return settle(it, KVP_OUT_REJECTED, EINVAL);
    int fd = resolve(c, it->root_fd, it->rel, O_PATH);
    if (fd == -EXDEV && c->no_xdev && crosses_mount(c, it->root_fd, it->rel))
        return settle(it, KVP_OUT_FAILED, EXDEV);  /* behind another mount: not looked at */
    if (fd < 0)
        return settle(it, classify(-fd), -fd);
    if (fstat(fd, st) < 0) {
        int e = errno;
        close(fd);
        return settle(it, KVP_OUT_FAILED, e);
    }
    if (!S_ISREG(st->st_mode)) {  /* FIFOs, devices, sockets: never opened for reading */
        close(fd);
        return settle(it, KVP_OUT_REJECTED,
                      S_ISDIR(st->st_mode) ? EISDIR : S_ISLNK(st->st_mode) ? ELOOP : ENODEV);
    }
    it->size = (uint64_t)st->st_size;
    return fd;
}

int kvp_item_open(struct kvp_ctx *c, struct kvp_item *it, uint64_t *span, int *keep)
{
    struct stat st;
    /* The deadline is judged when the read would be issued: an expired file
     * costs a clock read, no lookup and no fetch slot. */
    if (it->deadline_ns > 0 && kvp_now_ns() > it->deadline_ns)
        return settle(it, KVP_OUT_EXPIRED, 0);
    int fd = kvp_item_lookup(c, it, &st);
    if (fd < 0)
        return -1;
    /* The span is what is warmed: the request's read_bytes, or less when the
     * file is shorter.  The tier rule judges read_bytes (kvp_tier_resident). */
    *span = MIN(it->size, it->read_bytes);
    if (*span == 0 || (it->residency == KVP_RES_TIER && kvp_tier_resident(&st, it->read_bytes))) {
        close(fd);  /* the O_PATH fstat was enough: no reopen */
        it->done = *span;
        return settle(it, KVP_OUT_RESIDENT, 0);
    }
    if ((fd = kvp_item_reopen(c, fd, it, &st)) < 0)
        return settle(it, classify(-fd), -fd);
    /* cachestat needs this real fd: fdget() refuses O_PATH files (EBADF). */
    if (it->residency == KVP_RES_PAGECACHE && kvp_resident_bytes(fd, 0, *span, 0) >= (int64_t)*span) {
        if (keep)
            *keep = fd;  /* warm already, and held for its consumer all the same */
        else
            close(fd);
        it->done = *span;
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
