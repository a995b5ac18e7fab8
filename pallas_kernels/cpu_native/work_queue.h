// Work shared by the calling thread and the helper tasks of XLA's thread pool, for the native kernels.
//
//   struct State { WorkQueue work; ...; void Drain(); };   // Drain: claim items until none is left, Finish each
//   auto state = std::make_shared<State>(); state->work.total = n; ...
//   RunOnPool(pool, state);                                 // returns once every item is done
//
// Items are claimed from `next`; the caller returns once every item is `done`. A helper that starts late finds
// nothing to claim and touches no buffer, so it may outlive the call: it holds the state by shared_ptr, and the
// state holds copies of everything it reads.
#ifndef JAXPAGED_CPU_NATIVE_WORK_QUEUE_H_
#define JAXPAGED_CPU_NATIVE_WORK_QUEUE_H_

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxpaged_native {

constexpr int kSpinBeforeWait = 5000;  // pause instructions: ~100 microseconds at most

// A spin-wait hint to the core (x86 PAUSE, Arm YIELD); nothing elsewhere.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__) || defined(__arm__)
  asm volatile("yield" ::: "memory");
#endif
}

struct WorkQueue {
  int64_t total = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;

  int64_t Claim() { return next.fetch_add(1); }  // an item index; >= total: nothing left

  void Finish() {  // one claimed item is done
    if (done.fetch_add(1) + 1 == total) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
};

// state->Drain() on the caller and on up to num_threads() - 1 helpers of XLA's pool (num_threads() may be 0: no
// pool); returns once all state->work.total items are done.
template <typename State>
void RunOnPool(xla::ffi::ThreadPool& pool, const std::shared_ptr<State>& state) {
  WorkQueue& work = state->work;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t helpers = std::min(threads, work.total) - 1;
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([state]() { state->Drain(); });
  state->Drain();
  // The helpers' last items usually end within microseconds: spin on them a while before sleeping (a futex wait and
  // its wake-up cost more than that).
  for (int spin = 0; spin < kSpinBeforeWait && work.done.load(std::memory_order_acquire) != work.total; ++spin)
    CpuRelax();
  std::unique_lock<std::mutex> lock(work.mu);
  work.cv.wait(lock, [&] { return work.done.load() == work.total; });
}

// Claims items until none is left: range(lo, hi) on each claimed item's units [lo, hi) of `units` (`per_item` units
// an item, the last one fewer), then finishes the item. A State's Drain() is usually this one call.
template <typename Range>
void DrainRanges(WorkQueue& work, int64_t units, int64_t per_item, Range&& range) {
  for (int64_t i = work.Claim(); i < work.total; i = work.Claim()) {
    range(i * per_item, std::min(units, (i + 1) * per_item));
    work.Finish();
  }
}

// Items of `per_item` units out of `units` (rows, tokens, elements): all of them as one item, on the caller alone,
// when there are fewer than `parallel_from` units (a pool's helpers cost more than such small work), else
// ceil(units / per_item) items shared as RunOnPool shares them. state->Drain() reads state->per_item.
template <typename State>
void RunUnits(xla::ffi::ThreadPool& pool, const std::shared_ptr<State>& state, int64_t units, int64_t per_item,
              int64_t parallel_from) {
  state->per_item = units < parallel_from ? std::max<int64_t>(units, 1) : per_item;
  state->work.total = (units + state->per_item - 1) / state->per_item;
  if (state->work.total > 0) RunOnPool(pool, state);
}

}  // namespace jaxpaged_native

#endif  // JAXPAGED_CPU_NATIVE_WORK_QUEUE_H_
