/* tiersim: a slow storage tier, simulated by a read-only FUSE passthrough.
 *
 *   tiersim --backing DIR --mount DIR --control SOCKET [options]
 *
 * Models the first read of a cold file on a tiered file system (Storage Scale
 * AFM/HSM, object-backed FUSE mounts): each chunk's first read waits for a
 * "fetch" (latency, jitter, a cap on fetches in flight, a bandwidth cap), then
 * is served at local speed until evicted; st_blocks counts only fetched
 * chunks; hang modes hold requests until released.  See README.md, and the
 * module comments of tier.c, hang.c and control.c.
 *
 * Prints "ready" on stdout once mounted and listening on the control socket.
 * Exit status: 0 after a clean unmount or SIGTERM/SIGINT/SIGHUP, 1 on a
 * runtime error, 2 on bad usage, 3 when the mount itself fails (no /dev/fuse,
 * no permission: the caller may call FUSE unusable here), 4 when the backing
 * directory cannot be opened.
 */
#include "tiersim.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

enum { EXIT_RUNTIME = 1, EXIT_USAGE = 2, EXIT_MOUNT = 3, EXIT_BACKING = 4 };

/* Defaults, each with where it comes from. */
#define DEFAULT_CHUNK_BYTES (1u << 20)   /* a typical object/AFM fetch unit */
#define DEFAULT_MAX_BACKGROUND 1024      /* the kernel's 12 would cap every buffered warmer */
#define DEFAULT_FUSE_THREADS 8           /* ops never wait for latency: a few hide backing I/O */
#define DEFAULT_REPLY_THREADS 4          /* replies copy memory: ~cores, a few more for backing I/O */
#define DEFAULT_ENTRY_TIMEOUT 1.0        /* dentries: names do not change under a tier */
#define DEFAULT_ATTR_TIMEOUT 1.0         /* st_blocks: invalidated at each change (tier.c) */

struct tiersim g = { .lock = PTHREAD_MUTEX_INITIALIZER, .backing_fd = -1 };

