/* pool.c: the persistent thread pool, run-time CPU detection, and the small query functions.
 *
 * A pool owns n_threads - 1 threads (pthreads, or Win32 threads: platform.h) that live until
 * kvref_pool_destroy. A kernel call publishes a task (a function over units); the calling thread and
 * every awake worker claim units one at a time and run them. Idle workers spin briefly on a
 * generation counter after each task (decode issues hundreds of small calls per token, and a futex
 * wake costs tens of microseconds), then sleep on a condition variable.
 *
 * The caller waits only for units that were claimed, never for a worker to show up: on a busy
 * machine where a worker is descheduled, the caller simply runs every unit itself. Claims go
 * through one atomic word holding (tag, unit count, next unit), so a worker that wakes late and
 * still holds an old word cannot claim a unit of a newer task (its compare-exchange fails), and a
 * claimed unit keeps its task alive: the caller does not return (and cannot publish the next task)
 * until every claimed unit is done.
 */
#define _POSIX_C_SOURCE 200809L
#define _DARWIN_C_SOURCE /* macOS: sysctlbyname beside the POSIX names */

#include <stdatomic.h>
#include <stdlib.h>

#include "internal.h"
#include "platform.h"

#if KVREF_X86
#include <cpuid.h>
#endif
#if KVREF_NEON_DOT && defined(__linux__)
#include <sys/auxv.h>
#endif
#if KVREF_NEON_DOT && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

/* How long an idle worker spins before sleeping: longer than the Python gap between two kernel
 * calls of a decode step, short enough that an idle process stops burning a core quickly. */
#define KVREF_SPIN_NS 300000L
#define KVREF_MAX_THREADS 1024

struct kvref_worker {
    kvref_pool *pool;
    int index;                          /* 1 .. n_threads-1; the caller is 0 */
};

/* the claim word: tag (20 bits) | units in this batch (22 bits) | next unit (22 bits). The tag
 * changes with every batch; a stale compare-exchange would need a worker to stall across 2**20
 * batches and then find the identical word, which a runnable thread never does. */
#define CLAIM_BITS 22
#define CLAIM_MASK ((UINT64_C(1) << CLAIM_BITS) - 1)
#define CLAIM_BATCH ((int64_t)CLAIM_MASK)
#define TAG_MASK ((UINT64_C(1) << 20) - 1)

struct kvref_pool {
    int64_t n_threads;
    int32_t isa;
    const kvref_kernels *kernels;

    kvref_mutex call_lock;              /* held for the whole of one kernel call */
    kvref_mutex mu;                     /* guards sleeping on cv */
    kvref_cond cv;
    atomic_uint_fast64_t generation;    /* bumped to wake workers for a task (or to stop) */
    atomic_int sleepers;                /* workers blocked (or about to block) on cv */
    atomic_int stop;

    kvref_task_fn fn;                   /* the published task: written before the claim word */
    void *ctx;
    int64_t base;                       /* unit offset of the current batch */
    uint64_t tag;                       /* caller-private: tag of the current batch */
    atomic_uint_fast64_t claim;         /* tag | n | next unit, see above */
    atomic_int_fast64_t done;           /* units of the current batch finished */

    kvref_thread *threads;
    struct kvref_worker *workers;
    int n_started;

    void **scratch;                     /* [n_threads] per-thread buffers */
    size_t scratch_bytes;
    void *shared;
    size_t shared_bytes;
};

