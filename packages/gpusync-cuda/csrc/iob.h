// One executor's IO block on one device: registration, the doorbell on a
// stream (memop or host-function path), the copy step (its input copies forked
// onto side streams), and which paths a probe proved replay-safe.
#pragma once
#include <memory>
#include <mutex>
#include <string>

#include "cpumoe_executor/abi.h"
#include "device.h"
#include "gpusync/abi.h"

namespace gpusync {

// The copy step's fork/join resources: one non-blocking side stream per input
// copy (x, ids, w) and the events ordering them after the caller's prior work
// (fork) and the doorbell after them (join). Created with the IO block, in the
// device's primary context; none when `on` is false (GPUSYNC_COPY_FORK=0).
class CopyFork {
 public:
  static constexpr int kBranches = 3;  // x, ids, w
  CopyFork(const Device& dev, bool on);
  ~CopyFork();
  CopyFork(const CopyFork&) = delete;
  CopyFork& operator=(const CopyFork&) = delete;

  bool on() const { return on_; }
  CUstream side(int i) const { return side_[i]; }
  CUevent fork_event() const { return fork_; }
  CUevent join_event(int i) const { return join_[i]; }
  // Serialises steps that share these streams and events (one task in flight anyway).
  std::mutex& mu() { return mu_; }

 private:
  void release();
  const Device& dev_;
  bool on_;
  CUstream side_[kBranches] = {};
  CUevent fork_ = nullptr;
  CUevent join_[kBranches] = {};
  std::mutex mu_;
};

// GPUSYNC_COPY_FORK: unset, "" or "1" -> true (fork), "0" -> false (serial);
// anything else throws Error(GPUSYNC_E_INVALID) naming the variable and the values.
bool copy_fork_from_env();

class Iob {
 public:
  Iob(std::shared_ptr<Device> dev, const cpumoe_executor_api* api, cpumoe_executor* exec);
  ~Iob();
  Iob(const Iob&) = delete;
  Iob& operator=(const Iob&) = delete;

  Device& dev() const { return *dev_; }
  const cpumoe_executor_api* exec_api() const { return api_; }
  cpumoe_executor* exec() const { return exec_; }
  cpumoe_iob_header* hdr() const { return hdr_; }
  char* host(uint64_t off) const { return reinterpret_cast<char*>(hdr_) + off; }
  // Device address of a host address inside the block.
  CUdeviceptr dptr(const void* host) const;
  CUdeviceptr dptr_off(uint64_t off) const { return dbase_ + off; }

  void submit(int path, CUstream s, uint32_t layer, uint32_t T);
  void wait(int path, CUstream s);
  // Copy path: D2H x/ids/w, submit, wait, H2D y (device pointers, contiguous rows). With the
  // fork on, the three input copies (and the memop path's done := 0) run concurrently.
  // step = step_submit + step_finish, checked once up front (nothing is enqueued when a check fails).
  void step(int path, CUstream s, uint32_t layer, uint32_t T, CUdeviceptr x, CUdeviceptr ids, CUdeviceptr w,
            CUdeviceptr y);
  // The copy step in two halves on one stream, so other work can run on it while the CPU works:
  // step_submit = D2H x/ids/w + the doorbell; step_finish = the wait + H2D y (T: the submitted batch).
  // One task in flight per block: the caller issues them in pairs, in order, on the same stream.
  void step_submit(int path, CUstream s, uint32_t layer, uint32_t T, CUdeviceptr x, CUdeviceptr ids,
                   CUdeviceptr w);
  void step_finish(int path, CUstream s, uint32_t T, CUdeviceptr y);
  // Bounded: on timeout, releases the stream (done := SHUTDOWN) and returns false.
  bool sync(CUstream s, double timeout_s);

  bool replay_safe(int path) const { return path >= 0 && path < GPUSYNC_PATH_COUNT && (safe_ & (1u << path)); }
  void set_replay_safe(int path, bool on);
  bool copy_fork() const { return fork_.on(); }
  // "copies forked (GPUSYNC_COPY_FORK=1): ..." or "copies serial (GPUSYNC_COPY_FORK=0)", for reports.
  std::string copy_mode() const;
  std::string& report(int path) {
    if (path < 0 || path >= GPUSYNC_PATH_COUNT) throw Error(GPUSYNC_E_INVALID, "no such path");
    return report_[path];
  }

  // The executor's host-function argument for (layer, T) (stable address).
  cpumoe_hostfn_arg* hostfn_arg(uint32_t layer, uint32_t T) const;

 private:
  void check_task(uint32_t layer, uint32_t T) const;
  // The doorbell proper, after the checks: memop path done := 0 (if reset_done) then ready := task;
  // host-func path the executor's hostfn_submit (which resets done itself).
  void ring(int path, CUstream s, uint32_t layer, uint32_t T, bool reset_done);
  void write_word(CUstream s, uint64_t off, uint64_t value, const std::string& what) const;
  struct Copy {
    uint64_t off;  // destination in the IO block
    CUdeviceptr src;
    size_t bytes;
    const char* what;
  };
  void copy_in(const Copy& c, CUstream on, CUstream s) const;
  // The three input copies on the side streams between a fork from s and a join back into s;
  // the memop path's done := 0 goes on s meanwhile when reset_done.
  void copies_forked(CUstream s, const Copy (&in)[CopyFork::kBranches], bool reset_done);
  // Refuses capture for a path no probe proved (fail closed); notes the capture state.
  void guard_capture(int path, CUstream s, const char* op) const;
  // The copy step's checks (a copy path, its driver features, the capture guard), named after `op`.
  void check_copy_path(int path, CUstream s, const char* op) const;
  void check_tokens(uint32_t T, const char* op) const;
  // The halves' bodies, after the checks (the caller holds a Device::Guard).
  void copy_submit(int path, CUstream s, uint32_t layer, uint32_t T, CUdeviceptr x, CUdeviceptr ids,
                   CUdeviceptr w);
  void copy_finish(int path, CUstream s, uint32_t T, CUdeviceptr y);

  std::shared_ptr<Device> dev_;
  const cpumoe_executor_api* api_;
  cpumoe_executor* exec_;
  cpumoe_iob_header* hdr_;
  CUdeviceptr dbase_ = 0;
  bool owned_ = false;
  uint32_t safe_ = 0;
  CopyFork fork_;  // constructed before the block is registered: a failure there leaves nothing to undo
  std::string report_[GPUSYNC_PATH_COUNT];
};

const char* path_name(int path);
}  // namespace gpusync
