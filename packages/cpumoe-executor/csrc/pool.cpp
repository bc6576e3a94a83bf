#include "pool.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <sched.h>

#include <chrono>
#include <climits>

#include "topology.h"

namespace cpumoe_exec {
namespace {
void futex_wait(std::atomic<uint32_t>* w, uint32_t v) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAIT_PRIVATE, v, nullptr, nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>* w) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}
int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

void spin_pause(unsigned i) {
  if ((i & 1023) == 1023) sched_yield();
  else cpu_relax();
}

Pool::Pool(const std::vector<int>& cores, bool pin, int64_t spin_us)
    : n_((int)std::max<size_t>(1, cores.size())), spin_us_(spin_us) {
  for (int t = 1; t < n_; ++t) threads_.emplace_back(&Pool::worker, this, t, cores[t], pin);
}

Pool::~Pool() {
  stop_.store(true, std::memory_order_seq_cst);
  gen_.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&gen_);
  for (auto& t : threads_) t.join();
}

void Pool::worker(int tid, int core, bool pin) {
  if (pin && pin_current_thread(core)) pinned_.fetch_add(1);
  uint32_t seen = 0;
  for (;;) {
    uint32_t g = gen_.load(std::memory_order_acquire);
    if (g == seen) {
      // Spin first (the next layer usually arrives within microseconds), then sleep.
      const int64_t until = now_us() + spin_us_;
      for (unsigned i = 0; (g = gen_.load(std::memory_order_acquire)) == seen; ++i) {
        spin_pause(i);
        if ((i & 255) == 255 && now_us() > until) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          if (gen_.load(std::memory_order_seq_cst) == seen) futex_wait(&gen_, seen);
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
      }
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    fn_(ctx_, tid);
    finished_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void Pool::run(Fn fn, void* ctx) {
  fn_ = fn;
  ctx_ = ctx;
  finished_.store(0, std::memory_order_relaxed);
  bar_count_.store(0, std::memory_order_relaxed);
  gen_.fetch_add(1, std::memory_order_seq_cst);  // publishes fn_/ctx_ (release)
  if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&gen_);
  fn(ctx, 0);
  for (unsigned i = 0; finished_.load(std::memory_order_acquire) < n_ - 1; ++i) spin_pause(i);
}

void Pool::barrier() {
  if (n_ == 1) return;
  const uint32_t g = bar_gen_.load(std::memory_order_acquire);
  if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
    bar_count_.store(0, std::memory_order_relaxed);
    bar_gen_.store(g + 1, std::memory_order_release);
  } else {
    for (unsigned i = 0; bar_gen_.load(std::memory_order_acquire) == g; ++i) spin_pause(i);
  }
}
}  // namespace cpumoe_exec
