/* The inode table and the metadata ops of the passthrough.
 *
 * Paths, not O_PATH fds, name the backing files: a node keeps its path from
 * the backing root and every op resolves it with *at() from one directory fd.
 * That costs a path walk per lookup/open, and saves one fd per known file (a
 * 100,000-file dataset would otherwise need 100,000 fds).  Fds are held only
 * by open files and directories: one per FUSE open, closed at RELEASE.
 *
 * The kernel never sends "." or ".." to LOOKUP unless the file system
 * declares export support (fs/fuse/inode.c fuse_get_parent), which this one
 * does not, and it follows symlinks itself through READLINK, so node paths
 * never pass through a symlink or above the backing root; both are refused
 * anyway.
 */
#include "tiersim.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>

struct dir_handle {
    DIR *dp;
    struct dirent *entry;  /* read but not yet returned (did not fit) */
    off_t offset;
};

static uint64_t hash_key(dev_t dev, ino_t ino)
{
    uint64_t h = (uint64_t)ino * 0x9E3779B97F4A7C15ull ^ (uint64_t)dev * 0xC2B2AE3D27D4EB4Full;
    return h ^ (h >> 29);
}

struct node *node_of(fuse_ino_t ino)
{
    return ino == FUSE_ROOT_ID ? g.root : (struct node *)(uintptr_t)ino;
}

fuse_ino_t node_id(const struct node *node)
{
    return node == g.root ? FUSE_ROOT_ID : (fuse_ino_t)(uintptr_t)node;
}

const char *node_relpath(const struct node *node)
{
    return node->path[1] ? node->path + 1 : ".";
}

static struct node *find_locked(dev_t dev, ino_t ino)
{
    struct node *n = g.buckets[hash_key(dev, ino) & (g.nbuckets - 1)];
    while (n && (n->dev != dev || n->ino != ino))
        n = n->hash_next;
    return n;
}

static void grow_locked(void)
{
    uint64_t nb = g.nbuckets ? g.nbuckets * 2 : 1024;
    struct node **b = xcalloc(nb, sizeof(*b));
    for (uint64_t i = 0; i < g.nbuckets; i++) {
        struct node *n = g.buckets[i], *next;
        for (; n; n = next) {
            next = n->hash_next;
            uint64_t h = hash_key(n->dev, n->ino) & (nb - 1);
            n->hash_next = b[h];
            b[h] = n;
        }
    }
    free(g.buckets);
    g.buckets = b;
    g.nbuckets = nb;
}

/* The node of a backing file, created on first sight.  Takes `path` (freed
 * when an existing node is returned). */
static struct node *node_get_locked(const struct stat *st, char *path)
{
    struct node *n = g.nbuckets ? find_locked(st->st_dev, st->st_ino) : NULL;
    if (n) {
        free(path);
        n->mode = st->st_mode;
        return n;
    }
    if (g.nnodes >= g.nbuckets)
        grow_locked();
    n = xcalloc(1, sizeof(*n));
    n->dev = st->st_dev;
    n->ino = st->st_ino;
    n->mode = st->st_mode;
    n->path = path;
    n->size = (uint64_t)st->st_size;
    uint64_t h = hash_key(n->dev, n->ino) & (g.nbuckets - 1);
    n->hash_next = g.buckets[h];
    g.buckets[h] = n;
    g.nnodes++;
    return n;
}

struct node *node_create_root(const struct stat *st)
{
    pthread_mutex_lock(&g.lock);
    struct node *n = node_get_locked(st, xstrdup("/"));
    n->nlookup = 1;  /* the kernel's root inode is never looked up or forgotten */
    pthread_mutex_unlock(&g.lock);
    return n;
}

/* The node for a path under the mount ("/a/b" or "a/b"), NULL with *err = 0
 * when the kernel never looked the file up (then nothing of it is fetched or
 * cached), or with *err set when the path is bad or does not exist. */
struct node *node_by_path(const char *path, int *err)
{
    struct stat st;
    *err = 0;
    while (*path == '/')
        path++;
    for (const char *p = path; *p;) {  /* refuse ".." anywhere: stay under the root */
        size_t len = strcspn(p, "/");
        if (len == 2 && p[0] == '.' && p[1] == '.') {
            *err = EINVAL;
            return NULL;
        }
        p += len + strspn(p + len, "/");
    }
    if (fstatat(g.backing_fd, *path ? path : ".", &st, AT_SYMLINK_NOFOLLOW) < 0) {
        *err = errno;
        return NULL;
    }
    pthread_mutex_lock(&g.lock);
    struct node *n = find_locked(st.st_dev, st.st_ino);
    pthread_mutex_unlock(&g.lock);
    return n;
}

