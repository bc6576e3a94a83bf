// Device: current-device guard, capture status, bounded stream sync, memory and module services.
#include "device.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "gpusync/abi.h"

namespace gpusync {

Device::Device(int ordinal) : rt_(Runtime::get()), ordinal_(ordinal) {
  rt_.require();
  ErrorScope scope(rt_, "open HIP device");
  if (ordinal < 0 || ordinal >= rt_.device_count)
    throw Error(GPUSYNC_E_INVALID, "device " + std::to_string(ordinal) + " is not in [0, " +
                                       std::to_string(rt_.device_count) + ")");
  int a = 0;
  if (rt_.hipDeviceGetAttribute(&a, hipDeviceAttributeCanUseStreamWaitValue, ordinal) == hipSuccess)
    wait_value_attr_ = a != 0;
}

Device::Guard::Guard(const Device& d) : rt_(d.rt_) {
  int cur = -1;
  if (rt_.hipGetDevice(&cur) == hipSuccess && cur == d.ordinal_) return;
  rt_.check(rt_.hipSetDevice(d.ordinal_), "hipSetDevice(" + std::to_string(d.ordinal_) + ")");
  prev_ = cur;
}

Device::Guard::~Guard() {
  if (prev_ >= 0) rt_.hipSetDevice(prev_);
}

int Device::capture_status(hipStream_t s) const {
  hipStreamCaptureStatus st = hipStreamCaptureStatusNone;
  if (rt_.hipStreamIsCapturing(s, &st) != hipSuccess) return hipStreamCaptureStatusActive;
  return st;
}

std::string Device::capture_note(hipStream_t s) const {
  switch (capture_status(s)) {
    case hipStreamCaptureStatusActive:
      return " [stream is capturing: the graph would replay without this node, so the capture must be abandoned]";
    case hipStreamCaptureStatusInvalidated:
      return " [stream capture is invalidated]";
    default:
      return "";
  }
}

bool Device::sync(hipStream_t s, double timeout_s) const {
  ErrorScope scope(rt_, "stream sync");  // a runtime that records hipErrorNotReady must not leave it behind
  Guard g(*this);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (unsigned i = 0;; ++i) {
    const hipError_t rc = rt_.hipStreamQuery(s);
    if (rc == hipSuccess) return true;
    if (rc != hipErrorNotReady) rt_.fail(rc, "hipStreamQuery");
    if (std::chrono::steady_clock::now() > until) return false;
    if (i > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

uint64_t* Device::signal_alloc() const {
  Guard g(*this);
  if (!rt_.hipExtMallocWithFlags)
    throw Error(GPUSYNC_E_UNSUPPORTED, "the HIP runtime lacks hipExtMallocWithFlags (signal memory)");
  void* p = nullptr;
  rt_.check(rt_.hipExtMallocWithFlags(&p, sizeof(uint64_t), hipMallocSignalMemory),
            "hipExtMallocWithFlags(8 bytes, hipMallocSignalMemory)");
  auto* w = static_cast<uint64_t*>(p);
  __atomic_store_n(w, 0, __ATOMIC_RELEASE);  // fine-grained: the host writes it directly
  return w;
}

void Device::free(void* p) const {
  Guard g(*this);
  if (p) rt_.hipFree(p);
}

hipModule_t Device::module_load(const void* image) const {
  Guard g(*this);
  if (!rt_.has_modules()) throw Error(GPUSYNC_E_UNSUPPORTED, "the HIP runtime lacks the module entry points");
  hipModule_t m = nullptr;
  rt_.check(rt_.hipModuleLoadData(&m, image), "hipModuleLoadData");
  return m;
}

void Device::module_unload(hipModule_t m) const {
  Guard g(*this);
  rt_.check(rt_.hipModuleUnload(m), "hipModuleUnload");
}

hipFunction_t Device::function(hipModule_t m, const char* name) const {
  Guard g(*this);
  hipFunction_t f = nullptr;
  rt_.check(rt_.hipModuleGetFunction(&f, m, name), std::string("hipModuleGetFunction(") + name + ")");
  return f;
}

void Device::launch(hipFunction_t f, const unsigned grid[3], const unsigned block[3], unsigned smem, hipStream_t s,
                    void** args) const {
  Guard g(*this);
  const hipError_t rc = rt_.hipModuleLaunchKernel(f, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem,
                                                  s, args, nullptr);
  if (rc != hipSuccess) rt_.fail(rc, "hipModuleLaunchKernel", capture_note(s));
}

uint64_t Device::alloc(size_t bytes) const {
  Guard g(*this);
  void* p = nullptr;
  rt_.check(rt_.hipMalloc(&p, bytes), "hipMalloc(" + std::to_string(bytes) + " bytes)");
  return (uint64_t)(uintptr_t)p;
}

uint64_t Device::host_register(void* host, size_t bytes, bool* owned) const {
  Guard g(*this);
  // Mapped: the block gets a device address; ROCm's default host registration is
  // coherent (fine-grained) unless hipExtHostRegisterCoarseGrained is passed.
  const hipError_t rc = rt_.hipHostRegister(host, bytes, hipHostRegisterMapped | hipHostRegisterPortable);
  if (rc != hipSuccess && rc != hipErrorHostMemoryAlreadyRegistered)
    rt_.fail(rc, "hipHostRegister(" + std::to_string(bytes) + " bytes, Mapped|Portable)");
  *owned = rc == hipSuccess;
  void* d = nullptr;
  const hipError_t r2 = rt_.hipHostGetDevicePointer(&d, host, 0);
  if (r2 != hipSuccess) {
    if (*owned) rt_.hipHostUnregister(host);
    rt_.fail(r2, "hipHostGetDevicePointer");
  }
  return (uint64_t)(uintptr_t)d;
}

void Device::host_unregister(void* host) const {
  Guard g(*this);
  rt_.check(rt_.hipHostUnregister(host), "hipHostUnregister");
}

void Device::memcpy_async(uint64_t dst, uint64_t src, size_t bytes, hipMemcpyKind kind, hipStream_t s) const {
  Guard g(*this);
  const hipError_t rc = rt_.hipMemcpyAsync((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, bytes, kind, s);
  if (rc != hipSuccess) rt_.fail(rc, "hipMemcpyAsync(" + std::to_string(bytes) + " bytes)", capture_note(s));
}
}  // namespace gpusync
