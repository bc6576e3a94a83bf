// Worker pool: N threads including the caller (tid 0). Pool threads are pinned,
// spin on a generation word for a while after each task (decode steps come
// back to back), then sleep on a futex so an idle engine burns no core. While
// the pool is "hot" (the doorbell coordinator's spin window) the workers the
// steps use keep spinning, so a doorbell never pays a futex wake; a worker left
// out of 64 runs in a row (team sizing) sleeps anyway.
//
// A run names its team: workers 1..team-1 join it, the others ignore it. The
// team size and the run's sequence number share one 32-bit word (the futex
// word), so a worker never pairs one run's number with another run's team.
// A pool may have no caller (one NUMA group of several): launch() starts its
// workers and returns at once; tid 0 is then nobody.
// A pool on the host's OpenMP team (omp_team.h) starts no thread: a run is one
// OpenMP parallel region of the team size, the caller its thread 0. A region
// ends only when every team thread has run, so one whose thread came late (its
// core taken by other work) makes the next kSoloAfterLate start()s the caller's
// alone: a loaded machine costs one late region per that many steps, not one
// per step (2-core VM at load 3.5-5, full-size Qwen3-30B q4_0: 4-8 ms a step
// waiting for the team every time, against 1.3-1.5 ms on a pool of our own).
// So on a team start() may run fn on fewer threads than asked (the caller
// alone, or what the runtime gives): its fn must claim work dynamically, as the
// step does. run() runs fn once for every tid (work split by tid): the caller
// runs the tids the runtime did not give.
#pragma once
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "omp_team.h"

namespace cpumoe_exec {

class Pool {
 public:
  using Fn = void (*)(void* ctx, int tid);
  static constexpr int kMaxThreads = 4095;  // the team field of the generation word
  static constexpr int kUnusedAfter = 64;   // left out of this many runs in a row: not kept hot
  static constexpr int kSoloAfterLate = 32; // OpenMP team: caller-alone start()s after a late team thread
  // cores[0] is the caller's (coordinator's) core (unused by a pool that is only launched); pool thread i pins to
  // cores[i].
  // omp: run on the host's OpenMP team instead of threads of our own (size() = cores.size(), nothing pinned; no
  // launch()).
  Pool(const std::vector<int>& cores, bool pin, int64_t spin_us, const OmpTeam* omp = nullptr);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int size() const { return n_; }
  // Runs fn(ctx, tid) once for each tid in [0, team) (team clamped to [1, size()]), the caller's tid 0; returns
  // when all of them are done.
  void run(Fn fn, void* ctx, int team = kMaxThreads);
  // Same, but returns as soon as the caller's fn(ctx, 0) returns: fn must itself wait for
  // the work the caller needs. Workers may still be inside fn; quiesce() waits for them and
  // must precede any change to what fn reads (the next start() calls it first). On an OpenMP
  // team it returns after the region (nothing left for quiesce()), and tids 1..team-1 may not
  // run at all: fn must claim its work dynamically.
  void start(Fn fn, void* ctx, int team);
  // Runs fn(ctx, tid) on workers 1..team-1 (team clamped to [2, size()]) and returns at once: the caller takes no
  // part (a pool of a NUMA group the caller is not in). Nothing runs where size() < 2. quiesce() waits for them.
  void launch(Fn fn, void* ctx, int team);
  // Waits until every worker of the last run has left fn.
  void quiesce();
  // Waits for the last run, then ends and joins every worker; idempotent. No run may start afterwards.
  void stop();
  // In a forked child: the workers are the parent's and do not exist here, so they are neither waited for nor
  // joined; their thread objects are leaked (joining one would block forever, destroying a joinable one aborts).
  void abandon();
  // While hot, idle workers spin instead of sleeping after spin_us.
  void set_hot(bool hot) { hot_.store(hot, std::memory_order_relaxed); }
  int pinned() const { return pinned_.load(); }
  // Workers asleep on the futex now (health and tests).
  int sleepers() const { return sleepers_.load(std::memory_order_acquire); }

 private:
  void worker(int tid, int core, bool pin);
  // Hands fn/ctx to workers 1..team-1 (team >= 2) after the last run's workers left fn.
  void publish(Fn fn, void* ctx, int team);
  int n_;
  int64_t spin_us_;
  const OmpTeam* omp_ = nullptr;
  int solo_left_ = 0;  // OpenMP team: start()s left for the caller alone (caller-only: under the executor's
                       // step lock, like expect_)
  std::vector<std::thread> threads_;
  bool stopped_ = false;  // caller-only, like expect_
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  int expect_ = 0;  // workers in the last run (caller-only)
  alignas(64) std::atomic<uint32_t> gen_{0};  // run sequence << 12 | team
  alignas(64) std::atomic<int> sleepers_{0};
  alignas(64) std::atomic<int> finished_{0};
  alignas(64) std::atomic<bool> hot_{false};
  std::atomic<uint32_t> solo_{0};  // runs of the caller alone (team 1)
  std::atomic<bool> stop_{false};
  std::atomic<int> pinned_{0};
};

// Spin-wait step: pause, and yield the core every 1024 spins (tens of microseconds:
// never on a hot path) so waiters do not starve the thread they wait for when
// threads outnumber cores.
void spin_pause(unsigned i);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until c >= target (acquire).
inline void wait_at_least(const std::atomic<int>& c, int target) {
  for (unsigned i = 0; c.load(std::memory_order_acquire) < target; ++i) spin_pause(i);
}
}  // namespace cpumoe_exec
