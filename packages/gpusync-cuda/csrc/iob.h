// One executor's IO block on one device: registration, the doorbell on a
// stream (memop or host-function path), the copy step, and which paths a probe
// proved replay-safe.
#pragma once
#include <memory>
#include <mutex>
#include <string>

#include "cpumoe_executor/abi.h"
#include "device.h"
#include "gpusync/abi.h"

namespace gpusync {

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
  // Copy path: D2H x/ids/w, submit, wait, H2D y (device pointers, contiguous rows).
  void step(int path, CUstream s, uint32_t layer, uint32_t T, CUdeviceptr x, CUdeviceptr ids, CUdeviceptr w,
            CUdeviceptr y);
  // Bounded: on timeout, releases the stream (done := SHUTDOWN) and returns false.
  bool sync(CUstream s, double timeout_s);

  bool replay_safe(int path) const { return path >= 0 && path < GPUSYNC_PATH_COUNT && (safe_ & (1u << path)); }
  void set_replay_safe(int path, bool on);
  std::string& report(int path) {
    if (path < 0 || path >= GPUSYNC_PATH_COUNT) throw Error(GPUSYNC_E_INVALID, "no such path");
    return report_[path];
  }

  // The executor's host-function argument for (layer, T) (stable address).
  cpumoe_hostfn_arg* hostfn_arg(uint32_t layer, uint32_t T) const;

 private:
  void check_task(uint32_t layer, uint32_t T) const;
  // Refuses capture for a path no probe proved (fail closed); notes the capture state.
  void guard_capture(int path, CUstream s, const char* op) const;

  std::shared_ptr<Device> dev_;
  const cpumoe_executor_api* api_;
  cpumoe_executor* exec_;
  cpumoe_iob_header* hdr_;
  CUdeviceptr dbase_ = 0;
  bool owned_ = false;
  uint32_t safe_ = 0;
  std::string report_[GPUSYNC_PATH_COUNT];
};

const char* path_name(int path);
}  // namespace gpusync
