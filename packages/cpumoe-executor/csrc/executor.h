// The executor: a format kernel (cpumoe-formats C ABI), per-layer banks, the
// worker pool, scratch sized for max_tokens, the IO block and the coordinator.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpumoe_executor/abi.h"
#include "cpumoe_formats/abi.h"
#include "pool.h"
#include "route_sum.h"

namespace cpumoe_exec {

struct Config {
  cpumoe_params params;
  int tier_cap = -1;
  int num_layers = 1;
  int top_k = 1;
  int max_tokens = 1;
  std::vector<int> cores;  // cores[0]: caller/coordinator; size = threads
  bool pin = true;
  int64_t spin_us = 2000;
};

// The tier this process's SIMD code may use: the formats library's detection (CPUID, the OS's register state, its
// build), under tier_cap, or under the library's own cap (CPUMOE_ISA) when tier_cap < 0 (as kernel_create).
int capped_tier(const cpumoe_formats_api* api, int tier_cap);

class Executor {
 public:
  Executor(const cpumoe_formats_api* api, const Config& cfg);
  ~Executor();

  void set_banks(int layer, const std::vector<cpumoe_bank>& banks);
  // Synchronous step (one at a time per executor). Returns a cpumoe_error_code.
  int run(int layer, int T, const uint16_t* x, const int32_t* ids, const float* w, uint16_t* y, std::string* err);
  // A task on the IO block; on failure also sets the error word (first error sticks).
  int run_task(uint64_t task);

  cpumoe_iob_header* iob() const { return iob_; }
  void start_coordinator(uint64_t* ready, uint64_t* done, uint64_t* error, int core);
  void stop_coordinator();
  bool coordinator_running() const { return coord_running_.load(std::memory_order_acquire); }
  cpumoe_hostfn_arg* hostfn_arg(uint32_t layer, uint32_t T);
  void hostfn_submit(uint64_t task);
  void hostfn_wait();

  // Health: doorbells served, whether a task runs now and for how long.
  uint64_t served() const { return served_.load(std::memory_order_acquire); }
  // Total nanoseconds the coordinator spent on doorbells, from seeing ready to storing done.
  int64_t service_ns() const { return service_ns_.load(std::memory_order_relaxed); }
  uint64_t pool_runs() const { return pool_runs_.load(std::memory_order_acquire); }
  int64_t busy_ns() const;
  std::string last_error();
  void clear_error();

  // Multi-thread read bandwidth of [p, p+n) with this executor's threads: one
  // GB/s sample per repeat (the bench's ceiling, measured like the decode runs).
  std::vector<double> read_bandwidth(const void* p, size_t n, int reps);
  // The compute roof: every pool thread runs the formats library's peak_loop(kind, tier, iters) at once; returns
  // multiply-adds per second (G) per rep, or an empty vector where the tier has no such loop here.
  std::vector<double> compute_peak(int kind, int tier, uint64_t iters, int reps);

  // Team sizing: a step runs on 1 + (its work in bytes) / unit threads, at most threads();
  // unit <= 0: always every thread. Work = weight bytes of the routed experts + kDotBytes per
  // row dot. Any team size gives bit-identical output.
  static constexpr int64_t kDotBytes = 32;
  // The most routes a token has (the seeds' limit; the route reduction keeps a token's term pointers on the stack).
  static constexpr int kMaxTopK = 64;
  // Target work items per thread and stage (run(): item sizes in whole block_hints).
  static constexpr int kItemsPerThread = 8;
  static constexpr int64_t kTeamUnitDefault = 64 << 10;
  void set_team_unit(int64_t bytes) { team_unit_.store(bytes, std::memory_order_relaxed); }
  int64_t team_unit() const { return team_unit_.load(std::memory_order_relaxed); }
  int team_size(int layer, int nroutes, int ngroups) const;

  const cpumoe_kernel* kernel() const { return k_; }
  const Config& config() const { return cfg_; }
  // The down row block reduction's width ("avx512f", "avx2", "sse2"), from capped_tier like the kernel's tier.
  const char* route_sum_isa() const { return rsum_.isa; }
  int threads() const { return pool_.size(); }
  int pinned() const { return pool_.pinned(); }
  int pool_sleepers() const { return pool_.sleepers(); }

