/* The thread pool of workers/engines/embedded/rowgemm.c (included there; workers/engines/embedded/rowgemm.py compiles both). */
#ifndef ROWGEMM_POOL_H
#define ROWGEMM_POOL_H
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Work split across threads: projections by output columns, attention by query tiles (the
   callers in workers/engines/embedded/rowgemm.c keep each result one thread's arithmetic, so the split changes
   no bit of any result). The caller posts a job of `parts` ranges and claims parts itself, as
   do the helper threads: a helper that is slow to wake (asleep, or its core busy elsewhere)
   costs the job nothing but its help. Helpers spin a while between jobs (a forward posts ~30
   of them, microseconds apart), then sleep on a futex, so an idle worker's helpers use no CPU. */
#define MAX_THREADS 16
#ifndef SPIN_NS /* how long a helper spins for the next job before sleeping: longer than the
                   engine's Python work between two forwards (0.15-0.3 ms a step, bench.engine) */
#define SPIN_NS 1000000
#endif
#define MAX_PARTS (2 * MAX_THREADS) /* a job's parts at most (parts_for: 2 per thread) */
typedef void (*part_fn)(const void* ctx, int64_t part, int64_t parts);
typedef struct { part_fn fn; const void* ctx; int64_t parts; } job_t;
static job_t job;
static _Atomic uint64_t claim;     /* (job number << 32) | parts not yet claimed */
static _Atomic uint32_t job_seq;   /* the job number: helpers sleep on it */
static _Atomic int64_t parts_done;
static _Atomic int sleepers;
static atomic_flag posting = ATOMIC_FLAG_INIT;
static int pool_threads = 1;       /* threads a job uses, the caller's included */
static int helpers_started = 0;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Part `part` of `parts` of `units` work units, cut on multiples of `align`: [*lo, *hi). */
static void part_range(int64_t units, int64_t align, int64_t part, int64_t parts, int64_t* lo, int64_t* hi) {
  int64_t chunks = (units + align - 1) / align;
  *lo = chunks * part / parts * align;
  *hi = chunks * (part + 1) / parts * align;
  if (*hi > units) *hi = units;
}

/* Claims and runs parts of the current job until none is left unclaimed. */
static void help(void) {
  for (;;) {
    uint64_t c = atomic_load_explicit(&claim, memory_order_acquire);
    if ((uint32_t)c == 0) return;
    if (!atomic_compare_exchange_weak_explicit(&claim, &c, c - 1, memory_order_acquire, memory_order_relaxed))
      continue;
    /* Claimed: the caller does not post the next job before this part is done, so job is this one's. */
    job.fn(job.ctx, (int64_t)(uint32_t)c - 1, job.parts);
    atomic_fetch_add_explicit(&parts_done, 1, memory_order_release);
  }
}

static void* helper_main(void* arg) {
  (void)arg;
  uint32_t seen = atomic_load(&job_seq);
  for (;;) {
    uint32_t s = atomic_load_explicit(&job_seq, memory_order_acquire);
    if (s != seen) { seen = s; help(); continue; }
    int64_t until = now_ns() + SPIN_NS;
    int spins = 0;
    while (atomic_load_explicit(&job_seq, memory_order_acquire) == s) {
      _mm_pause();
      if (++spins % 64 == 0 && now_ns() > until) {
        atomic_fetch_add(&sleepers, 1);
        syscall(SYS_futex, &job_seq, FUTEX_WAIT_PRIVATE, s, NULL, NULL, 0);
        atomic_fetch_sub(&sleepers, 1);
      }
    }
  }
  return NULL;
}

/* Jobs (projections, attention) use n threads from now on (1: the caller alone). Returns the
   number in use. */
int rowgemm_set_threads(int n) {
  if (n < 1) n = 1;
  if (n > MAX_THREADS) n = MAX_THREADS;
  pthread_mutex_lock(&pool_lock);
  while (helpers_started < n - 1) {
    pthread_t t;
    if (pthread_create(&t, NULL, helper_main, NULL) != 0) break;
    pthread_detach(t);
    ++helpers_started;
  }
  pool_threads = helpers_started + 1 < n ? helpers_started + 1 : n;
  pthread_mutex_unlock(&pool_lock);
  return pool_threads;
}

/* fn(ctx, part, parts) for every part, on the pool's threads. */
static void parallel_for(part_fn fn, const void* ctx, int64_t parts) {
  if (parts > MAX_PARTS) parts = MAX_PARTS;
  /* One job at a time: a second thread calling meanwhile runs its parts alone. */
  if (pool_threads == 1 || parts < 2 || atomic_flag_test_and_set_explicit(&posting, memory_order_acquire)) {
    for (int64_t part = 0; part < parts; ++part) fn(ctx, part, parts);
    return;
  }
  job = (job_t){fn, ctx, parts};
  atomic_store_explicit(&parts_done, 0, memory_order_relaxed);
  /* The claims before the job number: a helper woken by the number finds the parts there. */
  uint32_t s = atomic_load_explicit(&job_seq, memory_order_relaxed) + 1;
  atomic_store_explicit(&claim, ((uint64_t)s << 32) | (uint64_t)parts, memory_order_release);
  atomic_store(&job_seq, s);
  if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &job_seq, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
  help();
  /* Parts a helper claimed are running on it: wait for them, yielding if it takes long
     (its core may be running something else). */
  int spins = 0;
  while (atomic_load_explicit(&parts_done, memory_order_acquire) < parts)
    if (++spins < 4096) _mm_pause(); else sched_yield();
  atomic_flag_clear_explicit(&posting, memory_order_release);
}

/* Parts finer than the threads: a helper that starts late leaves less behind. */
static int64_t parts_for(int64_t units) {
  int64_t parts = 2 * (int64_t)pool_threads;
  return parts < units ? parts : units;
}

#endif
