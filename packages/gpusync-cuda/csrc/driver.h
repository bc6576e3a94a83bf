// The CUDA driver, loaded at run time: dlopen("libcuda.so.1") and every entry
// point resolved through the versioned query cuGetProcAddress(_v2) at
// cu::kApiVersion, never by plain dlsym of an unsuffixed name (cuda.h maps
// e.g. cuStreamWriteValue64 to the _v2 ABI with a macro; the unsuffixed
// export is the legacy v1 entry that fails without NVreg_EnableStreamMemOPs).
// Nothing links libcuda or cudart: the module imports on a machine without a
// driver and reports why the GPU paths are unavailable.
#pragma once
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_types.h"

namespace gpusync {
using namespace cu;

// A failed GPU operation: the operation, the CUresult and its name.
struct Error : std::runtime_error {
  int code;
  Error(int c, const std::string& msg) : std::runtime_error(msg), code(c) {}
};

struct Driver {
  // ---- status ----
  bool loaded = false;     // library opened and the required entries resolved
  bool initialized = false;  // cuInit(0) succeeded
  std::string error;       // why not, when !loaded or !initialized
  std::string library;     // what was dlopen'd
  std::string resolver;    // e.g. "cuGetProcAddress_v2(cudaVersion=12000)"
  int driver_version = 0;  // cuDriverGetVersion
  std::vector<std::string> missing;  // optional entries the driver lacks

  // ---- entry points (the ABI of cu::kApiVersion) ----
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*cuMemHostRegister)(void*, size_t, unsigned) = nullptr;
  CUresult (*cuMemHostUnregister)(void*) = nullptr;
  CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr*, void*, unsigned) = nullptr;
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*cuStreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*cuStreamDestroy)(CUstream) = nullptr;
  CUresult (*cuStreamQuery)(CUstream) = nullptr;
  CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
  CUresult (*cuStreamIsCapturing)(CUstream, int*) = nullptr;
  // the copy step's fork/join (side streams ordered by events; under capture they become graph edges)
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned) = nullptr;
  // optional: memop path
  CUresult (*cuStreamWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned) = nullptr;
  CUresult (*cuStreamWaitValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned) = nullptr;
  // optional: host-function path
  CUresult (*cuLaunchHostFunc)(CUstream, CUhostFn, void*) = nullptr;
  // optional: graphs (probe)
  CUresult (*cuStreamBeginCapture)(CUstream, int) = nullptr;
  CUresult (*cuStreamEndCapture)(CUstream, CUgraph*) = nullptr;
  CUresult (*cuGraphInstantiateWithFlags)(CUgraphExec*, CUgraph, unsigned long long) = nullptr;
  CUresult (*cuGraphLaunch)(CUgraphExec, CUstream) = nullptr;
  CUresult (*cuGraphExecDestroy)(CUgraphExec) = nullptr;
  CUresult (*cuGraphDestroy)(CUgraph) = nullptr;
  CUresult (*cuGraphGetNodes)(CUgraph, CUgraphNode*, size_t*) = nullptr;
  CUresult (*cuGraphNodeGetType)(CUgraphNode, int*) = nullptr;
  // optional: modules (kernelio)
  CUresult (*cuModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*cuModuleUnload)(CUmodule) = nullptr;
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**) = nullptr;

  bool has_memops() const { return cuStreamWriteValue64 && cuStreamWaitValue64; }
  bool has_graphs() const {
    return cuStreamBeginCapture && cuStreamEndCapture && cuGraphInstantiateWithFlags && cuGraphLaunch &&
           cuGraphExecDestroy && cuGraphDestroy;
  }
  bool has_modules() const { return cuModuleLoadData && cuModuleUnload && cuModuleGetFunction && cuLaunchKernel; }

  // "CUDA_ERROR_INVALID_VALUE (invalid argument)"
  std::string name(CUresult rc) const;
  // Throws Error("<op> failed: <name>") unless rc == 0.
  void check(CUresult rc, const std::string& op) const {
    if (rc != SUCCESS) fail(rc, op);
  }
  // note: appended after the error name (e.g. the stream's capture state).
  [[noreturn]] void fail(CUresult rc, const std::string& op, const std::string& note = "") const;
  // Throws Error(GPUSYNC_E_NO_DRIVER) with the reason unless usable.
  void require() const;

  // The process-wide driver, loaded on first use. GPUSYNC_LIBCUDA overrides the
  // library name (tests use it to prove the no-driver path on a GPU machine).
  static const Driver& get();
};
}  // namespace gpusync
