// The executor: format kernels (cpumoe-formats C ABI), per-layer banks, the
// worker pool, scratch sized for max_tokens, the IO block and the coordinator.
// Formats per layer and per role (docs/executor.md "Formats per layer"): each part holds one kernel per distinct
// format of the model; a layer names the kernel of its gate_up pass and that of its down pass (the same one in a
// single-format model). The gate_up kernel prepares x (K = H) and runs gate_up on the layer's gate_up bank array,
// the down kernel prepares the g rows (K = I) and runs down on the layer's down bank array; a step picks the two
// kernels and the two arrays once, the inner loops are the single-format ones.
// NUMA (docs/numa.md): the pool is one worker group per node, each with its own pool; the caller is tid 0 of
// group 0 and wakes the others. A part is an I-slice [i0, i1) of every expert with its own kernel (inter = i1 - i0),
// scratch and stage counters; a group runs its parts in order, on banks placed on its node. One group running one
// part, the whole of I, on the given arrays is the single pool (numa "off").
//
// Threads: every public member may be called from any thread. Steps (run, run_task, the timed pool loops) hold
// run_mu_ for the whole step, so a decode and a doorbell task never interleave; coordinator start / stop / close
// hold coord_mu_ (taken before run_mu_, never after).
// Life: close() joins every thread and frees the kernel, scratch and banks; the object itself (its C ABI handle,
// the hostfn arguments, the IO block) stays valid until destruction, and every later step fails with an error
// naming the closed executor. In a forked child (pthread_atfork) the workers are the parent's and do not exist:
// every entry fails at once, before taking any lock (a parent thread may have held it at the fork), naming what
// to do; close() and the destructor leak the parent's threads instead of joining them.
#pragma once
#include <stdexcept>
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
#include "numa_mem.h"
#include "pool.h"
#include "route_sum.h"

namespace cpumoe_exec {

struct Config {
  std::string label = "cpumoe executor";  // names the executor in errors (the Python object's description)
  cpumoe_params params;                   // params.format: ignored where `formats` is given
  // The model's distinct formats (cpumoe_format_id) and, per layer, the index in it of its gate_up format and of
  // its down format. Both empty: params.format for every layer and both passes.
  std::vector<int32_t> formats;
  std::vector<std::array<int, 2>> layer_kernels;
  int tier_cap = -1;
  int num_layers = 1;
  int top_k = 1;
  int max_tokens = 1;
  std::vector<int> cores;  // cores[0]: caller/coordinator; size = threads (the single pool: `groups` empty)
  bool pin = true;
  int64_t spin_us = 2000;
  // The single pool's steps run on the host process's OpenMP team (omp_team.h): no worker thread of our own, no
  // coordinator, no NUMA groups.
  bool team_openmp = false;
  // NUMA worker groups (empty: one group of `cores` running the whole of I). Group 0's cores[0] is the caller's;
  // the other groups' cores are all workers. bounds: the parts' I boundaries, 0 = bounds[0] < ... < bounds[P] = I.
  struct Group {
    int node = -1;           // where its banks are placed (place_banks); -1: nowhere in particular
    std::vector<int> cores;  // at least one
    std::vector<int> parts;  // the parts it runs, in order
  };
  std::vector<Group> groups;
  std::vector<int> bounds;
};

// Where place_banks put one (layer, group, part)'s banks, for numa_report().
struct Placement {
  int layer, group, part, node;
  size_t bytes;
  int mbind_errno;     // NodeMem::mbind_errno
  int touched_by;      // threads that wrote the pages first (the group's workers; 1: the caller, a group without)
  int touchers_pinned; // of those, pinned to the group's cores
  int pages_checked, pages_on_node;  // page_nodes() after the copy
  std::shared_ptr<NodeMem> mem;
  std::vector<size_t> offsets;  // each bank's first byte in mem
};

// The tier this process's SIMD code may use: the formats library's detection (CPUID, the OS's register state, its
// build), under tier_cap, or under the library's own cap (CPUMOE_ISA) when tier_cap < 0 (as kernel_create).
int capped_tier(const cpumoe_formats_api* api, int tier_cap);

// The IO block's memory (protocol v1): one page-aligned anonymous mapping, owned jointly by the executor and by
// every view handed out of it (Python's io_arrays), so no view outlives it.
struct IoMem {
  explicit IoMem(size_t bytes);  // throws std::runtime_error when the mapping fails
  ~IoMem();
  IoMem(const IoMem&) = delete;
  IoMem& operator=(const IoMem&) = delete;
  void* p = nullptr;
  size_t n = 0;
};

class Executor {
 public:
  Executor(const cpumoe_formats_api* api, const Config& cfg);
  ~Executor();

