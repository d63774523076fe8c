/*
 * admit.c: the supervisor's admission of a request's paths in one call.
 *
 * The lexical gate (daemon/kvprefetchd/confine.py says it in Python, and stays
 * the reference: tests hold the two to the same answers), the canonical
 * spelling, the shard (kvp_shard of the relative part and the root index) and
 * each worker's room, for every path of a
 * request, with no Python object per path: the paths come in as one buffer
 * and leave as one buffer per worker, which is what the worker's channel
 * message carries.  In Python this loop was 60% of the supervisor's time on a
 * 1,000-path request (~3 us per path); here it is ~0.1 us.
 *
 * Paths that are not plain NUL-free bytes (a bin with a NUL, a non-path
 * value) never get here: the Python gate takes such a request whole.
 */
#include "internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define KVP_ADMIT_KEEP (4u << 20)  /* buffers larger than this are not kept between calls */

struct share {
    char *paths;      /* relative parts, each ended by NUL */
    size_t len, cap;
    uint16_t *roots;  /* root index per file */
    uint32_t count, roots_cap;
};

struct kvp_admission {
    uint32_t nroots, workers, max_path;
    char **prefixes;  /* root with one trailing '/', longest first */
    size_t *prefix_len;
    uint16_t *index;  /* each prefix's root index */
    struct share *shares;
    char *scratch;    /* a canonical spelling, before its shard is known */
};

void kvp_admission_free(struct kvp_admission *a)
{
    if (!a)
        return;
    for (uint32_t i = 0; a->prefixes && i < a->nroots; i++)
        free(a->prefixes[i]);
    for (uint32_t w = 0; a->shares && w < a->workers; w++) {
        free(a->shares[w].paths);
        free(a->shares[w].roots);
    }
    free(a->prefixes);
    free(a->prefix_len);
    free(a->index);
    free(a->shares);
    free(a->scratch);
    free(a);
}

struct kvp_admission *kvp_admission_new(const char *prefixes, const uint16_t *index,
                                        uint32_t nroots, uint32_t max_path_bytes,
                                        uint32_t workers)
{
    struct kvp_admission *a = calloc(1, sizeof *a);
    if (!a || workers == 0)
        goto fail;
    a->workers = workers;
    a->max_path = max_path_bytes;
    if (!(a->prefixes = calloc(nroots ? nroots : 1, sizeof *a->prefixes)) ||
        !(a->prefix_len = calloc(nroots ? nroots : 1, sizeof *a->prefix_len)) ||
        !(a->index = calloc(nroots ? nroots : 1, sizeof *a->index)) ||
        !(a->shares = calloc(workers, sizeof *a->shares)) ||
        !(a->scratch = malloc((size_t)max_path_bytes + 3)))
        goto fail;
    for (const char *at = prefixes; a->nroots < nroots; at += strlen(at) + 1) {
        if (!(a->prefixes[a->nroots] = strdup(at)))
            goto fail;
        a->prefix_len[a->nroots] = strlen(at);
        a->index[a->nroots] = index[a->nroots];
        a->nroots++;
    }
    return a;
fail:
    kvp_admission_free(a);
    return NULL;
}

/* The canonical spelling of rel (confine.canonical) into out (room for len + 2
 * bytes); returns its length.  Empty and "." components dropped, a trailing
 * "/" or "/." kept as one "/", nothing left: ".". */
static size_t canonical(const char *rel, size_t len, char *out)
{
    size_t o = 0, at = 0;
    int trailing = 0;
    while (at <= len) {
        const char *slash = memchr(rel + at, '/', len - at);
        size_t part = (slash ? (size_t)(slash - rel) : len) - at;
        int last = !slash;
        if (part && !(part == 1 && rel[at] == '.')) {
            if (o)
                out[o++] = '/';
            memcpy(out + o, rel + at, part);
            o += part;
        }
        if (last) {
            trailing = part == 0 || (part == 1 && rel[at] == '.');
            break;
        }
        at += part + 1;
    }
    if (o == 0) {
        out[0] = '.';
        return 1;
    }
    if (trailing)
        out[o++] = '/';
    return o;
}

/* One pass over rel's components: KVP_ADMIT_DOTDOT when one is "..", else
 * whether canonical() may change it (an empty or "." component; a prefilter:
 * canonical() leaves any other name as it is). */
static int components(const char *rel, size_t len, int *respell)
{
    *respell = 0;
    for (size_t at = 0; at <= len;) {
        const char *slash = at < len ? memchr(rel + at, '/', len - at) : NULL;
        size_t part = (slash ? (size_t)(slash - rel) : len) - at;
        if (part == 2 && rel[at] == '.' && rel[at + 1] == '.')
            return KVP_ADMIT_DOTDOT;
        if (part == 0 || (part == 1 && rel[at] == '.'))
            *respell = 1;
        at += part + 1;
    }
    return KVP_ADMIT_ACCEPTED;
}

