/*
 * tsan_queue.c: the queue under ThreadSanitizer (test_native_tsan.py builds it
 * with every native/*.c and -fsanitize=thread).  A burst of files through a
 * queue engine, while a second thread forces the openat2 and /proc fallbacks
 * (kvp_queue_force_fallback) once the queue's threads are reading, and the
 * queue starts threads as the burst grows it.  Prints one JSON line.
 *   tsan_queue DIR FILES ENGINE WARM_MODE
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include "kvprefetch.h"

#define NAMES 64  /* files f0 .. f63 in DIR, each named many times */

static struct kvp_queue *queue;
static atomic_int reading;

static void *force(void *arg)
{
    (void)arg;
    while (!atomic_load(&reading))
        usleep(100);
    kvp_queue_force_fallback(queue, KVP_FALLBACK_OPENAT2 | KVP_FALLBACK_PROC);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 5)
        return 2;
    int root = open(argv[1], O_PATH | O_DIRECTORY | O_CLOEXEC), n = atoi(argv[2]), err = 0;
    struct kvp_queue_config cfg = { .engine = argv[3], .warm_mode = argv[4], .fadv_random = 1,
                                    .chunk = 16384, .initial_depth = 2, .max_threads = 16 };
    if (root < 0 || n <= 0 || !(queue = kvp_queue_new(&cfg, &err)))
        return printf("{\"error\": %d}\n", err), 1;
    struct kvp_item *items = calloc((size_t)n, sizeof *items);
    uint64_t *tags = calloc((size_t)n, sizeof *tags);
    char (*names)[16] = calloc(NAMES, sizeof *names);
    for (int i = 0; i < NAMES; i++)
        snprintf(names[i], sizeof *names, "f%d", i);
    for (int i = 0; i < n; i++) {
        items[i] = (struct kvp_item){ .root_fd = root, .rel = names[i % NAMES],
                                      .read_bytes = 65536, .group = (uint32_t)(i / 50),
                                      .client = (uint32_t)(i % 3) };
        tags[i] = (uint64_t)i;
    }
    pthread_t forcer;
    pthread_create(&forcer, NULL, force, NULL);
    int got = 0, outcomes[KVP_OUT_EXPIRED + 1] = { 0 };
    struct kvp_done out[256];
    for (int k = 0; k < n; k += 100)  /* in pieces: the pool grows while it serves */
        kvp_queue_submit(queue, items + k, tags + k, (size_t)(n - k < 100 ? n - k : 100));
    while (got < n) {
        struct pollfd p = { kvp_queue_fd(queue), POLLIN, 0 };
        poll(&p, 1, 50);
        kvp_queue_tick(queue);
        size_t r = kvp_queue_reap(queue, out, 256);
        for (size_t i = 0; i < r; i++)
            outcomes[out[i].outcome]++;
        got += (int)r;
        if (got > 0)
            atomic_store(&reading, 1);
    }
    pthread_join(forcer, NULL);
    struct kvp_queue_stats st;
    kvp_queue_stats(queue, &st);
    printf("{\"read\": %d, \"settled\": %d, \"threads\": %u, \"spawn_failures\": %llu}\n",
           outcomes[KVP_OUT_READ], got, st.threads, (unsigned long long)st.spawn_failures);
    kvp_queue_free(queue);
    return 0;
}
