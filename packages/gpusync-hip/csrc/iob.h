// One executor's IO block on one HIP device: the block host-registered mapped,
// the ready/done words in signal memory (the coordinator runs on them), the
// doorbell on a stream through native or spliced memops, the copy step with
// its system-release event, and which paths a probe proved replay-safe.
#pragma once
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cpumoe_executor/abi.h"
#include "device.h"
#include "gpusync/abi.h"
#include "splice.h"

namespace gpusync {

// How a memop reaches a graph while the stream captures.
enum Mechanism {
  MECH_NONE = 0,    // not proven: memops are refused under capture
  MECH_NATIVE = 1,  // hipStreamWrite/WaitValue64 are recorded by capture (HIP >= 10)
  MECH_SPLICE = 2   // explicit batch-memop nodes spliced into the capture (HIP 6.4 .. 7.x)
};
const char* mechanism_name(int m);

class Iob {
 public:
  Iob(std::shared_ptr<Device> dev, const cpumoe_executor_api* api, cpumoe_executor* exec);
  ~Iob();
  Iob(const Iob&) = delete;
  Iob& operator=(const Iob&) = delete;

  Device& dev() const { return *dev_; }
  const Runtime& rt() const { return dev_->rt(); }
  const cpumoe_executor_api* exec_api() const { return api_; }
  cpumoe_executor* exec() const { return exec_; }
  cpumoe_iob_header* hdr() const { return hdr_; }
  char* host(uint64_t off) const { return reinterpret_cast<char*>(hdr_) + off; }

  // The words the coordinator must poll: signal memory when the runtime has it,
  // else the block's own words (then the memop paths are unavailable: ROCm
  // documents stream waits only on signal memory).
  uint64_t* ready_word() const { return ready_; }
  uint64_t* done_word() const { return done_; }
  uint64_t* scratch_word() const { return scratch_; }  // probes only
  bool signal_words() const { return signal_; }
  const std::string& signal_note() const { return signal_note_; }
  // Device address of a host address inside the block or of one of the words.
  uint64_t dptr(const void* host) const;

  Mechanism mechanism() const { return mech_; }
  void set_mechanism(Mechanism m) { mech_ = m; }

  void submit(int path, hipStream_t s, uint32_t layer, uint32_t T);
  void wait(int path, hipStream_t s);
  // Copy path: D2H x/ids/w, system-release event, submit, wait, H2D y.
  // step = step_submit + step_finish, checked once up front (nothing is enqueued when a check fails).
  void step(int path, hipStream_t s, uint32_t layer, uint32_t T, uint64_t x, uint64_t ids, uint64_t w, uint64_t y);
  // The copy step in two halves on one stream, so other work can run on it while the CPU works:
  // step_submit = D2H x/ids/w, the system-release event, the doorbell; step_finish = the wait, H2D y
  // (T: the submitted batch). One task in flight per block: the caller issues them in pairs, in order,
  // on the same stream.
  void step_submit(int path, hipStream_t s, uint32_t layer, uint32_t T, uint64_t x, uint64_t ids, uint64_t w);
  void step_finish(int path, hipStream_t s, uint32_t T, uint64_t y);
  // Bounded: on timeout, releases the stream (done := SHUTDOWN) and returns false.
  bool sync(hipStream_t s, double timeout_s);

  // Memop primitives on any signal word, routed by the capture state and the mechanism.
  void write64(hipStream_t s, uint64_t* word, uint64_t v, const char* what);
  void wait_gte(hipStream_t s, uint64_t* word, uint64_t v, const char* what);
  // Record the (layer, T) task's system-release event on s (a replayed node under capture).
  void release(hipStream_t s, uint32_t layer, uint32_t T);

  bool replay_safe(int path) const { return path >= 0 && path < GPUSYNC_PATH_COUNT && (safe_ & (1u << path)); }
  void set_replay_safe(int path, bool on);
  std::string& report(int path) {
    if (path < 0 || path >= GPUSYNC_PATH_COUNT) throw Error(GPUSYNC_E_INVALID, "no such path");
    return report_[path];
  }
  size_t param_entries() const { return params_.size(); }
  size_t event_count() const;
  cpumoe_hostfn_arg* hostfn_arg(uint32_t layer, uint32_t T) const;
  void check_task(uint32_t layer, uint32_t T) const;

 private:
  // Refuses capture for a path no probe proved (fail closed), and always for host functions.
  void guard_capture(int path, hipStream_t s, const char* op) const;
  // The copy step's path check, named after `op`; the halves' bodies after the checks (inside an
  // ErrorScope and a Device::Guard, after guard_capture); one stream-ordered copy.
  void check_copy_path(int path, const char* op) const;
  void check_tokens(uint32_t T, const char* op) const;
  void copy_submit(int path, hipStream_t s, uint32_t layer, uint32_t T, uint64_t x, uint64_t ids, uint64_t w);
  void copy_finish(int path, hipStream_t s, uint32_t T, uint64_t y);
  void copy_async(hipStream_t s, void* dst, uint64_t src, size_t n, hipMemcpyKind kind, const char* what) const;

  std::shared_ptr<Device> dev_;
  const cpumoe_executor_api* api_;
  cpumoe_executor* exec_;
  cpumoe_iob_header* hdr_;
  uint64_t dbase_ = 0;
  bool owned_ = false;
  uint64_t *ready_ = nullptr, *done_ = nullptr, *scratch_ = nullptr;
  bool signal_ = false;
  std::string signal_note_;
  Mechanism mech_ = MECH_NONE;
  uint32_t safe_ = 0;
  std::string report_[GPUSYNC_PATH_COUNT];
  ParamStore params_;
  mutable std::mutex ev_mu_;
  std::map<uint64_t, hipEvent_t> events_;  // one per task, alive as long as the block (graphs record them)
};

const char* path_name(int path);
}  // namespace gpusync