  // Joins the coordinator and the workers, frees the kernel, scratch and banks; idempotent, waits for the step in
  // flight. Later steps return CPUMOE_ERR_INTERNAL, later setters throw std::runtime_error (state_error()).
  void close();
  bool closed() const { return closed_.load(std::memory_order_acquire); }
  // Whether this process is a fork of the one that created the executor (its threads are not here).
  bool forked() const;
  // Why the executor cannot run (closed, or created in the parent of this forked process), or "" when it can.
  std::string state_error() const;

  // The single pool's banks for `layer` (group 0, part 0): the caller's arrays, used in place. gu_map / dn_map:
  // per slot of the layer's gate_up (down) kernel's bank array, the index in `banks` of its bank, -1 for a slot
  // that pass does not read (the other role's); both empty: `banks` is both arrays (a single-format layer).
  void set_banks(int layer, const std::vector<cpumoe_bank>& banks, const std::vector<int>& gu_map = {},
                 const std::vector<int>& dn_map = {});
  // Copies the banks of `layer` that `part` runs on into one mapping on `group`'s node (NodeMem), its pages touched
  // first by that group's workers, and runs the (group, part) from there. src: each bank's first byte, the bytes it
  // spans and its strides (kept). Under the step lock.
  struct BankSource {
    const void* ptr;
    size_t bytes;
    int64_t expert_stride, row_stride;
  };
  Placement place_banks(int layer, int group, int part, const std::vector<BankSource>& src,
                        const std::vector<int>& gu_map = {}, const std::vector<int>& dn_map = {});
  std::vector<Placement> placements();
  // Synchronous step (one at a time per executor). Returns a cpumoe_error_code (CPUMOE_ERR_INTERNAL: closed, or
  // a forked child's copy).
  int run(int layer, int T, const uint16_t* x, const int32_t* ids, const float* w, uint16_t* y, std::string* err);
  // run() on the routing as a framework's router leaves it: ids int32 or int64 (ids_bytes 4 or 8; int64 ids are
  // range-checked before they are narrowed), weights float32 or bf16 (widened exactly). Saves the caller a conversion
  // per array per step, each a framework op that costs tens of microseconds between layers (docs/end-to-end.md).
  int run_routed(int layer, int T, const uint16_t* x, const void* ids, int ids_bytes, const void* w, bool w_bf16,
                 uint16_t* y, std::string* err);
  // A task on the IO block; on failure also sets the error word (first error sticks).
  int run_task(uint64_t task);

  cpumoe_iob_header* iob() const { return iob_; }
  const std::shared_ptr<IoMem>& io_memory() const { return iom_; }
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
  // Work done by the steps that ran the pool (any handshake path): nanoseconds from the step's start to its last
  // down item, and the distinct experts they routed. A caller's live experts (so weight bytes) per second.
  int64_t work_ns() const { return work_ns_.load(std::memory_order_relaxed); }
  int64_t work_experts() const { return work_experts_.load(std::memory_order_relaxed); }
  int64_t busy_ns() const;
  std::string last_error();
  void clear_error();