void nodes_collect(struct node ***out, uint64_t *count)
{
    *count = 0;
    *out = xcalloc(g.nnodes, sizeof(**out));
    for (uint64_t i = 0; i < g.nbuckets; i++)
        for (struct node *n = g.buckets[i]; n; n = n->hash_next)
            (*out)[(*count)++] = n;
}

/* An HSM stub or an AFM partially cached file has blocks only for the data on
 * the near tier: report the fetched chunks, in 4 KiB blocks (st_blocks is in
 * 512-byte units, stat(2)). */
void node_fill_attr(const struct node *node, struct stat *st)
{
    if (S_ISREG(st->st_mode)) {
        uint64_t bytes = tier_fetched_bytes(node);
        st->st_blocks = (blkcnt_t)((bytes + TIERSIM_BLOCK - 1) / TIERSIM_BLOCK * (TIERSIM_BLOCK / 512));
    }
}

static char *path_join(const char *dir, const char *name)
{
    size_t dl = strlen(dir), nl = strlen(name);
    char *p = xcalloc(dl + nl + 2, 1);
    memcpy(p, dir, dl);
    size_t at = dl;
    if (dl > 1)
        p[at++] = '/';
    memcpy(p + at, name, nl + 1);
    return p;
}

void op_lookup(fuse_req_t req, fuse_ino_t parent_ino, const char *name)
{
    struct node *parent = node_of(parent_ino);
    if (!strcmp(name, ".") || !strcmp(name, "..") || strchr(name, '/')) {
        fuse_reply_err(req, EINVAL);
        return;
    }
    char *path = path_join(parent->path, name);
    pthread_mutex_lock(&g.lock);
    if (hang_matches_locked(HANG_STAT, path)) {
        struct held h = { .kind = HANG_STAT, .op = HELD_LOOKUP, .req = req,
                          .ino = parent_ino, .name = (char *)name };
        hang_hold_locked(&h, path);
        pthread_mutex_unlock(&g.lock);
        free(path);
        return;
    }
    pthread_mutex_unlock(&g.lock);

    struct stat st;
    if (fstatat(g.backing_fd, path + 1, &st, AT_SYMLINK_NOFOLLOW) < 0) {
        int e = errno;
        free(path);
        fuse_reply_err(req, e);
        return;
    }
    struct fuse_entry_param e = { .attr = st, .attr_timeout = g.cfg.attr_timeout,
                                  .entry_timeout = g.cfg.entry_timeout };
    pthread_mutex_lock(&g.lock);
    g.n.lookups++;  /* counted when served: a held request is counted once, at its replay */
    struct node *node = node_get_locked(&st, path);
    node->nlookup++;
    node->size = (uint64_t)st.st_size;
    node_fill_attr(node, &e.attr);
    e.ino = node_id(node);
    pthread_mutex_unlock(&g.lock);
    if (fuse_reply_entry(req, &e) != 0) {  /* the kernel did not take the reference */
        pthread_mutex_lock(&g.lock);
        node->nlookup--;
        pthread_mutex_unlock(&g.lock);
    }
}

static void forget_one(fuse_ino_t ino, uint64_t nlookup)
{
    struct node *node = node_of(ino);
    if (node == g.root)
        return;
    pthread_mutex_lock(&g.lock);
    node->nlookup = node->nlookup > nlookup ? node->nlookup - nlookup : 0;
    pthread_mutex_unlock(&g.lock);
}

void op_forget(fuse_req_t req, fuse_ino_t ino, uint64_t nlookup)
{
    forget_one(ino, nlookup);
    fuse_reply_none(req);
}

void op_forget_multi(fuse_req_t req, size_t count, struct fuse_forget_data *forgets)
{
    for (size_t i = 0; i < count; i++)
        forget_one(forgets[i].ino, forgets[i].nlookup);
    fuse_reply_none(req);
}

void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct node *node = node_of(ino);
    pthread_mutex_lock(&g.lock);
    if (hang_matches_locked(HANG_STAT, node->path)) {
        struct held h = { .kind = HANG_STAT, .op = HELD_GETATTR, .req = req, .ino = ino };
        if (fi) {
            h.fi = *fi;
            h.has_fi = true;
        }
        hang_hold_locked(&h, node->path);
        pthread_mutex_unlock(&g.lock);
        return;
    }
    pthread_mutex_unlock(&g.lock);
    struct stat st;
    if (fstatat(g.backing_fd, node_relpath(node), &st, AT_SYMLINK_NOFOLLOW) < 0) {
        fuse_reply_err(req, errno);
        return;
    }
    pthread_mutex_lock(&g.lock);
    g.n.getattrs++;
    node->size = (uint64_t)st.st_size;
    node_fill_attr(node, &st);
    pthread_mutex_unlock(&g.lock);
    fuse_reply_attr(req, &st, g.cfg.attr_timeout);
}

