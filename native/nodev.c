/*
 * nodev.c: a view of a root through which opening a file for reading can
 * never open a device.
 *
 * The page-cache rule needs a readable fd (cachestat refuses O_PATH fds), and a
 * name beneath a root may be anything.  Opening a device node for reading runs
 * its driver's open (a watchdog arms itself there), so the checked way resolves
 * the name O_PATH, checks with statx that it is a regular file, and only then
 * reopens that inode through /proc (open.c, probe.c): two opens per file, most
 * of the probe's CPU (docs/bench/hot.md).  On a mount flagged nodev the kernel
 * refuses to open a device node itself, before any driver runs (EACCES:
 * fs/namei.c may_open, may_open_dev), so one open does: a FIFO opens without
 * waiting (O_NONBLOCK) and is closed unread, a socket says ENXIO, and the
 * statx after the open sends everything but a regular file to the queue.
 *
 * kvp_nodev_view gives such a mount for a root: the root's own when it is
 * mounted nodev, else a copy of the root's mount tree (the root's directory
 * and every mount beneath it) flagged nodev and attached nowhere (open_tree
 * OPEN_TREE_CLONE and mount_setattr MOUNT_ATTR_NODEV, Linux 5.12; it takes
 * CAP_SYS_ADMIN over the mount namespace, which a daemon run as root has and
 * the shipped unprivileged unit does not).  The copy holds the same dentries
 * and inodes: a lookup beneath it costs what one beneath the root costs.  It
 * does not follow mounts made or removed beneath the root after it was made.
 * That cannot mislead the probe, which never walks through a mount point: a
 * dentry that is one in any tree is flagged so (DCACHE_MOUNTED), and the walk
 * under RESOLVE_NO_XDEV | RESOLVE_CACHED stops there (EAGAIN) in the copy as
 * in the root.  But a copy keeps a file system unmounted beneath the root
 * alive (its blocks, a server's connection) while it exists, so the worker
 * watches its mount table (/proc/self/mountinfo polls POLLPRI at every change)
 * and makes its copies again (daemon/kvprefetchd/worker/probe.py).
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/mount.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef OPEN_TREE_CLOEXEC
#define OPEN_TREE_CLOEXEC O_CLOEXEC
#endif
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif
#ifndef MOUNT_ATTR_NODEV
#define MOUNT_ATTR_NODEV 0x00000004
#endif

/* The fields of struct mount_attr (linux/mount.h, Linux 5.12), spelled here
 * for the headers that predate it. */
struct kvp_mount_attr {
    uint64_t attr_set;
    uint64_t attr_clr;
    uint64_t propagation;
    uint64_t userns_fd;
};

static int is_nodev(int fd)
{
    struct statvfs sv;
    return fstatvfs(fd, &sv) == 0 && (sv.f_flag & ST_NODEV);
}

int32_t kvp_nodev_view(int32_t root_fd, int32_t *detached)
{
    *detached = 0;
    if (root_fd < 0) {
        errno = EBADF;
        return -1;
    }
    if (is_nodev(root_fd))
        return fcntl(root_fd, F_DUPFD_CLOEXEC, 0);
    int fd = (int)syscall(SYS_open_tree, root_fd, "",
                          OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH | AT_RECURSIVE);
    if (fd < 0)
        return -1;  /* EPERM without CAP_SYS_ADMIN, ENOSYS before 5.2 */
    struct kvp_mount_attr attr = { .attr_set = MOUNT_ATTR_NODEV };
    if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH | AT_RECURSIVE, &attr, sizeof attr) < 0
        || !is_nodev(fd)) {
        int err = errno ? errno : EOPNOTSUPP;
        close(fd);
        errno = err;
        return -1;
    }
    *detached = 1;
    return fd;
}
