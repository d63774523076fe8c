/* The control socket: one text command per line, one JSON object per reply.
 *
 * A Unix stream socket whose path is given on the command line, outside the
 * mount, so no warmer walking the mount ever sees it.  Commands:
 *   ping                          {"ok": true}
 *   stats                         the counters and settings
 *   evict PATH                    forget the fetched chunks of a file (of every
 *                                 known file under PATH if it is a directory)
 *                                 and drop the kernel's cached pages of them
 *   evict-all                     the same for every file of the mount
 *   hang read|readdir|stat|all PREFIX
 *   release [all | KIND PREFIX]   end hangs and replay what they held
 *   set latency_ms|jitter_ms|slots|bandwidth VALUE
 *   reset-stats                   zero the counters (peak: to what is in flight)
 * Errors: {"ok": false, "error": "..."}.  One thread serves up to
 * MAX_CLIENTS connections with poll(); a command runs to completion before
 * the next (evict may wait for reads in flight on the file's pages).
 */
#include "tiersim.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAX_CLIENTS 16        /* tests and benches use a connection per command */
#define MAX_LINE 4096         /* a command line, PATH included (PATH_MAX) */
#define REPLY_BYTES 4096
#define SEND_TIMEOUT_S 2      /* a client that does not read its reply is dropped */

struct client {
    int fd;
    size_t len;
    char buf[MAX_LINE];
};

struct reply {
    char text[REPLY_BYTES];
    size_t len;
};

static int listen_fd = -1;
static int wake_pipe[2] = { -1, -1 };
static pthread_t thread;
static bool started;
static struct client clients[MAX_CLIENTS];

