// The kernels' thread pool. An OpenMP region ends in a barrier that waits for every thread of its team, and a
// statically split one for each thread's share: where another process (a served engine's gateway, the load
// generator) holds a core when a region starts, the region waits until the OS schedules its thread there, which on
// a busy 2-core machine took milliseconds per region (a 43 us RMSNorm took 6.5 ms on two threads). Here a region is
// open to workers only until the calling thread has done what it could: the work is claimed as threads come, so a
// worker that is not running simply does none, and finds the region closed when it wakes.
//
// Workers spin for a moment after a region (the next one of a step usually follows within microseconds), then
// sleep on a futex. The spin yields the core every few microseconds, so that a process waiting to run there (a
// served engine's gateway, the load generator) runs instead of the spin. A forked child starts its own workers on
// first use.

#include "pool.h"

#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <exception>
#include <mutex>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define PS_PAUSE() _mm_pause()
#else
#define PS_PAUSE() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace ps {
namespace {

constexpr uint64_t kClosed = uint64_t(1) << 31;
constexpr auto kSpin = std::chrono::microseconds(100);  // how long a worker polls before it sleeps

thread_local bool in_region = false;

void futex_wait(std::atomic<uint32_t>* addr, uint32_t seen) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

struct Pool {
  // generation << 32 | closed bit | threads joined: one word, so that joining and closing cannot interleave.
  alignas(64) std::atomic<uint64_t> state{0};
  alignas(64) std::atomic<uint32_t> generation{0};  // the futex word (the state's upper half)
  std::atomic<int32_t> sleepers{0};
  alignas(64) std::atomic<int64_t> finished{0};
  std::atomic<bool> busy{false};  // a region is running (started by any thread)
  const TaskRef* task = nullptr;
  std::atomic<int64_t> max_join{0};
  std::exception_ptr error;
  std::mutex error_mutex;
  int64_t workers = 0;  // started; read and written while `busy` is held

  void work(uint32_t gen) {
    uint64_t s = state.load(std::memory_order_acquire);
    for (;;) {
      if ((s >> 32) != gen || (s & kClosed) || int64_t(s & (kClosed - 1)) >= max_join.load(std::memory_order_relaxed))
        return;
      if (state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) break;
    }
    in_region = true;
    try {
      (*task)();
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
    in_region = false;
    finished.fetch_add(1, std::memory_order_release);
  }

  void worker_loop() {
    uint32_t seen = generation.load(std::memory_order_acquire);
    for (;;) {
      uint32_t gen = generation.load(std::memory_order_acquire);
      if (gen == seen) {
        const auto until = std::chrono::steady_clock::now() + kSpin;
        for (int i = 0; (gen = generation.load(std::memory_order_acquire)) == seen; ++i) {
          PS_PAUSE();
          if (i % 64 == 31) sched_yield();
          if (i % 64 == 63 && std::chrono::steady_clock::now() > until) {
            sleepers.fetch_add(1, std::memory_order_seq_cst);
            if ((gen = generation.load(std::memory_order_seq_cst)) == seen) futex_wait(&generation, seen);
            sleepers.fetch_sub(1, std::memory_order_relaxed);
          }
        }
      }
      seen = gen;
      work(gen);
    }
  }

  void start_workers(int64_t n) {
    for (; workers < n; ++workers) {
      pthread_t t;
      pthread_create(&t, nullptr, [](void* p) -> void* { static_cast<Pool*>(p)->worker_loop(); return nullptr; },
                     this);
      pthread_detach(t);
    }
  }

  // Only one thread at a time starts regions; the others (another engine in the process, a test's thread) run
  // theirs alone on their own thread.
  void run(int64_t threads, const TaskRef& fn) {
    if (busy.exchange(true, std::memory_order_acquire)) {
      in_region = true;
      struct Reset { ~Reset() { in_region = false; } } reset;
      fn();
      return;
    }
    struct Release { std::atomic<bool>& b; ~Release() { b.store(false, std::memory_order_release); } } release{busy};
    start_workers(threads - 1);
    task = &fn;
    max_join.store(threads - 1, std::memory_order_relaxed);
    finished.store(0, std::memory_order_relaxed);
    const uint32_t gen = generation.load(std::memory_order_relaxed) + 1;
    state.store(uint64_t(gen) << 32, std::memory_order_release);
    generation.store(gen, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&generation);
    in_region = true;
    std::exception_ptr own;
    try {
      fn();
    } catch (...) {
      own = std::current_exception();
    }
    in_region = false;
    const int64_t joined = int64_t(state.fetch_or(kClosed, std::memory_order_acq_rel) & (kClosed - 1));
    while (finished.load(std::memory_order_acquire) < joined) PS_PAUSE();
    std::exception_ptr theirs;
    std::swap(theirs, error);  // cleared for the next region, whichever is rethrown
    if (own) std::rethrow_exception(own);
    if (theirs) std::rethrow_exception(theirs);
  }
};

// Leaked on purpose: workers outlive static destruction at exit. A forked child gets a fresh one (its parent's
// workers do not exist there).
Pool* pool = nullptr;
std::once_flag atfork_once;

Pool& the_pool() {
  std::call_once(atfork_once, [] { pthread_atfork(nullptr, nullptr, [] { pool = nullptr; }); });
  if (pool == nullptr) pool = new Pool();
  return *pool;
}

}  // namespace

int64_t kernel_threads() { return at::get_num_threads(); }

void run_parallel(int64_t threads, TaskRef task) {
  if (threads <= 1 || in_region) {
    task();
    return;
  }
  the_pool().run(threads, task);
}

}  // namespace ps