  // Multi-thread read bandwidth of [p, p+n) with this executor's threads (every group's): one
  // GB/s sample per repeat (the bench's ceiling, measured like the decode runs).
  std::vector<double> read_bandwidth(const void* p, size_t n, int reps);
  // The NUMA read ceiling: each group's threads read `bytes` placed on its own node (NodeMem, first touched by
  // them); group >= 0: that group alone, -1: every group at once (each its own buffer). GB/s per repeat.
  std::vector<double> node_read_bandwidth(size_t bytes, int reps, int group);
  // The compute roof: every pool thread runs the formats library's peak_loop(kind, tier, iters) at once; returns
  // multiply-adds per second (G) per rep, or an empty vector where the tier has no such loop here.
  std::vector<double> compute_peak(int kind, int tier, uint64_t iters, int reps);

  // The dense bf16 linear (cpumoe-formats ABI 1.9; linear.cpp) on group 0's threads (the caller and its workers, or
  // its OpenMP team): y_t[r] = dot(W[r, 0:K], x_t) (+ bias[r]) for r < M, t < n, stored bf16 or fp32. w: W's row 0,
  // w_stride bytes between rows; x: token 0's bf16 row, x_stride bytes between tokens; y likewise. The rows are split
  // in blocks the threads claim (a thread that comes late finds them taken); any team gives the same bits. Under the
  // step lock (a linear and a step never interleave). Throws std::invalid_argument on bad sizes, std::runtime_error
  // when closed or in a forked child.
  void linear(const void* w, int64_t w_stride, int32_t M, int32_t K, int32_t n, const uint16_t* x, int64_t x_stride,
              const uint16_t* bias, void* y, int64_t y_stride, bool y_fp32);
  // The linear kernel's tier name ("avx512bf16"), from the same cap as the experts' kernels.
  const std::string& linear_name() const { return linear_name_; }
  uint64_t linear_runs() const { return linear_runs_.load(std::memory_order_relaxed); }
  // Decode attention (cpumoe-formats ABI 1.11; attention.cpp) on group 0's threads: a.n query tokens x Hkv kv heads
  // as work items the threads claim; the same bits on any team. Under the step lock. Throws std::invalid_argument on
  // bad sizes, std::runtime_error when closed or in a forked child.
  void attention(const cpumoe_attention_args& a, int32_t Hkv);
  const std::string& attention_name() const { return attention_name_; }
  uint64_t attention_runs() const { return attention_runs_.load(std::memory_order_relaxed); }

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
  // The whole team (every group's); a group other than the caller's runs at least one worker where it has a part
  // no other group runs, and none where every part it runs is shared (replicate) and the step is small.
  int team_size(int layer, int nroutes, int ngroups) const;
  // The most I-slices a step sums (the reduction keeps a token's term pointers, parts x routes, on the stack).
  static constexpr int kMaxParts = 16;

  const std::string& kernel_name() const { return kernel_name_; }
  // Per format of Config::formats, the name of its kernel ("avx512vnni+w4a8").
  std::vector<std::string> kernel_names() const;
  const Config& config() const { return cfg_; }
  // The down row block reduction's width ("avx512f", "avx2", "sse2"), from capped_tier like the kernel's tier.
  const char* route_sum_isa() const { return rsum_.isa; }
  int threads() const { return nthreads_; }
  int pinned() const;
  int pool_sleepers() const;
  int num_groups() const { return (int)groups_.size(); }
  int num_parts() const { return (int)parts_.size(); }