static void put(struct reply *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(struct reply *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(r->text + r->len, sizeof(r->text) - r->len, fmt, ap);
    va_end(ap);
    if (n > 0)
        r->len = r->len + (size_t)n < sizeof(r->text) ? r->len + (size_t)n : sizeof(r->text) - 1;
}

static void put_error(struct reply *r, const char *what, const char *detail)
{
    r->len = 0;
    put(r, "{\"ok\": false, \"error\": \"%s", what);
    for (const char *p = detail; p && *p; p++)  /* JSON string escaping of the detail */
        if (*p == '"' || *p == '\\')
            put(r, "\\%c", *p);
        else if ((unsigned char)*p < 0x20)
            put(r, "\\u%04x", (unsigned char)*p);
        else
            put(r, "%c", *p);
    put(r, "\"}");
}

static void cmd_stats(struct reply *r)
{
    pthread_mutex_lock(&g.lock);
    struct counters n = g.n;
    struct settings s = g.set;
    uint64_t files = g.nnodes;
    bool initialized = g.initialized, splice = g.conn_splice_write;
    unsigned background = g.conn_max_background, congestion = g.conn_congestion_threshold;
    unsigned readahead = g.conn_max_readahead, offered = g.kernel_max_readahead;
    pthread_mutex_unlock(&g.lock);
    n.reads = __atomic_load_n(&g.n.reads, __ATOMIC_RELAXED);
    n.read_bytes = __atomic_load_n(&g.n.read_bytes, __ATOMIC_RELAXED);
    n.read_errors = __atomic_load_n(&g.n.read_errors, __ATOMIC_RELAXED);
    uint64_t held = n.held[HANG_READ] + n.held[HANG_READDIR] + n.held[HANG_STAT];
    put(r, "{\"ok\": true, \"fetches\": %lu, \"fetched_bytes\": %lu, \"reads\": %lu, "
           "\"read_bytes\": %lu, \"read_errors\": %lu, \"in_flight\": %lu, "
           "\"peak_in_flight\": %lu, \"queued\": %lu, \"pending_reads\": %lu, "
           "\"held\": %lu, \"held_read\": %lu, \"held_readdir\": %lu, \"held_stat\": %lu, "
           "\"held_total\": %lu, \"evictions\": %lu, \"evicted_chunks\": %lu, ",
        n.fetches, n.fetched_bytes, n.reads, n.read_bytes, n.read_errors, n.in_flight,
        n.peak_in_flight, n.queued, n.pending_reads, held, n.held[HANG_READ],
        n.held[HANG_READDIR], n.held[HANG_STAT], n.held_total, n.evictions, n.evicted_chunks);
    put(r, "\"lookups\": %lu, \"getattrs\": %lu, \"opens\": %lu, \"readdirs\": %lu, "
           "\"files_known\": %lu, ",
        n.lookups, n.getattrs, n.opens, n.readdirs, files);
    put(r, "\"latency_ms\": %.3f, \"jitter_ms\": %.3f, \"slots\": %u, \"bandwidth\": %lu, "
           "\"chunk_bytes\": %lu, \"max_background\": %u, \"congestion_threshold\": %u, "
           "\"max_readahead\": %u, \"kernel_max_readahead\": %u, "
           "\"splice\": %s, \"fuse_threads\": %u, \"reply_threads\": %u, \"initialized\": %s}",
        s.latency_ms, s.jitter_ms, s.slots, s.bandwidth, g.cfg.chunk_bytes, background,
        congestion, readahead, offered, splice ? "true" : "false", g.cfg.fuse_threads,
        g.cfg.reply_threads, initialized ? "true" : "false");
}

static bool under(const char *path, const char *dir)
{
    size_t len = strlen(dir);
    return !strcmp(dir, "/") || (!strncmp(path, dir, len) && path[len] == '/');
}

/* Forget the chunks, then tell the kernel to drop the pages.  A file under a
 * read hang keeps its pages (attributes only): dropping them would wait for
 * the page locks of any READ held there (mm/truncate.c
 * invalidate_inode_pages2_range locks each folio), until a release that this
 * very thread would have to serve.  The rule, not only the READs held now,
 * decides, since a READ may arrive and be held while this runs; rules change
 * only on this thread, so they cannot change meanwhile. */
static void cmd_evict(struct reply *r, const char *path, bool all)
{
    struct node **nodes = NULL, *target = NULL;
    uint64_t count = 0;
    if (!all) {
        int err;
        if (!path || !*path) {
            put_error(r, "usage: evict PATH", NULL);
            return;
        }
        target = node_by_path(path, &err);
        if (err) {
            put_error(r, "evict: ", strerror(err));
            return;
        }
    }
    pthread_mutex_lock(&g.lock);
    if (all || (target && S_ISDIR(target->mode)))
        nodes_collect(&nodes, &count);
    else if (target && (nodes = xcalloc(1, sizeof(*nodes))))
        nodes[count++] = target;
    fuse_ino_t *inos = xcalloc(count ? count : 1, sizeof(*inos));
    bool *pages = xcalloc(count ? count : 1, sizeof(*pages));
    uint64_t files = 0, chunks = 0, notify = 0, kept = 0;
    for (uint64_t i = 0; i < count; i++) {
        struct node *n = nodes[i];
        if (!S_ISREG(n->mode) || (target && S_ISDIR(target->mode) && !under(n->path, target->path)))
            continue;
        uint64_t c = tier_evict_locked(n);
        files += c > 0;
        chunks += c;
        if (n->nlookup) {
            inos[notify] = node_id(n);
            pages[notify] = n->held_reads == 0 && !hang_matches_locked(HANG_READ, n->path);
            kept += !pages[notify];
            notify++;
        }
    }
    pthread_mutex_unlock(&g.lock);
    uint64_t failed = 0;
    for (uint64_t i = 0; i < notify; i++) {
        /* off 0, len 0: every page of the file, and its attributes (st_blocks);
         * off -1: the attributes only (fuse_lowlevel.h) */
        int res = fuse_lowlevel_notify_inval_inode(g.se, inos[i], pages[i] ? 0 : -1, 0);
        failed += res != 0 && res != -ENOENT;  /* ENOENT: the kernel forgot the inode meanwhile */
    }
    put(r, "{\"ok\": true, \"files\": %lu, \"chunks\": %lu, \"invalidated\": %lu, "
           "\"pages_kept_hung\": %lu, \"notify_errors\": %lu}",
        files, chunks, notify - kept, kept, failed);
    free(nodes);
    free(inos);
    free(pages);
}

static void cmd_set(struct reply *r, const char *key, const char *value)
{
    char *end = NULL;
    double v = value ? strtod(value, &end) : -1;
    if (!key || !value || end == value || *end || v < 0) {
        put_error(r, "usage: set latency_ms|jitter_ms|slots|bandwidth VALUE (>= 0)", NULL);
        return;
    }
    pthread_mutex_lock(&g.lock);
    bool known = true;
    if (!strcmp(key, "latency_ms"))
        g.set.latency_ms = v;
    else if (!strcmp(key, "jitter_ms"))
        g.set.jitter_ms = v;
    else if (!strcmp(key, "slots"))
        g.set.slots = (unsigned)v;
    else if (!strcmp(key, "bandwidth"))
        g.set.bandwidth = (uint64_t)v;
    else
        known = false;
    if (known)
        fetch_settings_changed_locked();
    pthread_mutex_unlock(&g.lock);
    if (known)
        put(r, "{\"ok\": true}");
    else
        put_error(r, "set: unknown key ", key);
}

static void cmd_reset(struct reply *r)
{
    pthread_mutex_lock(&g.lock);
    uint64_t in_flight = g.n.in_flight, queued = g.n.queued, pending = g.n.pending_reads;
    uint64_t held[HANG_KINDS];
    memcpy(held, g.n.held, sizeof(held));
    g.n = (struct counters){ .in_flight = in_flight, .peak_in_flight = in_flight,
                             .queued = queued, .pending_reads = pending };
    memcpy(g.n.held, held, sizeof(held));  /* gauges stay: they are the state now */
    pthread_mutex_unlock(&g.lock);
    put(r, "{\"ok\": true}");
}

/* A stat answered from the kernel's attribute cache never reaches a hang:
 * drop the cached attributes of the known files under the prefix, so the next
 * stat of each asks (GETATTR) and is held.  Dentries need nothing: a path
 * walk revalidates an expired one with a LOOKUP, which is held too. */
static void expire_attrs_under(const char *prefix)
{
    struct node **nodes;
    uint64_t count, matched = 0;
    pthread_mutex_lock(&g.lock);
    nodes_collect(&nodes, &count);
    for (uint64_t i = 0; i < count; i++)
        if (nodes[i]->nlookup && !strncmp(nodes[i]->path, prefix, strlen(prefix)))
            nodes[matched++] = nodes[i];
    pthread_mutex_unlock(&g.lock);
    for (uint64_t i = 0; i < matched; i++)
        fuse_lowlevel_notify_inval_inode(g.se, node_id(nodes[i]), -1, 0);
    free(nodes);
}

static void cmd_hang(struct reply *r, bool hang, char *save)
{
    char *kind = strtok_r(NULL, " \t\r", &save);
    char *prefix = save ? save + strspn(save, " \t") : NULL;
    unsigned kinds = 0;
    if (!hang && (!kind || !strcmp(kind, "all")) && (!prefix || !*prefix))
        put(r, "{\"ok\": true, \"released\": %lu}", hang_release(0, "", true));
    else if (!kind || hang_parse_kind(kind, &kinds) < 0 || !prefix || prefix[0] != '/')
        put_error(r, hang ? "usage: hang read|readdir|stat|all /PREFIX"
                          : "usage: release [all | read|readdir|stat|all /PREFIX]", NULL);
    else if (hang && hang_add(kinds, prefix) == 0) {
        if (kinds & 1u << HANG_STAT)
            expire_attrs_under(prefix);
        put(r, "{\"ok\": true}");
    }
    else
        put(r, "{\"ok\": true, \"released\": %lu}", hang_release(kinds, prefix, false));
}

static void run_command(char *line, struct reply *r)
{
    line[strcspn(line, "\r")] = '\0';
    char *save = NULL, *cmd = strtok_r(line, " \t", &save);
    char *rest = save ? save + strspn(save, " \t") : NULL;  /* the remainder: a path may hold spaces */
    if (!cmd) {
        put_error(r, "empty command", NULL);
    } else if (!strcmp(cmd, "ping")) {
        put(r, "{\"ok\": true}");
    } else if (!strcmp(cmd, "stats")) {
        cmd_stats(r);
    } else if (!strcmp(cmd, "evict")) {
        cmd_evict(r, rest, false);
    } else if (!strcmp(cmd, "evict-all")) {
        cmd_evict(r, NULL, true);
    } else if (!strcmp(cmd, "reset-stats")) {
        cmd_reset(r);
    } else if (!strcmp(cmd, "set")) {
        char *key = strtok_r(NULL, " \t", &save), *value = strtok_r(NULL, " \t", &save);
        cmd_set(r, key, value);
    } else if (!strcmp(cmd, "hang") || !strcmp(cmd, "release")) {
        cmd_hang(r, cmd[0] == 'h', save);
    } else {
        put_error(r, "unknown command: ", cmd);
    }
}

static void drop(struct client *c)
{
    close(c->fd);
    c->fd = -1;
    c->len = 0;
}

static void serve(struct client *c)
{
    ssize_t got = read(c->fd, c->buf + c->len, sizeof(c->buf) - c->len);
    if (got <= 0) {
        drop(c);
        return;
    }
    c->len += (size_t)got;
    char *nl;
    while (c->fd >= 0 && (nl = memchr(c->buf, '\n', c->len))) {
        *nl = '\0';
        struct reply r = { .len = 0 };
        run_command(c->buf, &r);
        put(&r, "\n");
        if (send(c->fd, r.text, r.len, MSG_NOSIGNAL) != (ssize_t)r.len) {
            drop(c);
            return;
        }
        size_t used = (size_t)(nl + 1 - c->buf);
        memmove(c->buf, nl + 1, c->len - used);
        c->len -= used;
    }
    if (c->len == sizeof(c->buf)) {
        struct reply r = { .len = 0 };
        put_error(&r, "line too long", NULL);
        put(&r, "\n");
        send(c->fd, r.text, r.len, MSG_NOSIGNAL);
        drop(c);
    }
}

static void accept_client(void)
{
    int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0)
        return;
    for (int i = 0; i < MAX_CLIENTS; i++)
        if (clients[i].fd < 0) {
            struct timeval tv = { .tv_sec = SEND_TIMEOUT_S };
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
            clients[i].fd = fd;
            clients[i].len = 0;
            return;
        }
    static const char busy[] = "{\"ok\": false, \"error\": \"too many control connections\"}\n";
    send(fd, busy, sizeof(busy) - 1, MSG_NOSIGNAL | MSG_DONTWAIT);
    close(fd);
}

