// The exported C ABI table (gpusync/abi.h, backend "hip"): the wrappers are
// gpusync-cuda's gpusync/backend_capi.h; this file says what is HIP.
#include "capi.h"
#include "probe.h"
// after the backend headers: it uses their Device, Iob, Error, probe
#include "gpusync/backend_capi.h"

#ifndef GPUSYNC_BUILD_INFO
#define GPUSYNC_BUILD_INFO "gpusync-hip unknown build"
#endif

namespace gpusync {
namespace {
struct HipBackend {
  using Stream = hipStream_t;
  using Module = hipModule_t;
  using Function = hipFunction_t;
  static constexpr const char* kName = "hip";
  static constexpr const char* kBuildInfo = GPUSYNC_BUILD_INFO;
  // Device services run in the error scope too: a caller's pending error is
  // raised, the errors they cause are consumed after being reported.
  template <class Dev, class F>
  static void in_device_scope(Dev&& dev, const char* op, F& f) {
    ErrorScope scope(dev().rt(), op);
    f();
  }
  static void mem_free(Device& d, uint64_t p) { d.free((void*)(uintptr_t)p); }
  static void memcpy_async(Device& d, uint64_t dst, uint64_t src, size_t n, hipStream_t s) {
    d.memcpy_async(dst, src, n, hipMemcpyDefault, s);
  }
};
using Capi = BackendCapi<HipBackend>;
}  // namespace

const gpusync_api* api() { return &Capi::kTable; }
std::shared_ptr<Device> device_of(gpusync_device* d) { return d->dev; }
Iob* iob_of(gpusync_iob* b) { return b->iob.get(); }
}  // namespace gpusync
