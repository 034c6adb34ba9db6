/* platform.h: what the C core asks of the operating system, on POSIX (Linux, macOS) and on Windows:
 * worker threads, a mutex and a condition variable, a yield, a monotonic clock and 64-byte aligned
 * memory. Only pool.c, forward.c and moe.c include it; the kernels never touch the operating system.
 *
 * Windows has no pthreads in its C runtime (mingw-w64's winpthreads would add a DLL to every wheel) and
 * no threads.h in mingw-w64, so the pool runs on the Win32 primitives themselves: slim reader/writer
 * locks, condition variables and CreateThread. aligned_alloc is missing from Microsoft's C runtime, whose
 * free() cannot release _aligned_malloc's blocks: memory from kvref_aligned_alloc goes back through
 * kvref_aligned_free, on every platform alike.
 */
#ifndef KVREF_PLATFORM_H
#define KVREF_PLATFORM_H

#include <stdint.h>
#include <stdlib.h>

#ifdef _WIN32
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <malloc.h>
#include <windows.h>
#else
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#endif

/* nbytes (rounded up to a multiple of 64, as aligned_alloc wants) at a 64-byte boundary, or NULL */
static inline void *kvref_aligned_alloc(size_t nbytes) {
    nbytes = (nbytes + 63) & ~(size_t)63;
#ifdef _WIN32
    return _aligned_malloc(nbytes ? nbytes : 64, 64);
#else
    return aligned_alloc(64, nbytes ? nbytes : 64);
#endif
}

static inline void kvref_aligned_free(void *p) {
#ifdef _WIN32
    _aligned_free(p);
#else
    free(p);
#endif
}

/* nanoseconds of a monotonic clock (differences only) */
static inline int64_t kvref_now_ns(void) {
#ifdef _WIN32
    LARGE_INTEGER count, freq;
    QueryPerformanceCounter(&count);
    QueryPerformanceFrequency(&freq);
    /* whole seconds and the rest apart: count * 1e9 alone overflows after ~2.5 hours at 1 GHz */
    return count.QuadPart / freq.QuadPart * 1000000000 + count.QuadPart % freq.QuadPart * 1000000000 / freq.QuadPart;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
#endif
}

/* let another runnable thread have this core */
static inline void kvref_yield(void) {
#ifdef _WIN32
    SwitchToThread();
#else
    sched_yield();
#endif
}

/* ---- a mutex and a condition variable ------------------------------------------------------- */

#ifdef _WIN32
typedef SRWLOCK kvref_mutex;
typedef CONDITION_VARIABLE kvref_cond;
static inline void kvref_mutex_init(kvref_mutex *m) { InitializeSRWLock(m); }
static inline void kvref_mutex_destroy(kvref_mutex *m) { (void)m; } /* SRW locks and condition variables hold no resources */
static inline void kvref_mutex_lock(kvref_mutex *m) { AcquireSRWLockExclusive(m); }
static inline void kvref_mutex_unlock(kvref_mutex *m) { ReleaseSRWLockExclusive(m); }
static inline void kvref_cond_init(kvref_cond *c) { InitializeConditionVariable(c); }
static inline void kvref_cond_destroy(kvref_cond *c) { (void)c; }
static inline void kvref_cond_wait(kvref_cond *c, kvref_mutex *m) { SleepConditionVariableSRW(c, m, INFINITE, 0); }
static inline void kvref_cond_broadcast(kvref_cond *c) { WakeAllConditionVariable(c); }
#else
typedef pthread_mutex_t kvref_mutex;
typedef pthread_cond_t kvref_cond;
static inline void kvref_mutex_init(kvref_mutex *m) { pthread_mutex_init(m, NULL); }
static inline void kvref_mutex_destroy(kvref_mutex *m) { pthread_mutex_destroy(m); }
static inline void kvref_mutex_lock(kvref_mutex *m) { pthread_mutex_lock(m); }
static inline void kvref_mutex_unlock(kvref_mutex *m) { pthread_mutex_unlock(m); }
static inline void kvref_cond_init(kvref_cond *c) { pthread_cond_init(c, NULL); }
static inline void kvref_cond_destroy(kvref_cond *c) { pthread_cond_destroy(c); }
static inline void kvref_cond_wait(kvref_cond *c, kvref_mutex *m) { pthread_cond_wait(c, m); }
static inline void kvref_cond_broadcast(kvref_cond *c) { pthread_cond_broadcast(c); }
#endif

/* ---- threads ------------------------------------------------------------------------------------- */

/* A thread's entry point is written `static kvref_thread_result KVREF_THREAD_CALL f(void *arg)` and
 * returns 0: the two systems' signatures differ in their return type and calling convention. */
#ifdef _WIN32
typedef HANDLE kvref_thread;
typedef DWORD kvref_thread_result;
#define KVREF_THREAD_CALL WINAPI
#else
typedef pthread_t kvref_thread;
typedef void *kvref_thread_result;
#define KVREF_THREAD_CALL
#endif
typedef kvref_thread_result(KVREF_THREAD_CALL *kvref_thread_fn)(void *arg);

/* Start fn(arg) on a new thread; 0 on success. On POSIX the thread blocks every signal: a Ctrl-C must
 * reach the thread that runs Python, whose blocking read (input(), a pipe) it interrupts; delivered to
 * a worker, it would only set Python's flag while the main thread slept on. Windows delivers Ctrl-C
 * to a console handler on a thread of its own, never to a worker, so there is nothing to block. */
static inline int kvref_thread_start(kvref_thread *t, kvref_thread_fn fn, void *arg) {
#ifdef _WIN32
    *t = CreateThread(NULL, 0, fn, arg, 0, NULL);
    return *t == NULL;
#else
    sigset_t all, caller;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &caller); /* the new thread inherits the mask it is created with */
    const int status = pthread_create(t, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &caller, NULL);
    return status != 0;
#endif
}

/* Wait for a started thread to return, and release it. */
static inline void kvref_thread_join(kvref_thread t) {
#ifdef _WIN32
    WaitForSingleObject(t, INFINITE);
    CloseHandle(t);
#else
    pthread_join(t, NULL);
#endif
}

#endif /* KVREF_PLATFORM_H */