static void *control_main(void *arg)
{
    (void)arg;
    struct pollfd fds[MAX_CLIENTS + 2];
    for (;;) {
        int n = 0, map[MAX_CLIENTS];
        fds[n++] = (struct pollfd){ .fd = wake_pipe[0], .events = POLLIN };
        fds[n++] = (struct pollfd){ .fd = listen_fd, .events = POLLIN };
        for (int i = 0; i < MAX_CLIENTS; i++)
            if (clients[i].fd >= 0) {
                map[n - 2] = i;
                fds[n++] = (struct pollfd){ .fd = clients[i].fd, .events = POLLIN };
            }
        if (poll(fds, (nfds_t)n, -1) < 0) {
            if (errno == EINTR)
                continue;
            logmsg("control: poll: %s", strerror(errno));
            break;
        }
        if (fds[0].revents)
            break;
        for (int i = 2; i < n; i++)
            if (fds[i].revents)
                serve(&clients[map[i - 2]]);
        if (fds[1].revents & POLLIN)
            accept_client();
    }
    for (int i = 0; i < MAX_CLIENTS; i++)
        if (clients[i].fd >= 0)
            drop(&clients[i]);
    return NULL;
}

int control_start(void)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    if (strlen(g.cfg.control) >= sizeof(addr.sun_path))
        return -ENAMETOOLONG;
    strcpy(addr.sun_path, g.cfg.control);
    for (int i = 0; i < MAX_CLIENTS; i++)
        clients[i].fd = -1;
    if (pipe2(wake_pipe, O_CLOEXEC) < 0)
        return -errno;
    listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listen_fd < 0)
        return -errno;
    mode_t old = umask(077);  /* root's knobs: owner only, from bind() on */
    int res = bind(listen_fd, (struct sockaddr *)&addr, sizeof(addr));
    umask(old);
    if (res < 0 || listen(listen_fd, MAX_CLIENTS) < 0)
        return -errno;
    int err = pthread_create(&thread, NULL, control_main, NULL);
    if (err)
        return -err;
    started = true;
    return 0;
}

void control_stop(void)
{
    if (started) {
        char byte = 0;
        if (write(wake_pipe[1], &byte, 1) < 0)
            logmsg("control: wake: %s", strerror(errno));
        pthread_join(thread, NULL);
    }
    if (listen_fd >= 0) {
        close(listen_fd);
        unlink(g.cfg.control);
    }
}
