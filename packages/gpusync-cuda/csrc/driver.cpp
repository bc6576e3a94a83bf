// Run-time loading of the CUDA driver (see driver.h for why).
#include "driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "gpusync/abi.h"

namespace gpusync {
namespace {
// cuGetProcAddress_v2 (12.0+): the symbolStatus out-parameter tells "not found"
// from "found but the requested version is newer than this driver".
using GetProc2 = CUresult (*)(const char*, void**, int, cuuint64_t, int*);
using GetProc1 = CUresult (*)(const char*, void**, int, cuuint64_t);  // 11.3 .. 11.8

struct Entry {
  const char* base;      // the name cuGetProcAddress takes
  const char* fallback;  // versioned export, for drivers without cuGetProcAddress(_v2)
  void** slot;
  bool required;
};

template <class F>
void** slot(F& f) {
  return reinterpret_cast<void**>(&f);
}

void load(Driver& d) {
  const char* env = std::getenv("GPUSYNC_LIBCUDA");
  d.library = env && *env ? env : "libcuda.so.1";
  // RTLD_LOCAL: our symbols never interpose on another copy's; a driver torch
  // already loaded is the same mapping (same soname), so contexts are shared.
  void* h = dlopen(d.library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    d.error = "no CUDA driver: dlopen(\"" + d.library + "\") failed: " + (e ? e : "?") +
              " (install the NVIDIA driver, or use the eager path)";
    return;
  }
  auto* get_version = reinterpret_cast<CUresult (*)(int*)>(dlsym(h, "cuDriverGetVersion"));
  if (!get_version || get_version(&d.driver_version) != SUCCESS) {
    d.error = "no CUDA driver: " + d.library + " has no working cuDriverGetVersion";
    return;
  }
  auto* gp2 = reinterpret_cast<GetProc2>(dlsym(h, "cuGetProcAddress_v2"));
  auto* gp1 = reinterpret_cast<GetProc1>(dlsym(h, "cuGetProcAddress"));
  const int ver = d.driver_version >= kApiVersion ? kApiVersion : d.driver_version;
  if (gp2 && d.driver_version >= kApiVersion)
    d.resolver = "cuGetProcAddress_v2(cudaVersion=" + std::to_string(ver) + ")";
  else if (gp1)
    d.resolver = "cuGetProcAddress(cudaVersion=" + std::to_string(ver) + ") + dlsym of _v2 memops", gp2 = nullptr;
  else
    d.resolver = "dlsym of versioned names", gp2 = nullptr;

  const Entry entries[] = {
      {"cuInit", "cuInit", slot(d.cuInit), true},
      {"cuDriverGetVersion", "cuDriverGetVersion", slot(d.cuDriverGetVersion), true},
      {"cuGetErrorName", "cuGetErrorName", slot(d.cuGetErrorName), true},
      {"cuGetErrorString", "cuGetErrorString", slot(d.cuGetErrorString), true},
      {"cuDeviceGet", "cuDeviceGet", slot(d.cuDeviceGet), true},
      {"cuDeviceGetCount", "cuDeviceGetCount", slot(d.cuDeviceGetCount), true},
      {"cuDeviceGetName", "cuDeviceGetName", slot(d.cuDeviceGetName), true},
      {"cuDeviceGetAttribute", "cuDeviceGetAttribute", slot(d.cuDeviceGetAttribute), true},
      {"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", slot(d.cuDevicePrimaryCtxRetain), true},
      {"cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", slot(d.cuDevicePrimaryCtxRelease), true},
      {"cuCtxGetCurrent", "cuCtxGetCurrent", slot(d.cuCtxGetCurrent), true},
      {"cuCtxPushCurrent", "cuCtxPushCurrent_v2", slot(d.cuCtxPushCurrent), true},
      {"cuCtxPopCurrent", "cuCtxPopCurrent_v2", slot(d.cuCtxPopCurrent), true},
      {"cuMemHostRegister", "cuMemHostRegister_v2", slot(d.cuMemHostRegister), true},
      {"cuMemHostUnregister", "cuMemHostUnregister", slot(d.cuMemHostUnregister), true},
      {"cuMemHostGetDevicePointer", "cuMemHostGetDevicePointer_v2", slot(d.cuMemHostGetDevicePointer), true},
      {"cuMemAlloc", "cuMemAlloc_v2", slot(d.cuMemAlloc), true},
      {"cuMemFree", "cuMemFree_v2", slot(d.cuMemFree), true},
      {"cuMemcpyAsync", "cuMemcpyAsync", slot(d.cuMemcpyAsync), true},
      {"cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2", slot(d.cuMemcpyDtoHAsync), true},
      {"cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2", slot(d.cuMemcpyHtoDAsync), true},
      {"cuStreamCreate", "cuStreamCreate", slot(d.cuStreamCreate), true},
      {"cuStreamDestroy", "cuStreamDestroy_v2", slot(d.cuStreamDestroy), true},
      {"cuStreamQuery", "cuStreamQuery", slot(d.cuStreamQuery), true},
      {"cuStreamSynchronize", "cuStreamSynchronize", slot(d.cuStreamSynchronize), true},
      {"cuStreamIsCapturing", "cuStreamIsCapturing", slot(d.cuStreamIsCapturing), true},
      {"cuEventCreate", "cuEventCreate", slot(d.cuEventCreate), true},
      {"cuEventDestroy", "cuEventDestroy_v2", slot(d.cuEventDestroy), true},
      {"cuEventRecord", "cuEventRecord", slot(d.cuEventRecord), true},
      {"cuStreamWaitEvent", "cuStreamWaitEvent", slot(d.cuStreamWaitEvent), true},
      // v2 memops only; never the unsuffixed (v1) export.
      {"cuStreamWriteValue64", "cuStreamWriteValue64_v2", slot(d.cuStreamWriteValue64), false},
      {"cuStreamWaitValue64", "cuStreamWaitValue64_v2", slot(d.cuStreamWaitValue64), false},
      {"cuLaunchHostFunc", "cuLaunchHostFunc", slot(d.cuLaunchHostFunc), false},
      {"cuStreamBeginCapture", "cuStreamBeginCapture_v2", slot(d.cuStreamBeginCapture), false},
      {"cuStreamEndCapture", "cuStreamEndCapture", slot(d.cuStreamEndCapture), false},
      {"cuGraphInstantiateWithFlags", "cuGraphInstantiateWithFlags", slot(d.cuGraphInstantiateWithFlags), false},
      {"cuGraphLaunch", "cuGraphLaunch", slot(d.cuGraphLaunch), false},
      {"cuGraphExecDestroy", "cuGraphExecDestroy", slot(d.cuGraphExecDestroy), false},
      {"cuGraphDestroy", "cuGraphDestroy", slot(d.cuGraphDestroy), false},
      {"cuGraphGetNodes", "cuGraphGetNodes", slot(d.cuGraphGetNodes), false},
      {"cuGraphNodeGetType", "cuGraphNodeGetType", slot(d.cuGraphNodeGetType), false},
      {"cuModuleLoadData", "cuModuleLoadData", slot(d.cuModuleLoadData), false},
      {"cuModuleUnload", "cuModuleUnload", slot(d.cuModuleUnload), false},
      {"cuModuleGetFunction", "cuModuleGetFunction", slot(d.cuModuleGetFunction), false},
      {"cuLaunchKernel", "cuLaunchKernel", slot(d.cuLaunchKernel), false},
  };
  std::string missing_required;
  for (const Entry& e : entries) {
    void* p = nullptr;
    const bool memop = std::string(e.base).rfind("cuStreamW", 0) == 0;
    if (gp2) {
      int status = -1;
      if (gp2(e.base, &p, ver, GET_PROC_ADDRESS_DEFAULT, &status) != SUCCESS || status != PROC_ADDRESS_SUCCESS)
        p = nullptr;  // check pfn and status, not just the return code
    } else if (gp1 && !memop) {
      if (gp1(e.base, &p, ver, GET_PROC_ADDRESS_DEFAULT) != SUCCESS) p = nullptr;
    } else if (!memop || d.driver_version >= kMinMemopDriver) {
      p = dlsym(h, e.fallback);  // the explicitly versioned export
    }
    *e.slot = p;
    if (!p) {
      if (e.required)
        missing_required += std::string(missing_required.empty() ? "" : ", ") + e.base;
      else
        d.missing.push_back(e.base);
    }
  }
  if (!missing_required.empty()) {
    d.error = "CUDA driver " + std::to_string(d.driver_version) + " (" + d.library + ") lacks " + missing_required;
    return;
  }
  d.loaded = true;
  const CUresult rc = d.cuInit(0);
  if (rc != SUCCESS) {
    d.error = "no usable CUDA device: cuInit(0) failed: " + d.name(rc);
    return;
  }
  d.initialized = true;
}
}  // namespace

std::string Driver::name(CUresult rc) const {
  const char* n = nullptr;
  const char* s = nullptr;
  if (cuGetErrorName) cuGetErrorName(rc, &n);
  if (cuGetErrorString) cuGetErrorString(rc, &s);
  std::string out = n ? n : ("CUresult " + std::to_string(rc));
  if (s) out += std::string(" (") + s + ")";
  return out;
}

void Driver::fail(CUresult rc, const std::string& op, const std::string& note) const {
  throw Error(rc, op + " failed: " + name(rc) + note);
}

void Driver::require() const {
  if (!loaded || !initialized) throw Error(GPUSYNC_E_NO_DRIVER, error);
}

const Driver& Driver::get() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] { load(d); });
  return d;
}
}  // namespace gpusync
