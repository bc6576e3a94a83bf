// Worker pool: N threads including the caller (tid 0). Pool threads are pinned,
// spin on a generation word for a while after each task (decode steps come
// back to back), then sleep on a futex so an idle engine burns no core.
#pragma once
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace cpumoe_exec {

class Pool {
 public:
  using Fn = void (*)(void* ctx, int tid);
  // cores[0] is the caller's (coordinator's) core; pool thread i pins to cores[i].
  Pool(const std::vector<int>& cores, bool pin, int64_t spin_us);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int size() const { return n_; }
  // Runs fn(ctx, tid) on every thread, the caller as tid 0; returns when all are done.
  void run(Fn fn, void* ctx);
  // Spin barrier across all n threads of the current run.
  void barrier();
  int pinned() const { return pinned_.load(); }

 private:
  void worker(int tid, int core, bool pin);
  int n_;
  int64_t spin_us_;
  std::vector<std::thread> threads_;
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  alignas(64) std::atomic<uint32_t> gen_{0};
  alignas(64) std::atomic<int> sleepers_{0};
  alignas(64) std::atomic<int> finished_{0};
  alignas(64) std::atomic<int> bar_count_{0};
  alignas(64) std::atomic<uint32_t> bar_gen_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> pinned_{0};
};

// Spin-wait step: pause, and yield the core every 1024 spins so waiters do not
// starve the thread they wait for when threads outnumber cores.
void spin_pause(unsigned i);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}
}  // namespace cpumoe_exec
