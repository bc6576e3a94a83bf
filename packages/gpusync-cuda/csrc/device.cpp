// Device: primary context, capture status, bounded stream sync, module and memory services.
#include "device.h"

#include <chrono>
#include <thread>

#include "gpusync/abi.h"

namespace gpusync {

Device::Device(int ordinal) : drv_(Driver::get()), ordinal_(ordinal) {
  drv_.require();
  int n = 0;
  drv_.check(drv_.cuDeviceGetCount(&n), "cuDeviceGetCount");
  if (ordinal < 0 || ordinal >= n)
    throw Error(GPUSYNC_E_INVALID, "device " + std::to_string(ordinal) + " is not in [0, " + std::to_string(n) + ")");
  drv_.check(drv_.cuDeviceGet(&dev_, ordinal), "cuDeviceGet");
  drv_.check(drv_.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
  char buf[256] = {0};
  drv_.cuDeviceGetName(buf, sizeof buf - 1, dev_);
  name_ = buf;
  drv_.cuDeviceGetAttribute(&cc_major_, ATTR_CC_MAJOR, dev_);
  drv_.cuDeviceGetAttribute(&cc_minor_, ATTR_CC_MINOR, dev_);
  int a = 0;
  // 122, not the legacy 92: the v2 memops need no module parameter (notes 1.2).
  if (drv_.cuDeviceGetAttribute(&a, ATTR_64_BIT_STREAM_MEM_OPS, dev_) == SUCCESS) memops64_ = a && drv_.has_memops();
  if (drv_.cuDeviceGetAttribute(&a, ATTR_HOST_POINTER_FOR_REGISTERED_MEM, dev_) == SUCCESS) hostptr_registered_ = a;
}

Device::~Device() {
  if (ctx_) drv_.cuDevicePrimaryCtxRelease(dev_);
}

Device::Guard::Guard(const Device& d) : drv_(d.drv_) {
  CUcontext cur = nullptr;
  drv_.cuCtxGetCurrent(&cur);
  if (cur != d.ctx_) {
    drv_.check(drv_.cuCtxPushCurrent(d.ctx_), "cuCtxPushCurrent(primary context of device " +
                                                   std::to_string(d.ordinal_) + ")");
    pushed_ = true;
  }
}

Device::Guard::~Guard() {
  if (pushed_) {
    CUcontext c = nullptr;
    drv_.cuCtxPopCurrent(&c);
  }
}

int Device::capture_status(CUstream s) const {
  Guard g(*this);
  int st = CAPTURE_STATUS_NONE;
  const CUresult rc = drv_.cuStreamIsCapturing(s, &st);
  // CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: the legacy stream while another captures.
  if (rc != SUCCESS) return CAPTURE_STATUS_ACTIVE;
  return st;
}

std::string Device::capture_note(CUstream s) const {
  switch (capture_status(s)) {
    case CAPTURE_STATUS_ACTIVE:
      return " [stream is capturing: without this node the graph would replay without it, so the capture must "
             "be abandoned]";
    case CAPTURE_STATUS_INVALIDATED:
      return " [stream capture is invalidated]";
    default:
      return "";
  }
}

bool Device::sync(CUstream s, double timeout_s) const {
  Guard g(*this);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (unsigned i = 0;; ++i) {
    const CUresult rc = drv_.cuStreamQuery(s);
    if (rc == SUCCESS) return true;
    if (rc != ERROR_NOT_READY) drv_.fail(rc, "cuStreamQuery");
    if (std::chrono::steady_clock::now() > until) return false;
    if (i > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

CUmodule Device::module_load(const void* image) const {
  Guard g(*this);
  if (!drv_.has_modules()) throw Error(GPUSYNC_E_UNSUPPORTED, "the CUDA driver lacks the module entry points");
  CUmodule m = nullptr;
  drv_.check(drv_.cuModuleLoadData(&m, image), "cuModuleLoadData");
  return m;
}

void Device::module_unload(CUmodule m) const {
  Guard g(*this);
  drv_.check(drv_.cuModuleUnload(m), "cuModuleUnload");
}

CUfunction Device::function(CUmodule m, const char* name) const {
  Guard g(*this);
  CUfunction f = nullptr;
  drv_.check(drv_.cuModuleGetFunction(&f, m, name), std::string("cuModuleGetFunction(") + name + ")");
  return f;
}

void Device::launch(CUfunction f, const unsigned grid[3], const unsigned block[3], unsigned smem, CUstream s,
                    void** args) const {
  Guard g(*this);
  const CUresult rc = drv_.cuLaunchKernel(f, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem, s, args,
                                          nullptr);
  if (rc != SUCCESS) drv_.fail(rc, "cuLaunchKernel", capture_note(s));
}

CUdeviceptr Device::alloc(size_t bytes) const {
  Guard g(*this);
  CUdeviceptr p = 0;
  drv_.check(drv_.cuMemAlloc(&p, bytes), "cuMemAlloc(" + std::to_string(bytes) + " bytes)");
  return p;
}

void Device::free(CUdeviceptr p) const {
  Guard g(*this);
  if (p) drv_.cuMemFree(p);
}

CUdeviceptr Device::host_register(void* host, size_t bytes, bool* owned) const {
  Guard g(*this);
  // PORTABLE: every context sees it as pinned; DEVICEMAP: it has a device address.
  const CUresult rc = drv_.cuMemHostRegister(host, bytes, MEMHOSTREGISTER_DEVICEMAP | MEMHOSTREGISTER_PORTABLE);
  if (rc != SUCCESS && rc != ERROR_HOST_MEMORY_ALREADY_REGISTERED)
    drv_.fail(rc, "cuMemHostRegister(" + std::to_string(bytes) + " bytes, DEVICEMAP|PORTABLE)");
  *owned = rc == SUCCESS;
  CUdeviceptr d = 0;
  const CUresult r2 = drv_.cuMemHostGetDevicePointer(&d, host, 0);
  if (r2 != SUCCESS) {
    if (*owned) drv_.cuMemHostUnregister(host);
    drv_.fail(r2, "cuMemHostGetDevicePointer");
  }
  return d;
}

void Device::host_unregister(void* host) const {
  Guard g(*this);
  drv_.check(drv_.cuMemHostUnregister(host), "cuMemHostUnregister");
}

void Device::memcpy_async(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) const {
  Guard g(*this);
  const CUresult rc = drv_.cuMemcpyAsync(dst, src, bytes, s);
  if (rc != SUCCESS) drv_.fail(rc, "cuMemcpyAsync(" + std::to_string(bytes) + " bytes)", capture_note(s));
}
}  // namespace gpusync
