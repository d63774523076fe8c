/* Hang modes: a tier that stops answering, per path prefix.
 *
 * A request whose path starts with a hung prefix is not answered: its
 * arguments are kept and the FUSE thread returns to the loop.  The caller
 * waits in the kernel, and once this process has read the request that wait
 * is uninterruptible, SIGKILL included (fs/fuse/dev.c request_wait_answer:
 * after FR_SENT only wait_event(), "Either request is already in userspace, or
 * it was forced. Wait it out.").  That is the production hazard the
 * reliability tests reproduce, so every held request is answered in the end:
 * `release` replays it as if it had just arrived, and shutdown answers it with
 * EIO (tier_stop); if this process dies instead, the kernel aborts the
 * connection and fails them all (fuse_dev_release -> fuse_abort_conn).
 *
 * Kinds and the requests they hold:
 *   read     READ
 *   readdir  OPENDIR, READDIR
 *   stat     LOOKUP (the path of the entry looked up), GETATTR
 * Paths are from the mount's root, "/" first; a prefix matches by bytes, so
 * "/model_a/" holds what is inside model_a but not model_a itself, "/model_a"
 * both.  Only requests that reach this process can hang: pages in the page
 * cache, and dentries and attributes within their timeouts, are answered by
 * the kernel.
 */
#include "tiersim.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

const char *const hang_kind_names[HANG_KINDS] = { "read", "readdir", "stat" };

struct hang_rule {
    enum hang_kind kind;
    char *prefix;
    struct hang_rule *next;
};

bool hang_matches_locked(enum hang_kind kind, const char *path)
{
    for (const struct hang_rule *r = g.rules; r; r = r->next)
        if (r->kind == kind && !strncmp(path, r->prefix, strlen(r->prefix)))
            return true;
    return false;
}

static void held_free(struct held *h)
{
    free(h->name);
    free(h->path);
    free(h);
}

static void held_replay(struct work *w)
{
    struct held *h = (struct held *)w;
    struct fuse_file_info *fi = h->has_fi ? &h->fi : NULL;
    switch (h->op) {
    case HELD_LOOKUP:
        op_lookup(h->req, h->ino, h->name);
        break;
    case HELD_GETATTR:
        op_getattr(h->req, h->ino, fi);
        break;
    case HELD_READ:
        op_read(h->req, h->ino, h->size, h->off, fi);
        break;
    case HELD_OPENDIR:
        op_opendir(h->req, h->ino, fi);
        break;
    case HELD_READDIR:
        op_readdir(h->req, h->ino, h->size, h->off, fi);
        break;
    }
    held_free(h);
}

static void held_cancel(struct work *w)
{
    struct held *h = (struct held *)w;
    fuse_reply_err(h->req, EIO);
    held_free(h);
}

void hang_hold_locked(struct held *args, const char *path)
{
    struct held *h = xcalloc(1, sizeof(*h));
    *h = *args;
    h->work = (struct work){ held_replay, held_cancel, NULL };
    h->name = args->name ? xstrdup(args->name) : NULL;
    h->path = xstrdup(path);
    h->next = g.held;
    g.held = h;
    g.n.held[h->kind]++;
    g.n.held_total++;
    if (h->node)
        h->node->held_reads++;
}

/* Unlink the held requests that no rule matches any more (every one, with
 * `everything`) and queue them, oldest first, for the reply threads, which
 * replay them (or, at shutdown, tier_stop cancels them). */
static uint64_t requeue_locked(bool everything)
{
    struct held *out = NULL, **pp = &g.held;
    uint64_t count = 0;
    while (*pp) {
        struct held *h = *pp;
        if (everything || !hang_matches_locked(h->kind, h->path)) {
            *pp = h->next;
            h->next = out;  /* g.held is newest first: this reverses it */
            out = h;
            g.n.held[h->kind]--;
            if (h->node)
                h->node->held_reads--;
            count++;
        } else {
            pp = &h->next;
        }
    }
    for (; out; out = out->next)
        work_push_locked(&out->work);
    return count;
}

int hang_parse_kind(const char *word, unsigned *kinds)
{
    if (!strcmp(word, "all")) {
        *kinds = (1u << HANG_KINDS) - 1;
        return 0;
    }
    for (unsigned k = 0; k < HANG_KINDS; k++)
        if (!strcmp(word, hang_kind_names[k])) {
            *kinds = 1u << k;
            return 0;
        }
    return -EINVAL;
}

int hang_add(unsigned kinds, const char *prefix)
{
    if (prefix[0] != '/')
        return -EINVAL;
    pthread_mutex_lock(&g.lock);
    for (unsigned k = 0; k < HANG_KINDS; k++) {
        if (!(kinds & 1u << k))
            continue;
        bool present = false;
        for (const struct hang_rule *r = g.rules; r; r = r->next)
            present |= r->kind == k && !strcmp(r->prefix, prefix);
        if (present)
            continue;
        struct hang_rule *r = xcalloc(1, sizeof(*r));
        *r = (struct hang_rule){ (enum hang_kind)k, xstrdup(prefix), g.rules };
        g.rules = r;
    }
    pthread_mutex_unlock(&g.lock);
    return 0;
}

/* Drop the rules (every rule with `all`, else those of `kinds` with exactly
 * this prefix) and replay the held requests no remaining rule matches.
 * Returns how many requests were released. */
uint64_t hang_release(unsigned kinds, const char *prefix, bool all)
{
    pthread_mutex_lock(&g.lock);
    struct hang_rule **pp = &g.rules;
    while (*pp) {
        struct hang_rule *r = *pp;
        if (all || (kinds & 1u << r->kind && !strcmp(r->prefix, prefix))) {
            *pp = r->next;
            free(r->prefix);
            free(r);
        } else {
            pp = &r->next;
        }
    }
    uint64_t released = requeue_locked(false);
    pthread_mutex_unlock(&g.lock);
    return released;
}

/* Shutdown: no more rules; every held request goes to the work queue, which
 * tier_stop cancels (EIO). */
void hang_cancel_all_locked(void)
{
    while (g.rules) {
        struct hang_rule *r = g.rules;
        g.rules = r->next;
        free(r->prefix);
        free(r);
    }
    requeue_locked(true);
}
