#include "pool.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <sched.h>

#include <algorithm>
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

Pool::Pool(const std::vector<int>& cores, bool pin, int64_t spin_us, const OmpTeam* omp)
    : n_((int)std::min<size_t>(kMaxThreads, std::max<size_t>(1, cores.size()))), spin_us_(spin_us), omp_(omp) {
  if (omp_) return;  // the OpenMP team's threads run the steps
  for (int t = 1; t < n_; ++t) threads_.emplace_back(&Pool::worker, this, t, cores[t], pin);
}

Pool::~Pool() { stop(); }

void Pool::stop() {
  if (stopped_) return;
  stopped_ = true;
  quiesce();
  stop_.store(true, std::memory_order_seq_cst);
  const uint32_t g = gen_.load(std::memory_order_relaxed);
  gen_.store(((g >> 12) + 1) << 12, std::memory_order_seq_cst);  // team 0: nobody runs, everybody sees stop_
  futex_wake_all(&gen_);
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void Pool::abandon() {
  stopped_ = true;
  (void)new std::vector<std::thread>(std::move(threads_));  // leaked on purpose: see pool.h
  threads_.clear();
}

void Pool::worker(int tid, int core, bool pin) {
  if (pin && pin_current_thread(core)) pinned_.fetch_add(1);
  uint32_t seen = 0;  // gen_'s initial value: a run started before this line is not missed
  int64_t until = now_us() + spin_us_;
  // Runs in a row this worker was left out of (team sizing): one the steps do not use is not
  // kept hot. Starts "unused" until it takes part in a run.
  int skipped = kUnusedAfter;
  uint32_t solo_at = 0;  // solo_ (caller-alone runs, which do not touch gen_) when we last ran
  for (;;) {
    uint32_t g;
    // Spin first (the next layer usually arrives within microseconds; while the pool is hot and
    // this worker is in use, for as long as the coordinator spins), then sleep. One clock read
    // per 256 spins, none per task.
    bool late = false;  // past our own spin: only the coordinator's window keeps us spinning
    for (unsigned i = 0; (g = gen_.load(std::memory_order_acquire)) == seen; ++i) {
      if (late && (i & 63) == 63) sched_yield();  // hot but idle: hand the core to anyone who wants it
      else spin_pause(i);
      if ((i & 255) == 255 && (late || now_us() > until)) {
        late = true;
        const bool in_use =
            skipped < kUnusedAfter && solo_.load(std::memory_order_relaxed) - solo_at < (uint32_t)kUnusedAfter;
        if (in_use && hot_.load(std::memory_order_relaxed)) continue;
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (gen_.load(std::memory_order_seq_cst) == seen) futex_wait(&gen_, seen);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      }
    }
    seen = g;
    if (stop_.load(std::memory_order_acquire)) return;
    if (tid >= (int)(g & kMaxThreads)) {  // not in this run's team
      skipped += skipped < kUnusedAfter;
      continue;
    }
    skipped = 0, solo_at = solo_.load(std::memory_order_relaxed);
    fn_(ctx_, tid);
    finished_.fetch_add(1, std::memory_order_acq_rel);
    until = now_us() + spin_us_;
  }
}

void Pool::quiesce() {
  for (unsigned i = 0; finished_.load(std::memory_order_acquire) < expect_; ++i) spin_pause(i);
}

void Pool::publish(Fn fn, void* ctx, int team) {
  quiesce();  // the last run's workers are out of fn: fn_/ctx_ and what fn reads may change
  fn_ = fn;
  ctx_ = ctx;
  expect_ = team - 1;
  finished_.store(0, std::memory_order_relaxed);
  const uint32_t g = gen_.load(std::memory_order_relaxed);
  gen_.store(((g >> 12) + 1) << 12 | (uint32_t)team, std::memory_order_seq_cst);  // publishes fn_/ctx_
  if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&gen_);
}

void Pool::launch(Fn fn, void* ctx, int team) {
  if (n_ < 2 || omp_) return;  // an OpenMP team has no thread without the caller (the executor refuses groups)
  publish(fn, ctx, std::max(2, std::min(team, n_)));
}

void Pool::start(Fn fn, void* ctx, int team) {
  team = std::max(1, std::min(team, n_));
  if (omp_ && team > 1) {  // returns when every thread is out of fn: nothing for quiesce() to wait for
    if (solo_left_ > 0) {
      --solo_left_;
      fn(ctx, 0);
    } else if (!omp_->run(fn, ctx, team, false)) {
      solo_left_ = kSoloAfterLate;
    }
    return;
  }
  if (team > 1) {
    publish(fn, ctx, team);
  } else {
    quiesce();
    expect_ = 0;  // the caller alone: the workers are not disturbed, only counted (a relaxed store)
    finished_.store(0, std::memory_order_relaxed);
    solo_.store(solo_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  fn(ctx, 0);
}

void Pool::run(Fn fn, void* ctx, int team) {
  team = std::max(1, std::min(team, n_));
  if (omp_ && team > 1) {  // every tid, late or not: fn's work is split by tid
    omp_->run(fn, ctx, team, true);
    return;
  }
  start(fn, ctx, team);
  quiesce();
}
}  // namespace cpumoe_exec
