/*
 * watch.c: who else opens a file the daemon holds open (daemon/kvprefetchd/holds.py).
 *
 * A file held open for a file system that keeps a file's data only while it is open
 * (s3fs) is let go once its consumer has opened it: the consumer's fd keeps the data
 * from then on.  inotify reports every open of the inode on this host (fsnotify runs
 * in the VFS, FUSE included); the watch is set through /proc/self/fd/N, so it names the
 * very inode held, with no path walk a rename could redirect, and IN_ONESHOT removes
 * it at the first event.
 */
#include "internal.h"

#include <errno.h>
#include <stdio.h>
#include <sys/inotify.h>

int kvp_watch_new(void)
{
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    return fd < 0 ? -errno : fd;
}

int kvp_watch_fd(int watch, int fd)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int wd = inotify_add_watch(watch, path, IN_OPEN | IN_ONESHOT | IN_DELETE_SELF);
    return wd < 0 ? -errno : wd;
}

int kvp_watch_drop(int watch, int wd)
{
    return inotify_rm_watch(watch, wd) < 0 ? -errno : 0;
}