  // Step trace (off by default; bench --trace): per thread, nanoseconds summed over the traced steps, each
  // measured from the step's start (run() entry after the route sort). One mono_ns() pair per work item.
  // tail: per step, how long before y was complete the thread left (0 for one that left after: the thread that
  // completes y, or a worker that woke after the step was done); last_exit: its exit offset in the last traced
  // step, -1 once that step's tail is added (fold_tails(), after the workers have left).
  struct TraceSlot {
    int64_t steps, enter, prep, gate_up, down_wait, down, exit, tail, last_exit;  // enter / exit: offsets from
                                                                                 // the step start
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
  // One I-slice: its kernel, scratch (max_tokens) and the stage counters of the step in flight.
  struct Part {
    int i0 = 0, i1 = 0;
    std::vector<cpumoe_kernel*> ks;           // per format of the model (Config::formats)
    cpumoe_kernel *kg = nullptr, *kd = nullptr;  // this step's gate_up and down kernels
    size_t xa = 0, ga = 0;  // prepared x / g row bytes (64-byte multiples), the most over the kernels
    std::vector<char> xprep, g, gprep;
    std::vector<float> terms;  // [route slot j][H]: route j's down terms over this slice
    std::vector<const void*> rxp;
    std::vector<uint16_t*> rg;
    std::vector<cpumoe_route> routes;
    std::vector<int64_t> expert_bytes;  // per layer: weight bytes of one expert's slice
    int n_iblk = 0, iblk = 0;           // this step's gate_up row blocks
    int sharers = 0;                    // groups that run it
    alignas(64) std::atomic<int> c0{0};
    alignas(64) std::atomic<int> d0{0};
    alignas(64) std::atomic<int> c1{0};
    alignas(64) std::atomic<int> c3{0};
    std::unique_ptr<std::atomic<int>[]> left;    // row blocks left per expert group
    std::unique_ptr<std::atomic<int>[]> gready;  // 1 once an expert group's g rows are all written
    std::unique_ptr<std::atomic<int>[]> gnext;   // per group: route preps claimed
    std::unique_ptr<std::atomic<int>[]> gdone;   // per group: route preps done
  };
  // One layer's banks for one part: the gate_up kernel's bank array and the down kernel's (the same banks in a
  // single-format layer).
  struct LayerBanks {
    std::array<cpumoe_bank, CPUMOE_MAX_BANKS> gu{}, dn{};
    bool set = false;
  };
  // One worker group: its pool, the parts it runs and their banks.
  struct Group {
    Executor* ex = nullptr;
    int index = 0, node = -1, first = 0;  // first: the global index (trace) of its first thread
    std::unique_ptr<Pool> pool;
    std::vector<int> parts;
    std::vector<std::vector<LayerBanks>> banks;                                  // [slot][layer]
    std::vector<std::vector<std::shared_ptr<NodeMem>>> mem;                    // [slot][layer], placed banks
    int threads() const { return index == 0 ? pool->size() : pool->size() - 1; }  // tid 0 of others is nobody
  };
  // fn(ctx, group, i, n): thread i of the n of `group` (group 0's i 0: the caller).
  using GroupFn = void (*)(void* ctx, int group, int i, int n);
  // Runs fn on every thread of group `which` (-1: of every group) and returns when all are done.
  void run_groups(GroupFn fn, void* ctx, int which);
  template <class Ctx>
  std::vector<double> timed_rates(GroupFn fn, Ctx* ctx, int reps, int which = -1);
  static void body_tramp(void* g, int tid) {
    auto* G = static_cast<Group*>(g);
    G->ex->body(*G, tid);
  }
  void body(const Group& G, int tid);
  struct Clock;
  void part_body(Part& P, const LayerBanks& banks, Clock& c);
  // banks -> the gate_up and down arrays of `layer` (set_banks' maps); throws std::invalid_argument on a bad map.
  LayerBanks layer_arrays(int layer, const std::vector<cpumoe_bank>& banks, const std::vector<int>& gu_map,
                          const std::vector<int>& dn_map) const;
  // Each group's team for a step (its pool's run team: 0 where it sits the step out); returns their threads.
  int size_teams(int layer, int nroutes, int ngroups, std::vector<int>* teams) const;
  void coordinator_loop(int core);
  void set_error(int code, const std::string& msg);
  // Claims and runs route preps of expert group grp (its g rows are complete) until none is left to claim.
  void prep_routes(Part& P, int grp);
  void quiesce_all();
  void set_hot(bool hot);
  // Adds the last traced step's tails (under run_mu_, the pool quiesced).
  void fold_tails();
  // Under coord_mu_.
  void stop_coordinator_locked();
  // In a forked child: the parent's threads are forgotten, not joined (pool.h: Pool::abandon).
  void abandon_threads();

