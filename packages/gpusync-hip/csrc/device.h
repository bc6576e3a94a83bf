// One HIP device: made current (hipSetDevice) around every call and restored
// after, capture status, bounded stream sync, signal memory, module and memory
// services for kernelio. HIP has no context to retain: the device ordinal is
// what torch shares with us.
#pragma once
#include <string>

#include "runtime.h"

namespace gpusync {

class Device {
 public:
  explicit Device(int ordinal);
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  // Makes the device current unless it already is; restores the previous one.
  class Guard {
   public:
    explicit Guard(const Device& d);
    ~Guard();

   private:
    const Runtime& rt_;
    int prev_ = -1;
  };

  const Runtime& rt() const { return rt_; }
  int ordinal() const { return ordinal_; }
  bool wait_value_attr() const { return wait_value_attr_; }  // hipDeviceAttributeCanUseStreamWaitValue

  // 0 none, 1 active, 2 invalidated. A failed query counts as "active" (the
  // legacy stream while another stream captures): never enqueue blindly.
  int capture_status(hipStream_t s) const;
  std::string capture_note(hipStream_t s) const;
  // Poll hipStreamQuery until the stream drains or timeout_s passes; false on timeout.
  bool sync(hipStream_t s, double timeout_s) const;

  // 8 bytes of signal memory (hipExtMallocWithFlags(hipMallocSignalMemory)): the
  // only memory ROCm documents for hipStreamWaitValue64; host-accessible at the
  // same address. Zeroed.
  uint64_t* signal_alloc() const;
  void free(void* p) const;

  hipModule_t module_load(const void* image) const;
  void module_unload(hipModule_t m) const;
  hipFunction_t function(hipModule_t m, const char* name) const;
  void launch(hipFunction_t f, const unsigned grid[3], const unsigned block[3], unsigned smem, hipStream_t s,
              void** args) const;
  uint64_t alloc(size_t bytes) const;
  // hipHostRegister(Mapped); returns the device address. *owned is false when the
  // range was already registered (someone else unregisters it).
  uint64_t host_register(void* host, size_t bytes, bool* owned) const;
  void host_unregister(void* host) const;
  void memcpy_async(uint64_t dst, uint64_t src, size_t bytes, hipMemcpyKind kind, hipStream_t s) const;

 private:
  const Runtime& rt_;
  int ordinal_;
  bool wait_value_attr_ = false;
};
}  // namespace gpusync