static inline void cpu_relax(void) {
#if KVREF_X86
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Claim and run units of the published batch until none is left. */
static void claim_units(kvref_pool *pool, int thread) {
    uint_fast64_t cur = atomic_load_explicit(&pool->claim, memory_order_acquire);
    for (;;) {
        const uint_fast64_t n = (cur >> CLAIM_BITS) & CLAIM_MASK, u = cur & CLAIM_MASK;
        if (u >= n) return;
        if (atomic_compare_exchange_weak_explicit(&pool->claim, &cur, cur + 1, memory_order_acq_rel,
                                                  memory_order_acquire)) {
            /* the batch cannot end before this unit is done: fn, ctx and base are stable */
            pool->fn(pool->ctx, pool->base + (int64_t)u, thread);
            atomic_fetch_add_explicit(&pool->done, 1, memory_order_release);
            cur = atomic_load_explicit(&pool->claim, memory_order_acquire);
        }
    }
}

static kvref_thread_result KVREF_THREAD_CALL worker_main(void *arg) {
    struct kvref_worker *w = arg;
    kvref_pool *pool = w->pool;
    uint_fast64_t seen = 0;
    for (;;) {
        uint_fast64_t g = atomic_load_explicit(&pool->generation, memory_order_acquire);
        if (g == seen) {
            int64_t deadline = kvref_now_ns() + KVREF_SPIN_NS;
            for (int i = 0;; i++) {
                cpu_relax();
                g = atomic_load_explicit(&pool->generation, memory_order_acquire);
                if (g != seen) break;
                if ((i & 255) == 255) {
                    if (kvref_now_ns() > deadline) break;
                    kvref_yield(); /* on a busy core, let the caller or another process run */
                }
            }
        }
        if (g == seen) {
            /* announce the sleep before the last look at generation: publish() bumps generation
             * before it reads sleepers (both sequentially consistent), so either this look sees
             * the new task or publish() sees a sleeper and broadcasts under mu */
            kvref_mutex_lock(&pool->mu);
            atomic_fetch_add(&pool->sleepers, 1);
            while ((g = atomic_load(&pool->generation)) == seen) kvref_cond_wait(&pool->cv, &pool->mu);
            atomic_fetch_sub(&pool->sleepers, 1);
            kvref_mutex_unlock(&pool->mu);
        }
        seen = g;
        if (atomic_load_explicit(&pool->stop, memory_order_acquire)) break;
        claim_units(pool, w->index);
    }
    return 0;
}

/* Wake the workers for a new task. Spinning workers see the generation change by themselves;
 * the mutex and broadcast are paid only when some worker sleeps (decode publishes a few hundred
 * tasks per token, back to back, while the workers spin). */
static void publish(kvref_pool *pool) {
    atomic_fetch_add(&pool->generation, 1);
    if (atomic_load(&pool->sleepers) > 0) {
        kvref_mutex_lock(&pool->mu);
        kvref_cond_broadcast(&pool->cv);
        kvref_mutex_unlock(&pool->mu);
    }
}

void kvref_pool_run(kvref_pool *pool, kvref_task_fn fn, void *ctx, int64_t n_units) {
    if (n_units <= 0) return;
    if (pool->n_started == 0 || n_units == 1) {
        for (int64_t u = 0; u < n_units; u++) fn(ctx, u, 0);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    for (int64_t base = 0; base < n_units; base += CLAIM_BATCH) {
        const int64_t n = n_units - base < CLAIM_BATCH ? n_units - base : CLAIM_BATCH;
        pool->base = base;
        pool->tag = (pool->tag + 1) & TAG_MASK;
        atomic_store_explicit(&pool->done, 0, memory_order_relaxed);
        atomic_store_explicit(&pool->claim, (pool->tag << (2 * CLAIM_BITS)) | ((uint_fast64_t)n << CLAIM_BITS),
                              memory_order_release);
        publish(pool);
        claim_units(pool, 0);
        /* wait only for units other threads claimed and are still running */
        for (int i = 0; atomic_load_explicit(&pool->done, memory_order_acquire) < n; i++) {
            cpu_relax();
            if ((i & 255) == 255) kvref_yield(); /* a worker holding a unit was descheduled */
        }
    }
}

/* ---- CPU detection (no cached globals: pools ask once, at creation) -------------------------- */

#if KVREF_X86
static int x86_has_avx2(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1;
    if (!(osxsave && avx && fma && f16c)) return 0;
    unsigned xlo, xhi;
    __asm__ __volatile__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    (void)xhi;
    if ((xlo & 0x6) != 0x6) return 0; /* the OS saves XMM and YMM state */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 5) & 1;
}

static int x86_has_avx512(void) {
    if (!x86_has_avx2()) return 0;
    unsigned a, b, c, d, xlo, xhi;
    __asm__ __volatile__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    (void)xhi;
    if ((xlo & 0xe6) != 0xe6) return 0; /* the OS saves opmask and ZMM state */
    __cpuid_count(7, 0, a, b, c, d);
    int f = (b >> 16) & 1, dq = (b >> 17) & 1, bw = (b >> 30) & 1, vl = (b >> 31) & 1;
    return f && dq && bw && vl;
}

static int x86_has_avx512vnni(void) {
    if (!x86_has_avx512()) return 0;
    unsigned a, b, c, d;
    __cpuid_count(7, 0, a, b, c, d);
    return (c >> 11) & 1;
}
#endif

#if KVREF_NEON_DOT
/* sdot and smmla as the OS reports them: the kernel's hardware capability bits (Linux), or the sysctl
 * feature flags (macOS); on other systems the plain NEON table runs. */
#if defined(__linux__)
#define ARM_HWCAP_ASIMDDP (1UL << 20)  /* <asm/hwcap.h>'s HWCAP_ASIMDDP, HWCAP2_I8MM (older headers lack it) */
#define ARM_HWCAP2_I8MM (1UL << 13)
static int arm_has_dotprod(void) { return (getauxval(AT_HWCAP) & ARM_HWCAP_ASIMDDP) != 0; }
static int arm_has_i8mm(void) { return arm_has_dotprod() && (getauxval(AT_HWCAP2) & ARM_HWCAP2_I8MM) != 0; }
#elif defined(__APPLE__)
static int arm_sysctl_flag(const char *name) {
    int value = 0;
    size_t size = sizeof value;
    return sysctlbyname(name, &value, &size, NULL, 0) == 0 && value != 0;
}
static int arm_has_dotprod(void) { return arm_sysctl_flag("hw.optional.arm.FEAT_DotProd"); }
static int arm_has_i8mm(void) { return arm_has_dotprod() && arm_sysctl_flag("hw.optional.arm.FEAT_I8MM"); }
#else
static int arm_has_dotprod(void) { return 0; }
static int arm_has_i8mm(void) { return 0; }
#endif
#endif

int32_t kvref_isa_supported(int32_t isa) {
    switch (isa) {
    case KVREF_ISA_AUTO:
    case KVREF_ISA_SCALAR:
        return 1;
#if KVREF_X86
    case KVREF_ISA_AVX2:
        return x86_has_avx2();
    case KVREF_ISA_AVX512:
        return x86_has_avx512();
#endif
#if KVREF_NEON
    case KVREF_ISA_NEON:
        return 1; /* part of every AArch64 CPU */
#endif
#if KVREF_NEON_DOT
    case KVREF_ISA_NEON_DOTPROD:
        return arm_has_dotprod();
    case KVREF_ISA_NEON_I8MM:
        return arm_has_i8mm();
#endif
    default:
        return 0;
    }
}

int32_t kvref_isa_best(void) {
    static const int32_t best_first[] = {KVREF_ISA_AVX512, KVREF_ISA_AVX2, KVREF_ISA_NEON_I8MM, KVREF_ISA_NEON_DOTPROD,
                                         KVREF_ISA_NEON};
    for (size_t i = 0; i < sizeof best_first / sizeof best_first[0]; i++)
        if (kvref_isa_supported(best_first[i])) return best_first[i];
    return KVREF_ISA_SCALAR;
}

static const kvref_kernels *kernels_for(int32_t isa) {
    switch (isa) {
#if KVREF_X86
    case KVREF_ISA_AVX512: return x86_has_avx512vnni() ? &kvref_kernels_avx512_vnni : &kvref_kernels_avx512;
    case KVREF_ISA_AVX2: return &kvref_kernels_avx2;
#endif
#if KVREF_NEON
    case KVREF_ISA_NEON: return &kvref_kernels_neon;
#endif
#if KVREF_NEON_DOT
    case KVREF_ISA_NEON_DOTPROD: return &kvref_kernels_neon_dotprod;
    case KVREF_ISA_NEON_I8MM: return &kvref_kernels_neon_i8mm;
#endif
    default: return &kvref_kernels_scalar;
    }
}

/* ---- pool lifetime ---------------------------------------------------------------------------- */

static void stop_workers(kvref_pool *pool) {
    if (pool->n_started > 0) {
        atomic_store_explicit(&pool->stop, 1, memory_order_release);
        publish(pool);
        for (int i = 0; i < pool->n_started; i++) kvref_thread_join(pool->threads[i]);
        pool->n_started = 0;
    }
}

static void free_pool(kvref_pool *pool) {
    if (pool->scratch) {
        for (int64_t i = 0; i < pool->n_threads; i++) kvref_aligned_free(pool->scratch[i]);
        free(pool->scratch);
    }
    kvref_aligned_free(pool->shared);
    free(pool->threads);
    free(pool->workers);
    kvref_cond_destroy(&pool->cv);
    kvref_mutex_destroy(&pool->mu);
    kvref_mutex_destroy(&pool->call_lock);
    free(pool);
}

int kvref_pool_create(int64_t n_threads, int32_t isa, kvref_pool **out) {
    if (out == NULL) return KVREF_ERR_NULL;
    *out = NULL;
    if (n_threads < 1 || n_threads > KVREF_MAX_THREADS) return KVREF_ERR_DIM;
    if (isa < KVREF_ISA_AUTO || isa > KVREF_ISA_NEON_I8MM) return KVREF_ERR_VALUE;
    if (!kvref_isa_supported(isa)) return KVREF_ERR_ISA;
    if (isa == KVREF_ISA_AUTO) isa = kvref_isa_best();

    kvref_pool *pool = calloc(1, sizeof *pool);
    if (pool == NULL) return KVREF_ERR_NOMEM;
    pool->n_threads = n_threads;
    pool->isa = isa;
    pool->kernels = kernels_for(isa);
    kvref_mutex_init(&pool->call_lock);
    kvref_mutex_init(&pool->mu);
    kvref_cond_init(&pool->cv);
    atomic_init(&pool->generation, 0);
    atomic_init(&pool->sleepers, 0);
    atomic_init(&pool->stop, 0);
    atomic_init(&pool->claim, 0);
    atomic_init(&pool->done, 0);

    pool->scratch = calloc((size_t)n_threads, sizeof(void *));
    pool->threads = calloc((size_t)n_threads, sizeof(kvref_thread));
    pool->workers = calloc((size_t)n_threads, sizeof(struct kvref_worker));
    if (pool->scratch == NULL || pool->threads == NULL || pool->workers == NULL) {
        free_pool(pool);
        return KVREF_ERR_NOMEM;
    }
    /* workers never take a signal (kvref_thread_start): a Ctrl-C reaches the thread that runs Python */
    int status = KVREF_OK;
    for (int i = 1; i < n_threads && status == KVREF_OK; i++) {
        pool->workers[i].pool = pool;
        pool->workers[i].index = i;
        if (kvref_thread_start(&pool->threads[pool->n_started], worker_main, &pool->workers[i]) != 0)
            status = KVREF_ERR_THREAD;
        else
            pool->n_started++;
    }
    if (status != KVREF_OK) {
        stop_workers(pool);
        free_pool(pool);
        return status;
    }
    *out = pool;
    return KVREF_OK;
}

void kvref_pool_destroy(kvref_pool *pool) {
    if (pool == NULL) return;
    kvref_mutex_lock(&pool->call_lock); /* let a running call finish */
    stop_workers(pool);
    kvref_mutex_unlock(&pool->call_lock);
    free_pool(pool);
}

int64_t kvref_pool_threads(const kvref_pool *pool) { return pool ? pool->n_threads : 0; }
int32_t kvref_pool_isa(const kvref_pool *pool) { return pool ? pool->isa : -1; }
const kvref_kernels *kvref_pool_kernels(const kvref_pool *pool) { return pool->kernels; }
void kvref_pool_lock(kvref_pool *pool) { kvref_mutex_lock(&pool->call_lock); }
void kvref_pool_unlock(kvref_pool *pool) { kvref_mutex_unlock(&pool->call_lock); }

static size_t round_up_64(size_t n) { return (n + 63) & ~(size_t)63; }

int kvref_pool_reserve(kvref_pool *pool, size_t nbytes) {
    nbytes = round_up_64(nbytes < 64 ? 64 : nbytes);
    if (nbytes <= pool->scratch_bytes) return KVREF_OK;
    for (int64_t i = 0; i < pool->n_threads; i++) {
        void *p = kvref_aligned_alloc(nbytes);
        if (p == NULL) return KVREF_ERR_NOMEM; /* buffers replaced so far are larger: still valid */
        kvref_aligned_free(pool->scratch[i]);
        pool->scratch[i] = p;
    }
    pool->scratch_bytes = nbytes;
    return KVREF_OK;
}

void *kvref_pool_scratch(kvref_pool *pool, int thread) { return pool->scratch[thread]; }

void *kvref_pool_shared(kvref_pool *pool, size_t nbytes) {
    nbytes = round_up_64(nbytes < 64 ? 64 : nbytes);
    if (nbytes > pool->shared_bytes) {
        void *p = kvref_aligned_alloc(nbytes);
        if (p == NULL) return NULL;
        kvref_aligned_free(pool->shared);
        pool->shared = p;
        pool->shared_bytes = nbytes;
    }
    return pool->shared;
}

/* ---- small queries ---------------------------------------------------------------------------- */

int64_t kvref_block_values(int32_t type) {
    switch (type) {
    case KVREF_TYPE_F32: case KVREF_TYPE_F16: case KVREF_TYPE_BF16: return 1;
    case KVREF_TYPE_Q4_0: case KVREF_TYPE_Q4_1: case KVREF_TYPE_Q5_0: case KVREF_TYPE_Q8_0: return 32;
    case KVREF_TYPE_MXFP4: return 32;
    case KVREF_TYPE_Q4_K: case KVREF_TYPE_Q6_K: return QK_K;
    default: return -1;
    }
}

static int64_t block_bytes(int32_t type) {
    switch (type) {
    case KVREF_TYPE_F32: return 4;
    case KVREF_TYPE_F16: case KVREF_TYPE_BF16: return 2;
    case KVREF_TYPE_Q4_0: return BYTES_Q4_0;
    case KVREF_TYPE_Q4_1: return BYTES_Q4_1;
    case KVREF_TYPE_Q5_0: return BYTES_Q5_0;
    case KVREF_TYPE_Q8_0: return BYTES_Q8_0;
    case KVREF_TYPE_Q4_K: return BYTES_Q4_K;
    case KVREF_TYPE_Q6_K: return BYTES_Q6_K;
    case KVREF_TYPE_MXFP4: return BYTES_MXFP4;
    default: return -1;
    }
}

int64_t kvref_row_nbytes(int32_t type, int64_t k) {
    int64_t bv = kvref_block_values(type);
    if (bv < 0 || k < 0 || k % bv != 0) return -1;
    if (k / bv > INT64_MAX / block_bytes(type)) return -1;
    return k / bv * block_bytes(type);
}

const char *kvref_status_string(int32_t status) {
    switch (status) {
    case KVREF_OK: return "ok";
    case KVREF_ERR_NULL: return "a required pointer is NULL";
    case KVREF_ERR_DIM: return "a dimension is negative or out of range";
    case KVREF_ERR_SHAPE: return "dimensions disagree with each other or with the block size";
    case KVREF_ERR_TYPE: return "tensor type not implemented by the native kernels";
    case KVREF_ERR_SIZE: return "byte count does not match the dimensions and type";
    case KVREF_ERR_NOMEM: return "out of memory for scratch buffers";
    case KVREF_ERR_THREAD: return "could not start a worker thread";
    case KVREF_ERR_ISA: return "instruction set not available on this CPU or build";
    case KVREF_ERR_VALUE: return "a scalar argument is out of range";
    case KVREF_ERR_INJECTED: return "injected failure (test hook)";
    default: return "unknown status";
    }
}