  // The linear in flight (linear.cpp): a member, so that a worker leaving late reads live memory.
  struct LinearJob {
    const cpumoe_linear* k;
    const void* w;
    int64_t ws, xs, ys;
    int32_t K, M, n, blk, nblk, fp32;
    const void* x;
    const uint16_t* bias;
    void* y;
    alignas(64) std::atomic<int> next{0};
    alignas(64) std::atomic<int> done{0};
  };
  static void linear_body(void* job, int tid);
  // The attention in flight (attention.cpp), a member for the same reason.
  struct AttentionJob {
    const cpumoe_attention* k;
    cpumoe_attention_args a;
    int32_t Hkv, nitems;
    char* scratch;   // a thread's at scratch + tid * sstride
    size_t sstride;
    alignas(64) std::atomic<int> next{0};
    alignas(64) std::atomic<int> done{0};
  };
  static void attention_body(void* job, int tid);

  const cpumoe_formats_api* api_;
  Config cfg_;
  cpumoe_linear* lin_ = nullptr;
  std::string linear_name_;
  LinearJob lin_job_{};
  std::vector<char> lin_x_;  // prepared x rows (tiers that widen x)
  std::atomic<uint64_t> linear_runs_{0};
  cpumoe_attention* att_ = nullptr;
  std::string attention_name_;
  AttentionJob att_job_{};
  std::vector<char> att_scratch_;
  std::atomic<uint64_t> attention_runs_{0};
  RouteSum rsum_{};
  std::vector<std::unique_ptr<Part>> parts_;
  std::vector<std::unique_ptr<Group>> groups_;
  int nthreads_ = 0;
  std::mutex run_mu_;    // one task in flight
  std::mutex coord_mu_;  // coordinator start / stop and close (before run_mu_)
  std::atomic<bool> closed_{false};
  uint64_t fork_gen_;    // the process's fork generation at construction (forked())
  int pid_;              // the creating process (errors)
  std::string kernel_name_;
  std::vector<Placement> placements_;

  // scratch shared by the parts (max_tokens)
  std::vector<int32_t> tstart_, troutes_;  // per token, its route slots in route order (CSR)
  std::vector<int32_t> order_, gstart_, gexpert_, count_;
  std::vector<float> rwin_;
  std::vector<int> teams_;  // this step's, per group

  // the step being run (read by the workers)
  struct Step {
    int layer, T, nroutes, ngroups, n_hblk, hblk;
    const uint16_t* x;
    uint16_t* y;
  } st_{};
  alignas(64) std::atomic<int> d3_{0};          // output row blocks complete
  std::unique_ptr<std::atomic<int>[]> hleft_;  // down items left per output row block, over every part
  std::atomic<int64_t> team_unit_{kTeamUnitDefault};
  struct alignas(64) Slot {
    TraceSlot s;
  };
  std::unique_ptr<Slot[]> trace_;  // threads() entries
  bool tracing_ = false;           // written under run_mu_ with the pool quiesced
  bool fold_pending_ = false;      // a traced step's tails are not added yet
  int64_t t0_ = 0, trace_steps_ = 0, trace_ns_ = 0, last_done_ = 0;

  // IO block and coordinator
  std::shared_ptr<IoMem> iom_;
  cpumoe_iob_header* iob_ = nullptr;
  uint64_t *ready_ = nullptr, *done_ = nullptr, *error_ = nullptr;
  std::thread coord_;
  std::atomic<bool> coord_stop_{false}, coord_running_{false};
  std::atomic<uint64_t> served_{0}, pool_runs_{0};
  std::atomic<int64_t> busy_since_{0}, service_ns_{0}, work_ns_{0}, work_experts_{0};
  std::mutex err_mu_;
  std::string last_error_;
  std::mutex args_mu_;
  std::vector<cpumoe_hostfn_arg*> args_;
};

int64_t mono_ns();
}  // namespace cpumoe_exec
