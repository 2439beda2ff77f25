#pragma once
// The kernels' threads: a fork-join region that never waits for a thread which has not started (pool.cpp says why).
#include <algorithm>
#include <atomic>
#include <cstdint>

namespace ps {

// A callable by reference: what a region runs on each of its threads.
class TaskRef {
 public:
  template <typename F>
  TaskRef(const F& f) : obj_(&f), call_([](const void* o) { (*static_cast<const F*>(o))(); }) {}  // NOLINT
  void operator()() const { call_(obj_); }

 private:
  const void* obj_;
  void (*call_)(const void*);
};

// Runs task() on the calling thread and on each of up to threads - 1 pool workers that joins before the caller's
// own task() returns, then returns once every thread that joined has finished. The task must share out its work
// as it goes (a ChunkQueue, an atomic counter): all of it may fall to the caller. Inside another region, or with
// threads <= 1, task() runs once, on the caller. An exception from any thread's task() is rethrown here.
void run_parallel(int64_t threads, TaskRef task);

// The threads a region may use: torch's setting (at::get_num_threads()).
int64_t kernel_threads();

// fn(b, e) over [begin, end) in chunks of at least `grain` (all of it on the caller when it is one grain or less),
// claimed as threads come: at::parallel_for's contract, on the pool.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t threads = std::min(kernel_threads(), (n + grain - 1) / grain);
  if (threads <= 1) {
    fn(begin, end);
    return;
  }
  // Chunks of a quarter of a thread's share (at least a grain): a thread that starts late takes fewer.
  const int64_t chunk = std::max(grain, n / (4 * threads));
  std::atomic<int64_t> next{begin};
  run_parallel(threads, [&] {
    for (int64_t b; (b = next.fetch_add(chunk, std::memory_order_relaxed)) < end;) fn(b, std::min(end, b + chunk));
  });
}

}  // namespace ps
