// The doorbell coordinator (protocol v1, docs/protocol.md) and the host-function
// entry points of the fallback path.
#include <sched.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

#include "executor.h"
#include "topology.h"

namespace cpumoe_exec {
namespace {
constexpr int64_t kSpinWindowNs = 50'000'000;  // keep spinning 50 ms after the last doorbell
constexpr int64_t kDozeMinUs = 100, kDozeMaxUs = 2000;
uint64_t load(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void store(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
}  // namespace

void Executor::start_coordinator(uint64_t* ready, uint64_t* done, uint64_t* error, int core) {
  if (forked()) throw std::runtime_error(state_error());
  std::lock_guard<std::mutex> c(coord_mu_);
  if (closed()) throw std::runtime_error(state_error());
  if (cfg_.team_openmp)  // its thread would start an OpenMP team of its own beside the host's
    throw std::runtime_error(cfg_.label + " runs on the host's OpenMP team (team='openmp'), which serves synchronous "
                             "decode only: a doorbell needs team='pool'");
  stop_coordinator_locked();
  ready_ = ready ? ready : &iob_->ready;
  done_ = done ? done : &iob_->done;
  error_ = error ? error : &iob_->error;
  store(ready_, 0);
  store(done_, CPUMOE_DONE_COMPLETE);  // nothing pending
  coord_stop_.store(false);
  coord_running_.store(true, std::memory_order_release);
  coord_ = std::thread(&Executor::coordinator_loop, this, core);
}

void Executor::stop_coordinator() {
  if (forked()) return;  // the parent's coordinator is not here (close() forgets it)
  std::lock_guard<std::mutex> c(coord_mu_);
  stop_coordinator_locked();
}

void Executor::stop_coordinator_locked() {
  if (!coord_.joinable()) return;
  coord_stop_.store(true, std::memory_order_release);
  coord_.join();
  coord_running_.store(false, std::memory_order_release);
}

void Executor::coordinator_loop(int core) {
  if (core >= 0) pin_current_thread(core);
  int64_t last = mono_ns(), doze_us = kDozeMinUs;
  unsigned polls = 0;
  bool served = false;  // a doorbell since the last clock check (no clock read per task)
  bool hot = true;      // the pool spins (never futex-sleeps) while we are in the spin window
  set_hot(true);
  while (!coord_stop_.load(std::memory_order_acquire)) {
    const uint64_t task = load(ready_);
    if (task != 0) {
      store(ready_, 0);  // clear first: the next doorbell can only follow our done
      if (!hot) set_hot(hot = true);  // after a doze: workers woken for this task stay up
      const int64_t t0 = mono_ns();
      run_task(task);
      __atomic_store_n(&iob_->served, served_.fetch_add(1, std::memory_order_acq_rel) + 1, __ATOMIC_RELEASE);
      store(done_, CPUMOE_DONE_COMPLETE);
      // Service time (ready seen -> done stored), read after the store so it delays nothing: what the CPU
      // took of a doorbell's round trip, so a bench can subtract exactly this task's time (service_ns()).
      service_ns_.fetch_add(mono_ns() - t0, std::memory_order_relaxed);
      served = true, doze_us = kDozeMinUs, polls = 0;
      continue;
    }
    if (++polls & 1023) {
      cpu_relax();
      continue;
    }
    sched_yield();  // every 1024 polls: let an oversubscribed core run the ringer
    const int64_t now = mono_ns();
    if (served) {
      last = now, served = false;
      continue;
    }
    if (now - last < kSpinWindowNs) continue;
    // Idle: the pool goes back to sleeping after its own spin, and we doze with exponential
    // backoff, so an idle engine does not burn cores.
    if (hot) set_hot(hot = false);
    std::this_thread::sleep_for(std::chrono::microseconds(doze_us));
    doze_us = std::min(doze_us * 2, kDozeMaxUs);
    polls = 1023;  // check the clock again right after the next poll
  }
  set_hot(false);
  // A doorbell rung and not served gets no y: the error word says so (the engine's health check sees it).
  if (const uint64_t task = load(ready_))
    set_error(CPUMOE_ERR_INTERNAL, "task layer=" + std::to_string(CPUMOE_TASK_LAYER(task)) + " num_tokens=" +
                                       std::to_string(CPUMOE_TASK_TOKENS(task)) +
                                       ": not run, the coordinator stopped (stop_coordinator or close) first");
  // Shutdown releases any waiter (done >= 1).
  store(done_, CPUMOE_DONE_SHUTDOWN);
}

cpumoe_hostfn_arg* Executor::hostfn_arg(uint32_t layer, uint32_t T) {
  if (forked()) return nullptr;  // args_mu_ may have been held by a parent thread at the fork
  if (layer >= (uint32_t)cfg_.num_layers || T < 1 || T > (uint32_t)cfg_.max_tokens) return nullptr;
  const uint64_t task = CPUMOE_TASK(layer, T);
  std::lock_guard<std::mutex> g(args_mu_);
  for (auto* a : args_)
    if (a->task == task) return a;
  args_.push_back(new cpumoe_hostfn_arg{reinterpret_cast<cpumoe_executor*>(this), task});
  return args_.back();
}

void Executor::hostfn_submit(uint64_t task) {
  if (!forked() && coordinator_running()) {  // ring exactly as the GPU would
    store(done_, CPUMOE_DONE_PENDING);
    store(ready_, task);
  } else {
    run_task(task);  // closed or a forked child's copy: fails at once, setting the error word
  }
}

void Executor::hostfn_wait() {
  if (forked() || !coordinator_running()) return;
  for (unsigned i = 0; load(done_) < CPUMOE_DONE_COMPLETE; ++i) spin_pause(i);
}
}  // namespace cpumoe_exec