/* Make room for one more file of up to len bytes in s: 0 or ENOMEM. */
static int reserve(struct share *s, size_t len)
{
    if (s->len + len + 3 > s->cap) {
        size_t cap = s->cap ? s->cap : 4096;
        while (cap < s->len + len + 3)
            cap *= 2;
        char *p = realloc(s->paths, cap);
        if (!p)
            return ENOMEM;
        s->paths = p, s->cap = cap;
    }
    if (s->count == s->roots_cap) {
        uint32_t cap = s->roots_cap ? s->roots_cap * 2 : 256;
        uint16_t *r = realloc(s->roots, cap * sizeof *r);
        if (!r)
            return ENOMEM;
        s->roots = r, s->roots_cap = cap;
    }
    return 0;
}

/* The worker that owns a file.  Any hash stable across processes serves (each
 * worker's dedup memory must see every request for its files); zlib's crc32,
 * the first choice, cost ~200 ns for a 110-byte name here, 80% of this call.
 * This one mixes a word at a time (~20 ns): a multiply-xorshift per 8 bytes
 * and a final avalanche (the finalizer of MurmurHash3's 64-bit variant). */
static uint64_t mix(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    return h ^ (h >> 33);
}

uint32_t kvp_shard(uint32_t root, const char *rel, size_t len, uint32_t workers)
{
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ ((uint64_t)root << 32) ^ len, w;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        memcpy(&w, rel + i, 8);
        h = (h ^ w) * 0x87c37b91114253d5ULL;
        h ^= h >> 31;
    }
    if (i < len) {
        w = 0;
        memcpy(&w, rel + i, len - i);
        h = (h ^ w) * 0x4cf5ad432745937fULL;
    }
    return workers ? (uint32_t)(mix(h) % workers) : 0;
}

/* One path: its root and relative part, or a KVP_ADMIT_* refusal. */
static int place(const struct kvp_admission *a, const char *path, size_t len, uint32_t *root,
                 const char **rel, size_t *rel_len, int *respell)
{
    if (len > a->max_path)
        return KVP_ADMIT_TOO_LONG;
    for (uint32_t i = 0; i < a->nroots; i++) {
        size_t pl = a->prefix_len[i];
        if (len >= pl && !memcmp(path, a->prefixes[i], pl)) {
            const char *r = path + pl;
            size_t rl = len - pl;
            while (rl && *r == '/')
                r++, rl--;
            if (!rl)
                return KVP_ADMIT_NOT_A_FILE;
            if (components(r, rl, respell) == KVP_ADMIT_DOTDOT)
                return KVP_ADMIT_DOTDOT;
            *root = a->index[i], *rel = r, *rel_len = rl;
            return KVP_ADMIT_ACCEPTED;
        }
    }
    return len && path[0] == '/' ? KVP_ADMIT_OUTSIDE_ROOTS : KVP_ADMIT_RELATIVE;
}

int64_t kvp_admit(struct kvp_admission *a, const char *blob, size_t len, size_t n, int64_t *room,
                  uint8_t *status)
{
    int64_t accepted = 0;
    size_t at = 0;
    for (uint32_t w = 0; w < a->workers; w++) {
        struct share *s = &a->shares[w];
        if (s->cap > KVP_ADMIT_KEEP) {  /* a huge request's buffers do not stay */
            free(s->paths);
            s->paths = NULL, s->cap = 0;
        }
        if (s->roots_cap > KVP_ADMIT_KEEP / sizeof *s->roots) {
            free(s->roots);
            s->roots = NULL, s->roots_cap = 0;
        }
        s->len = 0, s->count = 0;
    }
    for (size_t i = 0; i < n; i++) {
        if (at > len)
            return -EINVAL;
        const char *path = blob + at;
        const char *end = memchr(path, '\0', len - at);
        size_t plen = end ? (size_t)(end - path) : len - at;
        if (!end != (i == n - 1))
            return -EINVAL;  /* not n names: a NUL inside one */
        at += plen + 1;
        uint32_t root = 0;
        const char *rel = NULL;
        size_t rel_len = 0;
        int respell = 0;
        int verdict = place(a, path, plen, &root, &rel, &rel_len, &respell);
        if (verdict != KVP_ADMIT_ACCEPTED) {
            status[i] = (uint8_t)verdict;
            continue;
        }
        if (respell) {  /* every spelling of a file: one shard */
            rel_len = canonical(rel, rel_len, a->scratch);
            rel = a->scratch;
        }
        uint32_t w = kvp_shard(root, rel, rel_len, a->workers);
        if (room[w] <= 0) {
            status[i] = KVP_ADMIT_DROPPED;
            continue;
        }
        struct share *s = &a->shares[w];
        if (reserve(s, rel_len))
            return -ENOMEM;
        memcpy(s->paths + s->len, rel, rel_len);
        s->len += rel_len;
        s->paths[s->len++] = '\0';
        s->roots[s->count++] = (uint16_t)root;
        room[w]--;
        status[i] = KVP_ADMIT_ACCEPTED;
        accepted++;
    }
    return at == len + 1 || n == 0 ? accepted : -EINVAL;
}

uint32_t kvp_admission_share(const struct kvp_admission *a, uint32_t worker, const char **paths,
                             size_t *paths_len, const uint16_t **roots)
{
    const struct share *s = &a->shares[worker];
    *paths = s->paths;
    *paths_len = s->len;
    *roots = s->roots;
    return s->count;
}