void op_readlink(fuse_req_t req, fuse_ino_t ino)
{
    char buf[PATH_MAX + 1];
    ssize_t len = readlinkat(g.backing_fd, node_relpath(node_of(ino)), buf, PATH_MAX);
    if (len < 0) {
        fuse_reply_err(req, errno);
        return;
    }
    buf[len] = '\0';
    fuse_reply_readlink(req, buf);
}

void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct node *node = node_of(ino);
    if ((fi->flags & O_ACCMODE) != O_RDONLY) {
        fuse_reply_err(req, EROFS);
        return;
    }
    int fd = openat(g.backing_fd, node_relpath(node), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NOCTTY);
    if (fd < 0) {
        fuse_reply_err(req, errno);
        return;
    }
    pthread_mutex_lock(&g.lock);
    g.n.opens++;
    pthread_mutex_unlock(&g.lock);
    fi->fh = (uint64_t)fd;
    /* keep_cache: without it the kernel drops the file's page cache at every
     * open (fs/fuse/file.c fuse_finish_open: invalidate_inode_pages2 unless
     * FOPEN_KEEP_CACHE), so a warmed file would be cold again for the reader.
     * noflush: no FLUSH round trip at every close of a read-only file. */
    fi->keep_cache = 1;
    fi->noflush = 1;
    if (fuse_reply_open(req, fi) != 0)
        close(fd);
}

void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    close((int)fi->fh);
    fuse_reply_err(req, 0);
}

void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct node *node = node_of(ino);
    pthread_mutex_lock(&g.lock);
    if (hang_matches_locked(HANG_READDIR, node->path)) {
        struct held h = { .kind = HANG_READDIR, .op = HELD_OPENDIR, .req = req, .ino = ino,
                          .fi = *fi, .has_fi = true };
        hang_hold_locked(&h, node->path);
        pthread_mutex_unlock(&g.lock);
        return;
    }
    pthread_mutex_unlock(&g.lock);
    int fd = openat(g.backing_fd, node_relpath(node), O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        fuse_reply_err(req, errno);
        return;
    }
    struct dir_handle *d = xcalloc(1, sizeof(*d));
    d->dp = fdopendir(fd);
    if (!d->dp) {
        int e = errno;
        close(fd);
        free(d);
        fuse_reply_err(req, e);
        return;
    }
    fi->fh = (uint64_t)(uintptr_t)d;
    if (fuse_reply_open(req, fi) != 0) {
        closedir(d->dp);
        free(d);
    }
}

void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                struct fuse_file_info *fi)
{
    struct node *node = node_of(ino);
    struct dir_handle *d = (struct dir_handle *)(uintptr_t)fi->fh;
    pthread_mutex_lock(&g.lock);
    if (hang_matches_locked(HANG_READDIR, node->path)) {
        struct held h = { .kind = HANG_READDIR, .op = HELD_READDIR, .req = req, .ino = ino,
                          .size = size, .off = off, .fi = *fi, .has_fi = true };
        hang_hold_locked(&h, node->path);
        pthread_mutex_unlock(&g.lock);
        return;
    }
    g.n.readdirs++;
    pthread_mutex_unlock(&g.lock);
    char *buf = xcalloc(size, 1);
    if (off != d->offset) {
        seekdir(d->dp, off);
        d->entry = NULL;
        d->offset = off;
    }
    size_t used = 0;
    for (;;) {
        if (!d->entry) {
            errno = 0;
            d->entry = readdir(d->dp);
            if (!d->entry) {
                if (errno && used == 0) {
                    int e = errno;
                    free(buf);
                    fuse_reply_err(req, e);
                    return;
                }
                break;
            }
        }
        struct stat st = { .st_ino = d->entry->d_ino, .st_mode = (mode_t)d->entry->d_type << 12 };
        off_t next = d->entry->d_off;
        size_t len = fuse_add_direntry(req, buf + used, size - used, d->entry->d_name, &st, next);
        if (len > size - used)
            break;  /* keep d->entry for the next READDIR */
        used += len;
        d->entry = NULL;
        d->offset = next;
    }
    fuse_reply_buf(req, buf, used);
    free(buf);
}

void op_releasedir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    (void)ino;
    struct dir_handle *d = (struct dir_handle *)(uintptr_t)fi->fh;
    closedir(d->dp);
    free(d);
    fuse_reply_err(req, 0);
}

void op_statfs(fuse_req_t req, fuse_ino_t ino)
{
    (void)ino;
    struct statvfs sv;
    if (fstatvfs(g.backing_fd, &sv) < 0) {
        fuse_reply_err(req, errno);
        return;
    }
    fuse_reply_statfs(req, &sv);
}
