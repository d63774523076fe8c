/*
 * residency.c: is a head already warm?  The page-cache rule (cachestat, or
 * mincore where it is missing: kvp_resident_bytes) and the storage-tier rule
 * (st_blocks: kvp_tier_resident).  kvp_item_open (open.c) applies them.
 */
#include "internal.h"

#include <errno.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KVP_MINCORE_VEC 4096  /* pages per mincore() call (vector on the stack) */

/* cachestat(2), Linux 6.5 (commit cf264e1329fb), is not in Debian 12's
 * headers: 451 on every architecture using the generic table. */
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct kvp_cachestat_range { uint64_t off, len; };
struct kvp_cachestat { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; };

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
int kvp_tier_resident(const struct stat *st, uint64_t read_bytes)
{
    uint64_t blocks = (uint64_t)st->st_blocks * 512, size = (uint64_t)st->st_size;
    return size <= read_bytes ? blocks >= size : blocks > read_bytes;
}
