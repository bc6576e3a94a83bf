// The exported C ABI table (gpusync/abi.h, backend "cuda"): the wrappers are
// gpusync/backend_capi.h, shared with gpusync-hip; this file says what is CUDA.
#include "capi.h"
#include "probe.h"
// after the backend headers: it uses their Device, Iob, Error, probe
#include "gpusync/backend_capi.h"

#ifndef GPUSYNC_BUILD_INFO
#define GPUSYNC_BUILD_INFO "gpusync-cuda unknown build"
#endif

namespace gpusync {
namespace {
struct CudaBackend {
  using Stream = CUstream;
  using Module = CUmodule;
  using Function = CUfunction;
  static constexpr const char* kName = "cuda";
  static constexpr const char* kBuildInfo = GPUSYNC_BUILD_INFO;
  // Driver calls report their own errors: no scope, and the device handle is
  // only resolved by the call itself (stream_sync on an IO block needs none).
  template <class Dev, class F>
  static void in_device_scope(Dev&&, const char*, F& f) {
    f();
  }
  static void mem_free(Device& d, uint64_t p) { d.free(p); }
  static void memcpy_async(Device& d, uint64_t dst, uint64_t src, size_t n, CUstream s) {
    d.memcpy_async(dst, src, n, s);
  }
};
using Capi = BackendCapi<CudaBackend>;
}  // namespace

const gpusync_api* api() { return &Capi::kTable; }
std::shared_ptr<Device> device_of(gpusync_device* d) { return d->dev; }
gpusync_device* wrap_device(std::shared_ptr<Device> d) { return new gpusync_device{std::move(d)}; }
Iob* iob_of(gpusync_iob* b) { return b->iob.get(); }
}  // namespace gpusync
