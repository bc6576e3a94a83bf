// One device's primary context (the one torch and cupy use, never a context
// of our own: memory and streams must be shared), plus the driver services
// kernelio needs. Every method makes the context current for its duration.
#pragma once
#include <string>

#include "driver.h"

namespace gpusync {

class Device {
 public:
  explicit Device(int ordinal);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // Push the primary context unless it is already current (torch usually made
  // it current on this thread; then this costs one cuCtxGetCurrent).
  class Guard {
   public:
    explicit Guard(const Device& d);
    ~Guard();

   private:
    const Driver& drv_;
    bool pushed_ = false;
  };

  const Driver& drv() const { return drv_; }
  int ordinal() const { return ordinal_; }
  const std::string& name() const { return name_; }
  int cc() const { return cc_major_ * 10 + cc_minor_; }
  bool memops64() const { return memops64_; }  // attribute 122 and the v2 entries resolved
  bool hostptr_registered() const { return hostptr_registered_; }

  // 0 none, 1 active, 2 invalidated. The legacy NULL stream cannot be asked
  // while another stream captures globally; that answer counts as "active".
  int capture_status(CUstream s) const;
  // Appended to error messages: whether the failure happened during capture.
  std::string capture_note(CUstream s) const;

  // Poll until the stream drains or timeout_s passes; returns false on timeout.
  bool sync(CUstream s, double timeout_s) const;

  CUmodule module_load(const void* image) const;
  void module_unload(CUmodule m) const;
  CUfunction function(CUmodule m, const char* name) const;
  void launch(CUfunction f, const unsigned grid[3], const unsigned block[3], unsigned smem, CUstream s,
              void** args) const;
  CUdeviceptr alloc(size_t bytes) const;
  void free(CUdeviceptr p) const;
  // Register (page-locked, DEVICEMAP|PORTABLE); returns its device address.
  // *owned is false when the range was already registered (someone else unregisters it).
  CUdeviceptr host_register(void* host, size_t bytes, bool* owned) const;
  void host_unregister(void* host) const;
  void memcpy_async(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) const;

 private:
  const Driver& drv_;
  int ordinal_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
  std::string name_;
  int cc_major_ = 0, cc_minor_ = 0;
  bool memops64_ = false, hostptr_registered_ = false;
  friend class Guard;
};
}  // namespace gpusync
