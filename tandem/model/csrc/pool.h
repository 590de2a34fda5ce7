/* A persistent thread pool for one forward pass at a time, and the barrier between its phases.

   Workers spin briefly after a job, so that the next one (a step is a few ms of Python later at
   most) starts without a wake-up; then they sleep on a futex, so that an idle service takes no
   core from a busy one. Barriers spin without PAUSE (under KVM it measured 7% slower per step,
   likely pause-loop exits), then yield, so that an oversubscribed box still progresses. */
#ifndef TANDEM_POOL_H
#define TANDEM_POOL_H

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 256
#define IDLE_SPIN_NS 200000   /* a worker spins this long for the next job before it sleeps */
#define BARRIER_SPINS 4096    /* then sched_yield between checks */

typedef void (*job_fn)(void* arg, int tid, int num_threads);

typedef struct {
    _Atomic int count;
    _Atomic int sense;
} Barrier;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Everyone waits here until all num_threads threads have arrived. `local_sense` is per thread. */
static void barrier_wait(Barrier* b, int num_threads, int* local_sense) {
    if (num_threads == 1) return;
    *local_sense = !*local_sense;
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == num_threads - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_store_explicit(&b->sense, *local_sense, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->sense, memory_order_acquire) != *local_sense; spins++)
        if (spins >= BARRIER_SPINS) sched_yield();
}

static struct {
    pthread_mutex_t call_lock;      /* one job at a time, whoever calls */
    int num_workers;
    pthread_t workers[MAX_THREADS];
    _Atomic uint32_t generation;    /* bumped to start a job; the futex word */
    _Atomic int sleeping;
    _Atomic int finished;
    uint32_t created_at[MAX_THREADS]; /* the generation each worker was created in */
    job_fn fn;
    void* arg;
    int num_threads;                /* of the current job, the caller included */
} pool = {.call_lock = PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static uint32_t wait_for_job(uint32_t seen) {
    int64_t spin_until = now_ns() + IDLE_SPIN_NS;
    for (int spins = 0;; spins++) {
        uint32_t generation = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (generation != seen) return generation;
        if (spins % 64 != 63 || now_ns() < spin_until) {
            cpu_relax();
            continue;
        }
        atomic_fetch_add(&pool.sleeping, 1);
        syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        atomic_fetch_sub(&pool.sleeping, 1);
        spin_until = now_ns() + IDLE_SPIN_NS;
    }
}

static void* worker_main(void* arg) {
    int tid = (int)(intptr_t)arg;
    uint32_t seen = pool.created_at[tid];  /* not a fresh load: the job that created it may have begun */
    for (;;) {
        seen = wait_for_job(seen);
        if (tid < pool.num_threads) {
            pool.fn(pool.arg, tid, pool.num_threads);
            atomic_fetch_add_explicit(&pool.finished, 1, memory_order_release);
        }
    }
    return NULL;
}

/* Runs fn(arg, tid, num_threads) on num_threads threads, the caller being tid 0. */
static int pool_run(job_fn fn, void* arg, int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
    pthread_mutex_lock(&pool.call_lock);
    while (pool.num_workers < num_threads - 1) {
        int tid = pool.num_workers + 1;
        pool.created_at[tid] = atomic_load(&pool.generation);
        if (pthread_create(&pool.workers[pool.num_workers], NULL, worker_main, (void*)(intptr_t)tid) != 0) break;
        pthread_detach(pool.workers[pool.num_workers]);
        pool.num_workers++;
    }
    if (num_threads > pool.num_workers + 1) num_threads = pool.num_workers + 1;
    pool.fn = fn;
    pool.arg = arg;
    pool.num_threads = num_threads;
    atomic_store_explicit(&pool.finished, 0, memory_order_relaxed);
    if (num_threads > 1) {
        atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
        if (atomic_load(&pool.sleeping) > 0)
            syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
    }
    fn(arg, 0, num_threads);
    for (int spins = 0; atomic_load_explicit(&pool.finished, memory_order_acquire) < num_threads - 1; spins++) {
        if (spins < BARRIER_SPINS) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool.call_lock);
    return num_threads;
}

/* [begin, end) of n items for thread tid of num_threads, in contiguous even shares. */
static inline void share(int n, int tid, int num_threads, int* begin, int* end) {
    *begin = (int)((int64_t)n * tid / num_threads);
    *end = (int)((int64_t)n * (tid + 1) / num_threads);
}

#endif