  // Step trace (off by default; bench --trace): per thread, nanoseconds summed over the traced steps, each
  // measured from the step's start (run() entry after the route sort). One mono_ns() pair per work item.
  struct TraceSlot {
    int64_t steps, enter, prep, gate_up, down_wait, down, exit;  // enter / exit: offsets from the step start
  };
  struct Trace {
    int64_t steps = 0, step_ns = 0;  // caller: the steps and their summed duration (start to y complete)
    std::vector<TraceSlot> threads;  // per tid; steps = 0 where a thread joined no traced step
  };
  // Starts (clearing the sums) or stops tracing.
  void set_trace(bool on);
  Trace trace();

 private:
  // reps runs of fn(ctx) on every pool thread, timed: per run ctx->done (zeroed before it; the threads add what
  // they did: bytes read, multiply-adds) per second, in G. read_bandwidth and compute_peak.
  template <class Ctx>
  std::vector<double> timed_rates(Pool::Fn fn, Ctx* ctx, int reps);
  static void body_tramp(void* self, int tid) { static_cast<Executor*>(self)->body(tid); }
  void body(int tid);
  void coordinator_loop(int core);
  void set_error(int code, const std::string& msg);
  // Claims and runs route preps of expert group grp (its g rows are complete) until none is left to claim.
  void prep_routes(int grp);

  const cpumoe_formats_api* api_;
  Config cfg_;
  cpumoe_kernel* k_ = nullptr;
  RouteSum rsum_{};
  Pool pool_;
  std::vector<std::array<cpumoe_bank, CPUMOE_MAX_BANKS>> banks_;
  std::mutex run_mu_;  // one task in flight

  // scratch (max_tokens)
  size_t xa_, ga_;
  std::vector<char> xprep_, g_, gprep_;
  std::vector<float> part_;  // [route slot j][H]: route j's down terms (down items write, the hb reductions read)
  std::vector<int32_t> tstart_, troutes_;  // per token, its route slots in route order (CSR)
  std::vector<int32_t> order_, gstart_, gexpert_, count_;
  std::vector<const void*> rxp_;
  std::vector<float> rwin_;
  std::vector<uint16_t*> rg_;
  std::vector<cpumoe_route> routes_;

  // the step being run (read by the workers)
  struct Step {
    int layer, T, nroutes, ngroups, n_iblk, n_hblk, iblk, hblk;
    const uint16_t* x;
    uint16_t* y;
    const cpumoe_bank* banks;
  } st_{};
  // claim counters (c*) and completion counters (d*), each on its own line
  alignas(64) std::atomic<int> c0_{0};
  alignas(64) std::atomic<int> d0_{0};
  alignas(64) std::atomic<int> c1_{0};
  alignas(64) std::atomic<int> c3_{0};
  alignas(64) std::atomic<int> d3_{0};
  std::unique_ptr<std::atomic<int>[]> left_;   // row blocks left per expert group
  std::unique_ptr<std::atomic<int>[]> gready_;  // 1 once an expert group's g rows are all written (preps may start)
  std::unique_ptr<std::atomic<int>[]> gnext_;   // per group: route preps claimed
  std::unique_ptr<std::atomic<int>[]> gdone_;   // per group: route preps done (down may read them when all are)
  std::unique_ptr<std::atomic<int>[]> hleft_;   // down items left per output row block (the last one reduces it)
  std::vector<int64_t> expert_bytes_;          // per layer
  std::atomic<int64_t> team_unit_{kTeamUnitDefault};
  struct alignas(64) Slot {
    TraceSlot s;
  };
  std::unique_ptr<Slot[]> trace_;  // pool size entries
  bool tracing_ = false;           // written under run_mu_ with the pool quiesced
  int64_t t0_ = 0, trace_steps_ = 0, trace_ns_ = 0;

  // IO block and coordinator
  cpumoe_iob_header* iob_ = nullptr;
  size_t iob_bytes_ = 0;
  uint64_t *ready_ = nullptr, *done_ = nullptr, *error_ = nullptr;
  std::thread coord_;
  std::atomic<bool> coord_stop_{false}, coord_running_{false};
  std::atomic<uint64_t> served_{0}, pool_runs_{0};
  std::atomic<int64_t> busy_since_{0}, service_ns_{0};
  std::mutex err_mu_;
  std::string last_error_;
  std::mutex args_mu_;
  std::vector<cpumoe_hostfn_arg*> args_;
};

int64_t mono_ns();
}  // namespace cpumoe_exec
