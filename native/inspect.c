/*
 * inspect.c: the check and evict verbs.  A file is resolved and verified as
 * the engines resolve it (open.c: beneath its root, regular files only), then
 * looked at: st_blocks for the tier, cachestat (mincore where it is missing)
 * over the whole file for the page cache, the head judged by the item's
 * residency rule.  Evict first drops pages with POSIX_FADV_DONTNEED, which
 * only ever drops clean, unmapped pages: it cannot lose data.
 *
 * Nothing here reads a byte: the O_PATH lookup, fstat, the read-only reopen
 * (needed by cachestat and fadvise: an O_PATH fd is refused, EBADF), cachestat
 * and fadvise leave atime alone, so `check` is safe on storage whose cleaners
 * go by atime.
 *
 * It runs on a worker's own thread, which a file system that never answers
 * would hold (a hung FUSE server: the stuck-worker cap then leaves no worker
 * for any root).  The root's own file system is the operator's choice of
 * root; a mount beneath it (a FUSE or NFS mount in a subdirectory) is not: a
 * name there is never looked up here (the lookup stays on the root's mount:
 * open.c, no_xdev) and is settled FAILED with EXDEV, `other_mount` in the
 * protocol (docs/protocol.md, "Check states").  Warm-ups of such names still
 * go to the queue, whose threads time out instead of the worker.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

static struct kvp_ctx features;  /* only have_openat2 / have_proc are used */
static pthread_once_t detect_once = PTHREAD_ONCE_INIT;

static void detect(void)
{
    kvp_open_detect(&features);
    features.no_xdev = 1;
}

void kvp_inspect_force_fallback(int32_t which)
{
    pthread_once(&detect_once, detect);
    kvp_ctx_force_fallback(&features, which);
}

/* The item's lookup outcome (KVP_OUT_*) as a check state. */
static int32_t state_of(int32_t outcome)
{
    switch (outcome) {
    case KVP_OUT_MISSING:
        return KVP_CHK_MISSING;
    case KVP_OUT_REJECTED:
        return KVP_CHK_REJECTED;
    default:
        return KVP_CHK_FAILED;
    }
}

/* DONTNEED drops whole folios only (mm/truncate.c: a large folio that straddles
 * the range's end stays): a head written or read in large folios (e.g. 1 MiB
 * writes) survives an exact-range DONTNEED.  So the range doubles until the
 * head is gone or the whole file was asked: at least the head is evicted, at
 * most the folio that holds its end besides. */
static void evict_head(int fd, uint64_t span, uint64_t size)
{
    for (uint64_t len = span;; len *= 2) {
        (void)posix_fadvise(fd, 0, len >= size ? 0 : (off_t)len, POSIX_FADV_DONTNEED);
        if (len >= size || kvp_resident_bytes(fd, 0, span, 0) <= 0)
            return;
    }
}

static void inspect_one(int32_t action, const struct kvp_item *in, struct kvp_inspect_out *out)
{
    struct kvp_item it = *in;
    struct stat st;
    memset(out, 0, sizeof *out);
    it.flags = 0;
    int fd = kvp_item_lookup(&features, &it, &st);
    if (fd < 0) {
        out->state = state_of(it.outcome);
        out->err = it.err;
        return;
    }
    out->size = (uint64_t)st.st_size;
    uint64_t span = MIN(out->size, it.read_bytes);
    if ((fd = kvp_item_reopen(&features, fd, &it, &st)) < 0) {
        out->state = fd == -ENOENT || fd == -ENOTDIR ? KVP_CHK_MISSING
                     : fd == -ESTALE ? KVP_CHK_REJECTED : KVP_CHK_FAILED;
        out->err = -fd;
        return;
    }
    if (action == KVP_INSPECT_EVICT_HEAD && span > 0)
        evict_head(fd, span, out->size);
    else if (action == KVP_INSPECT_EVICT_FILE)
        (void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    /* After an eviction st_blocks may have changed (a tier that drops its
     * copy with the pages): stat again rather than report the old figure. */
    if (action != KVP_INSPECT_CHECK && fstat(fd, &st) == 0)
        out->size = (uint64_t)st.st_size;
    out->tier = (uint64_t)st.st_blocks * 512;
    int64_t cached = kvp_resident_bytes(fd, 0, out->size, 0);
    int64_t head = span == 0 ? 0 : span == out->size ? cached : kvp_resident_bytes(fd, 0, span, 0);
    close(fd);
    if (cached < 0 || head < 0) {  /* EPERM: mincore would lie for this file */
        out->state = KVP_CHK_FAILED;
        out->err = (int32_t)-(cached < 0 ? cached : head);
        out->cached = 0;
        return;
    }
    out->cached = (uint64_t)cached;
    int resident = it.residency == KVP_RES_TIER ? kvp_tier_resident(&st, it.read_bytes)
                                                 : (uint64_t)head >= span;
    out->state = resident ? KVP_CHK_RESIDENT : KVP_CHK_COLD;
}

void kvp_inspect(int32_t action, const struct kvp_item *items, struct kvp_inspect_out *out,
                 size_t n)
{
    pthread_once(&detect_once, detect);
    for (size_t i = 0; i < n; i++) {
        if (action < KVP_INSPECT_CHECK || action > KVP_INSPECT_EVICT_FILE) {
            memset(&out[i], 0, sizeof out[i]);
            out[i].state = KVP_CHK_FAILED;
            out[i].err = EINVAL;
            continue;
        }
        inspect_one(action, &items[i], &out[i]);
    }
}
