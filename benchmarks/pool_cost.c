/* pool_cost.c: what one kvref_pool_run costs beyond its units' work (benchmarks/pool_cost.py builds
 * and runs it; the numbers go to docs/benchmarks.md, "The thread pool past two cores").
 *
 *   pool_cost THREADS ROUNDS
 *
 * prints one JSON object of medians, in nanoseconds:
 *   run_empty      a run of THREADS empty units, back to back: publish, claims, the caller's wait
 *                  (workers spinning: the cost a decode step pays per kernel call)
 *   run_empty_64   the same with 64 empty units (each claim a compare-exchange on one shared word)
 *   run_work       a run of 4 units of 5 us per thread (20 us of work for each thread), minus those
 *                  20 us: publish, claims, the handoff and the wait for the last unit, on units of a
 *                  kernel call's size
 *   handoff_hot    from the caller's publish to a spinning worker starting a unit
 *   handoff_cold   the same for a worker asleep on the condition variable (the run follows a pause
 *                  longer than the pool's spin): the wake-up a step pays after Python was slow
 */
#define _POSIX_C_SOURCE 200809L

#include <stdio.h>
#include <stdlib.h>

#include "internal.h"
#include "platform.h"

static void empty_unit(void *ctx, int64_t unit, int thread) { (void)ctx, (void)unit, (void)thread; }

/* a unit of `*(int64_t *)ctx` ns of spinning */
static void busy_unit(void *ctx, int64_t unit, int thread) {
    (void)unit, (void)thread;
    const int64_t t0 = kvref_now_ns();
    while (kvref_now_ns() - t0 < *(const int64_t *)ctx) {
    }
}

/* a handoff: each of two units records when it started, on which thread, then spins 2 ms so the
 * other unit is left for the worker if it arrives within that time */
typedef struct {
    int64_t start[2];
    int thread[2];
} handoff;

static void handoff_unit(void *ctx, int64_t unit, int thread) {
    handoff *h = ctx;
    h->start[unit] = kvref_now_ns();
    h->thread[unit] = thread;
    while (kvref_now_ns() - h->start[unit] < 2000000) {
    }
}

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int64_t median(int64_t *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_i64);
    return n ? v[n / 2] : -1;
}

/* median ns of one run of `units` units of `fn`, `rounds` runs back to back */
static int64_t run_cost(kvref_pool *pool, kvref_task_fn fn, void *ctx, int64_t units, int rounds, int64_t *t) {
    for (int r = 0; r < rounds; r++) {
        const int64_t t0 = kvref_now_ns();
        kvref_pool_run(pool, fn, ctx, units);
        t[r] = kvref_now_ns() - t0;
    }
    return median(t, rounds);
}

/* median ns from publish to the worker's unit start, after `pause_ns` of idleness; -1 when the
 * worker never took a unit (one thread, or a machine too busy to run it within 2 ms) */
static int64_t handoff_cost(kvref_pool *pool, int64_t pause_ns, int rounds, int64_t *t) {
    int n = 0;
    for (int r = 0; r < rounds; r++) {
        const int64_t until = kvref_now_ns() + pause_ns;
        while (kvref_now_ns() < until) {
            if (pause_ns > 100000) nanosleep(&(struct timespec){0, 100000}, NULL);
        }
        handoff h = {{0, 0}, {-1, -1}};
        const int64_t t0 = kvref_now_ns();
        kvref_pool_run(pool, handoff_unit, &h, 2);
        for (int u = 0; u < 2; u++)
            if (h.thread[u] > 0) t[n++] = h.start[u] - t0;
    }
    return median(t, n);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: pool_cost THREADS ROUNDS\n");
        return 2;
    }
    const int64_t threads = atoll(argv[1]);
    const int rounds = atoi(argv[2]);
    kvref_pool *pool;
    if (rounds < 1 || kvref_pool_create(threads, KVREF_ISA_AUTO, &pool) != KVREF_OK) {
        fprintf(stderr, "pool_cost: bad THREADS or ROUNDS\n");
        return 2;
    }
    int64_t *t = malloc(sizeof(int64_t) * (size_t)rounds);
    const int64_t empty = run_cost(pool, empty_unit, NULL, threads, rounds, t);
    const int64_t empty64 = run_cost(pool, empty_unit, NULL, 64, rounds, t);
    int64_t unit_ns = 5000;
    const int64_t work = run_cost(pool, busy_unit, &unit_ns, 4 * threads, rounds / 4 + 1, t) - 4 * unit_ns;
    const int handoffs = rounds < 200 ? rounds : 200;
    const int64_t hot = handoff_cost(pool, 0, handoffs, t);
    const int64_t cold = handoff_cost(pool, 5000000, handoffs / 4 + 1, t); /* 5 ms: past the 0.3 ms spin */
    printf("{\"threads\": %lld, \"run_empty\": %lld, \"run_empty_64\": %lld, \"run_work\": %lld, \"handoff_hot\": %lld, "
           "\"handoff_cold\": %lld}\n", (long long)threads, (long long)empty, (long long)empty64, (long long)work, (long long)hot,
           (long long)cold);
    free(t);
    kvref_pool_destroy(pool);
    return 0;
}
