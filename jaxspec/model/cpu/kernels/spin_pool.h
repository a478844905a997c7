// Helper threads shared by jaxspec's CPU kernels (few_row_matmul.cc, cached_attention.cc):
// one pool per process, whichever kernel calls first.
#ifndef JAXSPEC_KERNELS_SPIN_POOL_H_
#define JAXSPEC_KERNELS_SPIN_POOL_H_

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxspec_kernels {

// ---- Helper threads that stay awake between calls ----
// A decode step makes ~55 of these calls, 5-40 us each, a few microseconds apart; a pool
// thread woken per call (XLA's intra-op pool) starts late, so the calling thread ended
// up computing most parts alone. SpinPool's helpers poll for the next call for kSpin
// after each one (yielding the core to any other runnable thread while they poll), then
// sleep on a condition variable until woken. One caller at a time: a call that finds
// the helpers busy with another caller runs all its parts itself.
class SpinPool {
 public:
  static constexpr auto kSpin = std::chrono::microseconds(200);

  explicit SpinPool(int helpers) {
    for (int h = 0; h < helpers; ++h) std::thread([this] { Serve(); }).detach();
    num_helpers_ = helpers;
  }

  int num_helpers() const { return num_helpers_; }

  // Runs part(p) for p in [0, num_parts) on the calling thread and the helpers; returns
  // after every part has finished.
  void Run(int64_t num_parts, const std::function<void(int64_t)>& part) {
    bool idle = false;
    if (num_helpers_ == 0 || num_parts < 2 ||
        !busy_.compare_exchange_strong(idle, true, std::memory_order_acquire)) {
      for (int64_t p = 0; p < num_parts; ++p) part(p);
      return;
    }
    const uint64_t job = generation_.load(std::memory_order_relaxed) + 1;
    part_ = &part;
    num_parts_ = num_parts;
    done_.store(0, std::memory_order_relaxed);
    next_.store(job << 32, std::memory_order_release);
    generation_.store(job, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    Work(job);
    while (done_.load(std::memory_order_acquire) < num_parts) _mm_pause();
    busy_.store(false, std::memory_order_release);
  }

 private:
  // Claims and runs parts of job `job` until none is left; a part is claimed together
  // with its job number, so a helper late for one job never takes a part of the next.
  void Work(uint64_t job) {
    uint64_t claim = next_.load(std::memory_order_acquire);
    while ((claim >> 32) == job) {
      const int64_t p = static_cast<int64_t>(claim & 0xffffffffu);
      if (p >= num_parts_) return;
      if (next_.compare_exchange_weak(claim, claim + 1, std::memory_order_acq_rel)) {
        (*part_)(p);
        done_.fetch_add(1, std::memory_order_release);
        claim = next_.load(std::memory_order_acquire);
      }
    }
  }

  void Serve() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    for (;;) {
      auto since = std::chrono::steady_clock::now();
      uint64_t job;
      for (int polls = 0; (job = generation_.load(std::memory_order_acquire)) == seen; ++polls) {
        if (polls % 64 == 63) {
          if (std::chrono::steady_clock::now() - since > kSpin) {
            std::unique_lock<std::mutex> lock(mutex_);
            sleeping_.fetch_add(1, std::memory_order_seq_cst);
            wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
            sleeping_.fetch_sub(1, std::memory_order_relaxed);
            since = std::chrono::steady_clock::now();
          } else {
            sched_yield();
          }
        }
        _mm_pause();
      }
      seen = job;
      Work(job);
    }
  }

  int num_helpers_ = 0;
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> next_{0};  // job << 32 | next part
  std::atomic<int64_t> done_{0};
  const std::function<void(int64_t)>* part_ = nullptr;
  int64_t num_parts_ = 0;
  std::atomic<int> sleeping_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
};

inline constexpr int kMaxHelpers = 3;  // A few-row product saturates memory with a few cores.

// A forked child has none of its parent's helper threads: it runs every part itself.
inline std::atomic<bool> forked{false};

inline SpinPool& Helpers(const xla::ffi::ThreadPool& pool) {
  static SpinPool* helpers = [&] {  // Never destroyed: helpers outlive calls.
    pthread_atfork(nullptr, nullptr, [] { forked.store(true); });
    return new SpinPool(static_cast<int>(
        std::max<int64_t>(0, std::min<int64_t>(kMaxHelpers, pool.num_threads() - 1))));
  }();
  static SpinPool* inline_only = new SpinPool(0);
  return forked.load(std::memory_order_relaxed) ? *inline_only : *helpers;
}

}  // namespace jaxspec_kernels

#endif  // JAXSPEC_KERNELS_SPIN_POOL_H_