void logmsg(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("tiersim: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void fatal(const char *what)
{
    logmsg("fatal: %s", what);
    abort();
}

void *xcalloc(size_t count, size_t size)
{
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p)
        fatal("out of memory");
    return p;
}

void *xrealloc(void *ptr, size_t size)
{
    void *p = realloc(ptr, size ? size : 1);
    if (!p)
        fatal("out of memory");
    return p;
}

char *xstrdup(const char *s)
{
    char *p = strdup(s);
    if (!p)
        fatal("out of memory");
    return p;
}

double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void op_init(void *userdata, struct fuse_conn_info *conn)
{
    (void)userdata;
    /* A FUSE mount allows max_background background requests in flight (the
     * READs of readahead and of async direct I/O); the rest wait in the kernel
     * (fs/fuse/dev.c flush_bg_queue).  The default, FUSE_DEFAULT_MAX_BACKGROUND
     * = 12 (fs/fuse/fuse_i.h), would cap every buffered warmer at 12 fetches
     * in flight whatever its thread count, so raise it, as a tier would.  Above
     * congestion_threshold, readahead drops its async part (fs/fuse/file.c
     * fuse_readahead: "Congested and only async pages left"): keep the
     * kernel's ratio, 9 of 12. */
    if (g.cfg.max_background) {  /* 0: leave the kernel's defaults, to show what they do */
        conn->max_background = g.cfg.max_background;
        conn->congestion_threshold = g.cfg.congestion_threshold
            ? g.cfg.congestion_threshold : g.cfg.max_background * 3 / 4;
    }
    /* The kernel offers its bdi's readahead, 128 KiB by default (VM_READAHEAD_PAGES),
     * and takes the minimum of that and our answer (fs/fuse/inode.c
     * process_init_reply): this can only lower it; read_ahead_kb in
     * /sys/class/bdi/0:N raises it after the mount. */
    unsigned offered = conn->max_readahead;
    if (g.cfg.max_readahead && g.cfg.max_readahead < conn->max_readahead)
        conn->max_readahead = g.cfg.max_readahead;
    /* Page cache is invalidated by `evict` only: not at each attribute change
     * (st_blocks changes with every fetch; fs/fuse/inode.c
     * fuse_change_attributes invalidates on mtime/size changes under auto_inval_data). */
    conn->want &= ~FUSE_CAP_AUTO_INVAL_DATA;
    if (conn->capable & FUSE_CAP_EXPLICIT_INVAL_DATA)
        conn->want |= FUSE_CAP_EXPLICIT_INVAL_DATA;
    if (g.cfg.splice && (conn->capable & FUSE_CAP_SPLICE_WRITE))
        conn->want |= FUSE_CAP_SPLICE_WRITE | (conn->capable & FUSE_CAP_SPLICE_MOVE);
    else
        conn->want &= ~(FUSE_CAP_SPLICE_WRITE | FUSE_CAP_SPLICE_MOVE);
    conn->want |= conn->capable & FUSE_CAP_ASYNC_READ;  /* readahead READs in parallel */

    pthread_mutex_lock(&g.lock);
    g.kernel_max_readahead = offered;
    g.conn_max_background = conn->max_background;
    g.conn_congestion_threshold = conn->congestion_threshold;
    g.conn_max_readahead = conn->max_readahead;
    g.conn_splice_write = conn->want & FUSE_CAP_SPLICE_WRITE;
    g.initialized = true;
    pthread_mutex_unlock(&g.lock);
    if (g.cfg.max_background)
        logmsg("INIT: max_background %u and congestion_threshold %u (raised from the kernel's "
               "defaults, 12 and 9, which would cap buffered readers at 12 fetches in flight)",
               conn->max_background, conn->congestion_threshold);
    else
        logmsg("INIT: max_background left at the kernel's default (12): buffered readers "
               "get at most 12 fetches in flight");
    logmsg("INIT: max_readahead %u (kernel offered %u), splice %s, chunk %lu bytes",
           conn->max_readahead, offered,
           g.conn_splice_write ? "on" : "off", g.cfg.chunk_bytes);
}

static const struct fuse_lowlevel_ops ops = {
    .init = op_init,
    .lookup = op_lookup,
    .forget = op_forget,
    .forget_multi = op_forget_multi,
    .getattr = op_getattr,
    .readlink = op_readlink,
    .open = op_open,
    .read = op_read,
    .release = op_release,
    .opendir = op_opendir,
    .readdir = op_readdir,
    .releasedir = op_releasedir,
    .statfs = op_statfs,
};

static void usage(const char *argv0)
{
    fprintf(stderr,
        "usage: %s --backing DIR --mount DIR --control SOCKET [options]\n"
        "  --latency-ms F          first-read latency of a chunk (0)\n"
        "  --jitter-ms F           plus uniform(0, F) per fetch (0)\n"
        "  --chunk-bytes N         fetch unit (%u)\n"
        "  --slots N               fetches in flight at most, 0 = unlimited (0)\n"
        "  --bandwidth N           bytes/s over all fetches, 0 = unlimited (0)\n"
        "  --max-background N      the mount's background requests, 0: the kernel's 12 (%u)\n"
        "  --congestion-threshold N  (3/4 of max-background)\n"
        "  --max-readahead N       lower the kernel's readahead offer (keep)\n"
        "  --threads N             FUSE loop threads (%u)\n"
        "  --reply-threads N       threads answering reads after their fetch (%u)\n"
        "  --entry-timeout F --attr-timeout F  kernel cache timeouts, s (%.1f, %.1f)\n"
        "  --no-splice             copy READ replies instead of splicing them\n"
        "  --clone-fd              one /dev/fuse fd per loop thread\n"
        "  --subtype NAME          the mount's type is fuse.NAME (tiersim)\n"
        "  --seed N                jitter's random seed (1)\n"
        "  --parent-pid PID        unmount and exit (SIGTERM) when PID's forking thread ends\n",
        argv0, DEFAULT_CHUNK_BYTES, DEFAULT_MAX_BACKGROUND, DEFAULT_FUSE_THREADS,
        DEFAULT_REPLY_THREADS, DEFAULT_ENTRY_TIMEOUT, DEFAULT_ATTR_TIMEOUT);
    exit(EXIT_USAGE);
}

static double parse_number(const char *arg, const char *argv0)
{
    char *end;
    double v = strtod(arg, &end);
    if (end == arg || *end || v < 0)
        usage(argv0);
    return v;
}

static void parse_options(int argc, char **argv)
{
    static const struct option longopts[] = {
        { "backing", required_argument, NULL, 'b' },
        { "mount", required_argument, NULL, 'm' },
        { "control", required_argument, NULL, 'c' },
        { "latency-ms", required_argument, NULL, 'l' },
        { "jitter-ms", required_argument, NULL, 'j' },
        { "chunk-bytes", required_argument, NULL, 'k' },
        { "slots", required_argument, NULL, 's' },
        { "bandwidth", required_argument, NULL, 'w' },
        { "max-background", required_argument, NULL, 'B' },
        { "congestion-threshold", required_argument, NULL, 'C' },
        { "max-readahead", required_argument, NULL, 'R' },
        { "threads", required_argument, NULL, 't' },
        { "reply-threads", required_argument, NULL, 'r' },
        { "entry-timeout", required_argument, NULL, 'E' },
        { "attr-timeout", required_argument, NULL, 'A' },
        { "no-splice", no_argument, NULL, 'S' },
        { "clone-fd", no_argument, NULL, 'F' },
        { "subtype", required_argument, NULL, 'T' },
        { "seed", required_argument, NULL, 'x' },
        { "parent-pid", required_argument, NULL, 'P' },
        { NULL, 0, NULL, 0 },
    };
    g.cfg = (struct config){
        .subtype = "tiersim", .chunk_bytes = DEFAULT_CHUNK_BYTES,
        .max_background = DEFAULT_MAX_BACKGROUND, .fuse_threads = DEFAULT_FUSE_THREADS,
        .reply_threads = DEFAULT_REPLY_THREADS, .entry_timeout = DEFAULT_ENTRY_TIMEOUT,
        .attr_timeout = DEFAULT_ATTR_TIMEOUT, .splice = true, .seed = 1,
    };
    int opt;
    while ((opt = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        const char *a = optarg;
        switch (opt) {
        case 'b': g.cfg.backing = a; break;
        case 'm': g.cfg.mountpoint = a; break;
        case 'c': g.cfg.control = a; break;
        case 'l': g.set.latency_ms = parse_number(a, argv[0]); break;
        case 'j': g.set.jitter_ms = parse_number(a, argv[0]); break;
        case 'k': g.cfg.chunk_bytes = (uint64_t)parse_number(a, argv[0]); break;
        case 's': g.set.slots = (unsigned)parse_number(a, argv[0]); break;
        case 'w': g.set.bandwidth = (uint64_t)parse_number(a, argv[0]); break;
        case 'B': g.cfg.max_background = (unsigned)parse_number(a, argv[0]); break;
        case 'C': g.cfg.congestion_threshold = (unsigned)parse_number(a, argv[0]); break;
        case 'R': g.cfg.max_readahead = (unsigned)parse_number(a, argv[0]); break;
        case 't': g.cfg.fuse_threads = (unsigned)parse_number(a, argv[0]); break;
        case 'r': g.cfg.reply_threads = (unsigned)parse_number(a, argv[0]); break;
        case 'E': g.cfg.entry_timeout = parse_number(a, argv[0]); break;
        case 'A': g.cfg.attr_timeout = parse_number(a, argv[0]); break;
        case 'S': g.cfg.splice = false; break;
        case 'F': g.cfg.clone_fd = true; break;
        case 'T': g.cfg.subtype = a; break;
        case 'x': g.cfg.seed = (uint64_t)parse_number(a, argv[0]); break;
        case 'P': g.cfg.parent_pid = (pid_t)parse_number(a, argv[0]); break;
        default: usage(argv[0]);
        }
    }
    /* max_background is a u16 in the INIT reply (include/uapi/linux/fuse.h) */
    if (!g.cfg.backing || !g.cfg.mountpoint || !g.cfg.control || optind != argc ||
        g.cfg.chunk_bytes < 4096 || g.cfg.max_background > 65535 ||
        g.cfg.fuse_threads == 0 || g.cfg.reply_threads == 0 || strchr(g.cfg.subtype, ','))
        usage(argv[0]);
    g.rng = g.cfg.seed ? g.cfg.seed : 1;
}

/* Open files hold one fd each (nodes.c), the splice pipes two per replying
 * thread: raise the soft limit to the hard one so the bound is the kernel's. */
static void raise_fd_limit(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

/* The signals that end the loop go to the loop's threads only: libfuse's
 * handler just sets a flag (fuse_session_exit), and only a loop thread
 * interrupted in read(/dev/fuse) notices it. */
static void block_exit_signals(sigset_t *old)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, old);
}

/* A test or bench that dies without cleaning up must not leave a mount (and
 * held readers) behind: the kernel sends SIGTERM when the thread that forked
 * us exits (prctl(2) PR_SET_PDEATHSIG), which unmounts as usual.  Checked
 * after the prctl, in case the parent was already gone. */
static void die_with_parent(void)
{
    if (!g.cfg.parent_pid)
        return;
    if (prctl(PR_SET_PDEATHSIG, SIGTERM) < 0 || getppid() != g.cfg.parent_pid) {
        logmsg("parent %d is gone", (int)g.cfg.parent_pid);
        exit(EXIT_RUNTIME);
    }
}

int main(int argc, char **argv)
{
    parse_options(argc, argv);
    die_with_parent();
    raise_fd_limit();

    struct stat st;
    g.backing_fd = open(g.cfg.backing, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (g.backing_fd < 0 || fstat(g.backing_fd, &st) < 0) {
        logmsg("backing directory %s: %s", g.cfg.backing, strerror(errno));
        return EXIT_BACKING;
    }
    g.root = node_create_root(&st);

    char opts[256];
    snprintf(opts, sizeof(opts), "ro,default_permissions,allow_other,fsname=tiersim,subtype=%s",
             g.cfg.subtype);
    char *fuse_argv[] = { argv[0], "-o", opts, NULL };
    struct fuse_args args = FUSE_ARGS_INIT(3, fuse_argv);
    g.se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
    if (!g.se) {
        logmsg("fuse_session_new failed");
        return EXIT_RUNTIME;
    }
    if (fuse_set_signal_handlers(g.se) != 0) {
        logmsg("fuse_set_signal_handlers failed");
        return EXIT_RUNTIME;
    }

    sigset_t old;
    block_exit_signals(&old);
    int err = control_start();
    if (err < 0) {
        logmsg("control socket %s: %s", g.cfg.control, strerror(-err));
        control_stop();
        return EXIT_RUNTIME;
    }
    if ((err = tier_start()) < 0)
        fatal("cannot start threads");
    pthread_sigmask(SIG_SETMASK, &old, NULL);

    if (fuse_session_mount(g.se, g.cfg.mountpoint) != 0) {
        logmsg("cannot mount %s (see libfuse's message above)", g.cfg.mountpoint);
        control_stop();
        tier_stop();
        fuse_remove_signal_handlers(g.se);
        fuse_session_destroy(g.se);
        return EXIT_MOUNT;
    }
    logmsg("mounted %s over %s: latency %.1f ms (+%.1f jitter), chunk %lu, slots %u, "
           "bandwidth %lu B/s, %u loop threads, %u reply threads",
           g.cfg.mountpoint, g.cfg.backing, g.set.latency_ms, g.set.jitter_ms,
           g.cfg.chunk_bytes, g.set.slots, g.set.bandwidth, g.cfg.fuse_threads,
           g.cfg.reply_threads);
    printf("ready\n");
    fflush(stdout);

    struct fuse_loop_config *loop = fuse_loop_cfg_create();
    fuse_loop_cfg_set_max_threads(loop, g.cfg.fuse_threads);
    fuse_loop_cfg_set_clone_fd(loop, g.cfg.clone_fd);
    int res = fuse_session_loop_mt(g.se, loop);
    fuse_loop_cfg_destroy(loop);
    logmsg("loop ended (%d): answering what is left, unmounting", res);

    control_stop();  /* first: an evict may wait on reads the reply threads answer */
    tier_stop();     /* then every waiting or held request gets its answer (EIO) */
    fuse_session_unmount(g.se);
    fuse_remove_signal_handlers(g.se);
    fuse_session_destroy(g.se);
    close(g.backing_fd);
    return res < 0 ? EXIT_RUNTIME : 0;  /* > 0: the signal that ended the loop */
}
