// libhip_on_cuda.so: the HIP entry points gpusync-hip resolves (GPUSYNC_HIP_ENTRY_POINTS
// in csrc/hip_types.h, signatures checked against that header below), implemented on
// the CUDA driver API, so gpusync-hip's control logic (probe, splice, rollback, release
// event, copy step) runs against a real GPU and real graph replay on an NVIDIA machine.
// Tests load it with GPUSYNC_HIP_LIBRARY=/path/libhip_on_cuda.so.
//
// libcuda.so.1 is dlopen'd (HIPSHIM_LIBCUDA overrides) and every entry point is
// resolved through cuGetProcAddress_v2 at the CUDA 12.0 ABI, as gpusync-cuda's
// driver.cpp does; nothing links libcuda or cudart, so this builds with g++ and no
// CUDA toolkit. Everything runs in the primary context of device 0 (made current on
// every call, on whatever thread calls).
//
// HIPSHIM_MODE:
//   native (default)  memops on a capturing stream are recorded by CUDA's capture
//                     (what HIP >= 10 does); hipRuntimeGetVersion reports 10.0.
//   eager-capture     ROCm < 10: a hipStreamWrite/WaitValue64 on a capturing stream is
//                     executed at once, outside the capture, and NOT recorded: a write
//                     is stored from the host (signal memory and registered memory are
//                     host-accessible) or, for device memory, enqueued on a side stream;
//                     a wait only checks its condition once (never blocks, never hangs a
//                     test). No CUDA call that could invalidate the capture is made.
//                     hipRuntimeGetVersion reports 7.2 (batch-memop nodes and
//                     hipEventRecordWithFlags exist, memops are not captured).
// HIPSHIM_VERSION overrides the reported version (HIP_VERSION encoding).
// hipshim_stats() reports what happened (tests assert which mechanism really ran).
#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>

#include "cuda_extra.h"  // cuda_types.h (gpusync-cuda/csrc) + the structs and flags it lacks
#include "hip_types.h"   // gpusync-hip/csrc: every HIP type, constant and entry-point signature

using namespace gpusync::hip;

namespace {
using namespace hipshim;
using cu::CUresult;
using cu::CUstream;
using cu::CUdeviceptr;

// ---- the CUDA driver, loaded once ----------------------------------------------------------
struct Cuda {
  bool ok = false;
  std::string error;
  cu::CUcontext ctx = nullptr;
  cu::CUdevice dev = 0;
  CUstream side = nullptr;  // eager-capture mode: where device-memory memops run outside the capture
  bool eager_capture = false;
  int version = 100000000;
#define CU_FN(ret, name, ...) ret (*name)(__VA_ARGS__) = nullptr;
#define CUDA_ENTRIES(X)                                                                                        \
  X(CUresult, cuInit, unsigned)                                                                                \
  X(CUresult, cuDriverGetVersion, int*)                                                                        \
  X(CUresult, cuGetErrorName, CUresult, const char**)                                                          \
  X(CUresult, cuGetErrorString, CUresult, const char**)                                                        \
  X(CUresult, cuDeviceGet, cu::CUdevice*, int)                                                                 \
  X(CUresult, cuDeviceGetCount, int*)                                                                          \
  X(CUresult, cuDeviceGetAttribute, int*, int, cu::CUdevice)                                                   \
  X(CUresult, cuDevicePrimaryCtxRetain, cu::CUcontext*, cu::CUdevice)                                          \
  X(CUresult, cuCtxGetCurrent, cu::CUcontext*)                                                                 \
  X(CUresult, cuCtxSetCurrent, cu::CUcontext)                                                                  \
  X(CUresult, cuStreamCreate, CUstream*, unsigned)                                                             \
  X(CUresult, cuStreamDestroy, CUstream)                                                                       \
  X(CUresult, cuStreamSynchronize, CUstream)                                                                   \
  X(CUresult, cuStreamQuery, CUstream)                                                                         \
  X(CUresult, cuStreamIsCapturing, CUstream, int*)                                                             \
  X(CUresult, cuStreamBeginCapture, CUstream, int)                                                             \
  X(CUresult, cuStreamEndCapture, CUstream, cu::CUgraph*)                                                      \
  X(CUresult, cuStreamGetCaptureInfo, CUstream, int*, uint64_t*, cu::CUgraph*, const cu::CUgraphNode**,        \
    size_t*)                                                                                                   \
  X(CUresult, cuStreamUpdateCaptureDependencies, CUstream, cu::CUgraphNode*, size_t, unsigned)                 \
  X(CUresult, cuStreamWriteValue64, CUstream, CUdeviceptr, uint64_t, unsigned)                                 \
  X(CUresult, cuStreamWaitValue64, CUstream, CUdeviceptr, uint64_t, unsigned)                                  \
  X(CUresult, cuMemAlloc, CUdeviceptr*, size_t)                                                                \
  X(CUresult, cuMemFree, CUdeviceptr)                                                                          \
  X(CUresult, cuMemHostAlloc, void**, size_t, unsigned)                                                        \
  X(CUresult, cuMemFreeHost, void*)                                                                            \
  X(CUresult, cuMemHostRegister, void*, size_t, unsigned)                                                      \
  X(CUresult, cuMemHostUnregister, void*)                                                                      \
  X(CUresult, cuMemHostGetDevicePointer, CUdeviceptr*, void*, unsigned)                                        \
  X(CUresult, cuPointerGetAttribute, void*, int, CUdeviceptr)                                                  \
  X(CUresult, cuMemcpyAsync, CUdeviceptr, CUdeviceptr, size_t, CUstream)                                       \
  X(CUresult, cuGraphCreate, cu::CUgraph*, unsigned)                                                           \
  X(CUresult, cuGraphInstantiateWithFlags, cu::CUgraphExec*, cu::CUgraph, unsigned long long)                  \
  X(CUresult, cuGraphLaunch, cu::CUgraphExec, CUstream)                                                        \
  X(CUresult, cuGraphExecDestroy, cu::CUgraphExec)                                                             \
  X(CUresult, cuGraphDestroy, cu::CUgraph)                                                                     \
  X(CUresult, cuGraphDestroyNode, cu::CUgraphNode)                                                             \
  X(CUresult, cuGraphGetNodes, cu::CUgraph, cu::CUgraphNode*, size_t*)                                         \
  X(CUresult, cuGraphNodeGetType, cu::CUgraphNode, int*)                                                       \
  X(CUresult, cuGraphAddBatchMemOpNode, cu::CUgraphNode*, cu::CUgraph, const cu::CUgraphNode*, size_t,         \
    const CuBatchMemOpNodeParams*)                                                                             \
  X(CUresult, cuGraphAddHostNode, cu::CUgraphNode*, cu::CUgraph, const cu::CUgraphNode*, size_t,               \
    const CuHostNodeParams*)                                                                                   \
  X(CUresult, cuEventCreate, CUevent*, unsigned)                                                               \
  X(CUresult, cuEventRecord, CUevent, CUstream)                                                                \
  X(CUresult, cuEventRecordWithFlags, CUevent, CUstream, unsigned)                                             \
  X(CUresult, cuEventDestroy, CUevent)                                                                         \
  X(CUresult, cuEventSynchronize, CUevent)                                                                     \
  X(CUresult, cuLaunchHostFunc, CUstream, void (*)(void*), void*)                                              \
  X(CUresult, cuModuleLoadData, cu::CUmodule*, const void*)                                                    \
  X(CUresult, cuModuleUnload, cu::CUmodule)                                                                    \
  X(CUresult, cuModuleGetFunction, cu::CUfunction*, cu::CUmodule, const char*)                                 \
  X(CUresult, cuLaunchKernel, cu::CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,      \
    unsigned, CUstream, void**, void**)
  CUDA_ENTRIES(CU_FN)
};

// Versioned exports for drivers whose cuGetProcAddress_v2 does not know a name at 12.0.
const char* fallback_name(const char* base) {
  static const char* const pairs[][2] = {
      {"cuStreamDestroy", "cuStreamDestroy_v2"},       {"cuStreamBeginCapture", "cuStreamBeginCapture_v2"},
      {"cuStreamGetCaptureInfo", "cuStreamGetCaptureInfo_v2"},
      {"cuStreamWriteValue64", "cuStreamWriteValue64_v2"}, {"cuStreamWaitValue64", "cuStreamWaitValue64_v2"},
      {"cuMemAlloc", "cuMemAlloc_v2"},                 {"cuMemFree", "cuMemFree_v2"},
      {"cuMemHostRegister", "cuMemHostRegister_v2"},   {"cuMemHostGetDevicePointer", "cuMemHostGetDevicePointer_v2"},
      {"cuEventDestroy", "cuEventDestroy_v2"},         {"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain"}};
  for (auto& p : pairs)
    if (!std::strcmp(p[0], base)) return p[1];
  return base;
}

void load(Cuda& c) {
  const char* env = std::getenv("HIPSHIM_LIBCUDA");
  const std::string lib = env && *env ? env : "libcuda.so.1";
  void* h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    c.error = "hip_on_cuda: dlopen(" + lib + ") failed: " + (dlerror() ?: "?");
    return;
  }
  using GetProc2 = CUresult (*)(const char*, void**, int, uint64_t, int*);
  auto gp2 = reinterpret_cast<GetProc2>(dlsym(h, "cuGetProcAddress_v2"));
  std::string missing;
  auto resolve = [&](const char* base, void** slot) {
    int status = -1;
    if (!gp2 || gp2(base, slot, cu::kApiVersion, cu::GET_PROC_ADDRESS_DEFAULT, &status) != 0 ||
        status != cu::PROC_ADDRESS_SUCCESS)
      *slot = dlsym(h, fallback_name(base));
    if (!*slot) missing += std::string(missing.empty() ? "" : ", ") + base;
  };
#define CU_RESOLVE(ret, name, ...) resolve(#name, reinterpret_cast<void**>(&c.name));
  CUDA_ENTRIES(CU_RESOLVE)
  if (!missing.empty()) {
    c.error = "hip_on_cuda: " + lib + " lacks " + missing;
    return;
  }
  CUresult rc = c.cuInit(0);
  if (!rc) rc = c.cuDeviceGet(&c.dev, 0);
  if (!rc) rc = c.cuDevicePrimaryCtxRetain(&c.ctx, c.dev);
  if (!rc) rc = c.cuCtxSetCurrent(c.ctx);
  const char* mode = std::getenv("HIPSHIM_MODE");
  c.eager_capture = mode && !std::strcmp(mode, "eager-capture");
  if (mode && *mode && !c.eager_capture && std::strcmp(mode, "native")) {
    c.error = std::string("hip_on_cuda: HIPSHIM_MODE=") + mode + ": expected native or eager-capture";
    return;
  }
  if (!rc && c.eager_capture) rc = c.cuStreamCreate(&c.side, cu::STREAM_NON_BLOCKING);
  if (rc) {
    c.error = "hip_on_cuda: CUDA initialisation failed with CUresult " + std::to_string(rc);
    return;
  }
  c.version = c.eager_capture ? 70200000 : 100000000;  // HIP 7.2 / HIP 10.0
  if (const char* v = std::getenv("HIPSHIM_VERSION")) c.version = std::atoi(v);
  c.ok = true;
}

Cuda& cuda() {
  static Cuda c;
  static std::once_flag once;
  std::call_once(once, [] { load(c); });
  return c;
}

// ---- HIP semantics the shim adds ------------------------------------------------------------
thread_local hipError_t g_last_error = hipSuccess;  // hipGetLastError / hipPeekAtLastError

// Like HIP's own runtime: every failure (but "not ready") becomes the thread's last error.
hipError_t ret(CUresult rc) {
  if (rc != 0 && rc != hipErrorNotReady) g_last_error = rc;
  return rc;  // CUresult and hipError_t share their numbers for every code used here
}

// The shim's state for every call: the driver loaded, device 0's primary context current.
#define ENTER()                                                           \
  Cuda& c = cuda();                                                       \
  if (!c.ok) return ret(hipErrorNoDevice);                                \
  {                                                                       \
    cu::CUcontext cur = nullptr;                                          \
    if (c.cuCtxGetCurrent(&cur) || cur != c.ctx) c.cuCtxSetCurrent(c.ctx); \
  }

std::mutex g_mu;
std::set<void*> g_host_allocs;  // hipExtMallocWithFlags(signal) allocations: hipFree -> cuMemFreeHost

struct Stats {
  std::atomic<long> memops_captured{0}, memops_eager{0}, eager_waits_unsatisfied{0}, batch_nodes{0},
      external_records{0}, release_events{0}, host_funcs{0}, signal_allocs{0};
} g_stats;

CUstream S(hipStream_t s) { return reinterpret_cast<CUstream>(s); }

bool capturing(Cuda& c, hipStream_t s, CUresult* err) {
  int st = 0;
  *err = c.cuStreamIsCapturing(S(s), &st);
  return *err == 0 && st == cu::CAPTURE_STATUS_ACTIVE;
}

// The host address of `p` when the host can store to it (pinned/registered/signal memory).
volatile uint64_t* host_word(Cuda& c, void* p) {
  void* h = nullptr;
  if (c.cuPointerGetAttribute(&h, kPointerAttrHostPointer, (CUdeviceptr)(uintptr_t)p)) return nullptr;
  return static_cast<volatile uint64_t*>(h);
}

bool condition(uint64_t have, uint64_t value, unsigned flags, uint64_t mask) {
  have &= mask;
  switch (flags) {
    case hipStreamWaitValueGte: return have >= value;  // ROCm: masked and non-cyclic
    case hipStreamWaitValueEq: return have == value;
    case hipStreamWaitValueAnd: return (have & value) != 0;
    default: return !(have | value);  // Nor
  }
}

int cu_wait_flags(unsigned hip_flags) {
  switch (hip_flags) {
    case hipStreamWaitValueGte: return cu::STREAM_WAIT_VALUE_GEQ;
    case hipStreamWaitValueEq: return kWaitEq;
    case hipStreamWaitValueAnd: return kWaitAnd;
    case hipStreamWaitValueNor: return kWaitNor;
    default: return -1;
  }
}

const char* hip_name(hipError_t e) {
  switch (e) {
    case hipSuccess: return "hipSuccess";
    case hipErrorInvalidValue: return "hipErrorInvalidValue";
    case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
    case hipErrorNotInitialized: return "hipErrorNotInitialized";
    case hipErrorNoDevice: return "hipErrorNoDevice";
    case hipErrorInvalidDevice: return "hipErrorInvalidDevice";
    case hipErrorNoBinaryForGpu: return "hipErrorNoBinaryForGpu";
    case hipErrorInvalidHandle: return "hipErrorInvalidHandle";
    case hipErrorNotFound: return "hipErrorNotFound";
    case hipErrorNotReady: return "hipErrorNotReady";
    case hipErrorHostMemoryAlreadyRegistered: return "hipErrorHostMemoryAlreadyRegistered";
    case hipErrorHostMemoryNotRegistered: return "hipErrorHostMemoryNotRegistered";
    case hipErrorNotSupported: return "hipErrorNotSupported";
    case hipErrorStreamCaptureUnsupported: return "hipErrorStreamCaptureUnsupported";
    case hipErrorStreamCaptureInvalidated: return "hipErrorStreamCaptureInvalidated";
    case hipErrorStreamCaptureUnjoined: return "hipErrorStreamCaptureUnjoined";
    case hipErrorStreamCaptureImplicit: return "hipErrorStreamCaptureImplicit";
    default: return nullptr;
  }
}
}  // namespace

extern "C" {
#define HIPSHIM_API __attribute__((visibility("default")))

// ---- device, versions, errors ----------------------------------------------------------------
HIPSHIM_API hipError_t hipGetDeviceCount(int* n) {
  ENTER();
  if (!n) return ret(hipErrorInvalidValue);
  *n = 1;  // the primary context of device 0 is the only one served
  return hipSuccess;
}
HIPSHIM_API hipError_t hipSetDevice(int d) {
  ENTER();
  return d == 0 ? hipSuccess : ret(hipErrorInvalidDevice);
}
HIPSHIM_API hipError_t hipGetDevice(int* d) {
  ENTER();
  if (!d) return ret(hipErrorInvalidValue);
  *d = 0;
  return hipSuccess;
}
HIPSHIM_API hipError_t hipDeviceGetAttribute(int* v, hipDeviceAttribute_t attr, int d) {
  ENTER();
  if (!v || d != 0) return ret(hipErrorInvalidValue);
  if (attr != hipDeviceAttributeCanUseStreamWaitValue) return ret(hipErrorNotSupported);  // none other is mapped
  return ret(c.cuDeviceGetAttribute(v, cu::ATTR_64_BIT_STREAM_MEM_OPS, c.dev));
}
HIPSHIM_API hipError_t hipRuntimeGetVersion(int* v) {
  Cuda& c = cuda();
  if (!v) return ret(hipErrorInvalidValue);
  *v = c.version;
  return hipSuccess;
}
HIPSHIM_API hipError_t hipDriverGetVersion(int* v) { return hipRuntimeGetVersion(v); }
HIPSHIM_API hipError_t hipGetLastError() {
  const hipError_t e = g_last_error;
  g_last_error = hipSuccess;
  return e;
}
HIPSHIM_API hipError_t hipPeekAtLastError() { return g_last_error; }
HIPSHIM_API const char* hipGetErrorName(hipError_t e) {
  if (const char* n = hip_name(e)) return n;
  const char* n = nullptr;
  Cuda& c = cuda();
  if (c.cuGetErrorName) c.cuGetErrorName(e, &n);
  return n ? n : "hipErrorUnknown";
}
HIPSHIM_API const char* hipGetErrorString(hipError_t e) {
  const char* s = nullptr;
  Cuda& c = cuda();
  if (c.cuGetErrorString) c.cuGetErrorString(e, &s);
  if (s) return s;
  return c.ok ? "unknown error" : c.error.c_str();
}

// ---- streams --------------------------------------------------------------------------------
HIPSHIM_API hipError_t hipStreamCreateWithFlags(hipStream_t* s, unsigned flags) {
  ENTER();
  return ret(c.cuStreamCreate(reinterpret_cast<CUstream*>(s), flags & hipStreamNonBlocking ? cu::STREAM_NON_BLOCKING : 0));
}
HIPSHIM_API hipError_t hipStreamDestroy(hipStream_t s) {
  ENTER();
  return ret(c.cuStreamDestroy(S(s)));
}
HIPSHIM_API hipError_t hipStreamSynchronize(hipStream_t s) {
  ENTER();
  return ret(c.cuStreamSynchronize(S(s)));
}
HIPSHIM_API hipError_t hipStreamQuery(hipStream_t s) {
  ENTER();
  return ret(c.cuStreamQuery(S(s)));
}

// ---- memory ---------------------------------------------------------------------------------
HIPSHIM_API hipError_t hipMalloc(void** p, size_t n) {
  ENTER();
  if (!p) return ret(hipErrorInvalidValue);
  CUdeviceptr d = 0;
  const CUresult rc = c.cuMemAlloc(&d, n);
  *p = rc ? nullptr : reinterpret_cast<void*>(d);
  return ret(rc);
}
// Signal memory: pinned, device-mapped host memory, host-accessible at the same
// address (unified addressing), as ROCm's hipMallocSignalMemory is.
HIPSHIM_API hipError_t hipExtMallocWithFlags(void** p, size_t n, unsigned flags) {
  ENTER();
  if (!p) return ret(hipErrorInvalidValue);
  if (flags != hipMallocSignalMemory) return hipMalloc(p, n);
  void* h = nullptr;
  CUresult rc = c.cuMemHostAlloc(&h, n, kHostAllocDeviceMap | kHostAllocPortable);
  CUdeviceptr d = 0;
  if (!rc) rc = c.cuMemHostGetDevicePointer(&d, h, 0);
  if (!rc && reinterpret_cast<void*>(d) != h) rc = hipErrorNotSupported;  // needs unified addressing
  if (rc) {
    if (h) c.cuMemFreeHost(h);
    *p = nullptr;
    return ret(rc);
  }
  std::memset(h, 0, n);
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g_host_allocs.insert(h);
  }
  ++g_stats.signal_allocs;
  *p = h;
  return hipSuccess;
}
HIPSHIM_API hipError_t hipFree(void* p) {
  ENTER();
  if (!p) return hipSuccess;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (g_host_allocs.erase(p)) return ret(c.cuMemFreeHost(p));
  }
  return ret(c.cuMemFree(reinterpret_cast<CUdeviceptr>(p)));
}
HIPSHIM_API hipError_t hipHostRegister(void* p, size_t n, unsigned flags) {
  ENTER();
  unsigned f = 0;
  if (flags & hipHostRegisterPortable) f |= cu::MEMHOSTREGISTER_PORTABLE;
  if (flags & hipHostRegisterMapped) f |= cu::MEMHOSTREGISTER_DEVICEMAP;
  return ret(c.cuMemHostRegister(p, n, f));
}
HIPSHIM_API hipError_t hipHostUnregister(void* p) {
  ENTER();
  return ret(c.cuMemHostUnregister(p));
}
HIPSHIM_API hipError_t hipHostGetDevicePointer(void** d, void* h, unsigned flags) {
  ENTER();
  if (!d) return ret(hipErrorInvalidValue);
  CUdeviceptr p = 0;
  const CUresult rc = c.cuMemHostGetDevicePointer(&p, h, flags);
  *d = rc ? nullptr : reinterpret_cast<void*>(p);
  return ret(rc);
}
// Unified addressing: the kind is implied by the pointers, as with hipMemcpyDefault.
HIPSHIM_API hipError_t hipMemcpyAsync(void* dst, const void* src, size_t n, hipMemcpyKind, hipStream_t s) {
  ENTER();
  return ret(c.cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src, n, S(s)));
}

// ---- stream memops: native capture, or ROCm < 10's eager execution under capture ------------
HIPSHIM_API hipError_t hipStreamWriteValue64(hipStream_t s, void* ptr, uint64_t value, unsigned) {
  ENTER();
  CUresult err = 0;
  const bool cap = capturing(c, s, &err);
  if (err) return ret(err);
  if (cap && c.eager_capture) {
    ++g_stats.memops_eager;
    if (volatile uint64_t* w = host_word(c, ptr)) {
      __atomic_store_n(w, value, __ATOMIC_SEQ_CST);
      return hipSuccess;
    }
    return ret(c.cuStreamWriteValue64(c.side, (CUdeviceptr)(uintptr_t)ptr, value, cu::STREAM_WRITE_VALUE_DEFAULT));
  }
  if (cap) ++g_stats.memops_captured;
  return ret(c.cuStreamWriteValue64(S(s), (CUdeviceptr)(uintptr_t)ptr, value, cu::STREAM_WRITE_VALUE_DEFAULT));
}
HIPSHIM_API hipError_t hipStreamWaitValue64(hipStream_t s, void* ptr, uint64_t value, unsigned flags, uint64_t mask) {
  ENTER();
  const int f = cu_wait_flags(flags);
  // CUDA waits have no mask (the NVIDIA HIP platform ignores it); only the full mask maps exactly.
  if (f < 0 || mask != ~0ull) return ret(hipErrorNotSupported);
  CUresult err = 0;
  const bool cap = capturing(c, s, &err);
  if (err) return ret(err);
  if (cap && c.eager_capture) {
    ++g_stats.memops_eager;
    volatile uint64_t* w = host_word(c, ptr);
    if (!w || !condition(__atomic_load_n(w, __ATOMIC_SEQ_CST), value, flags, mask)) ++g_stats.eager_waits_unsatisfied;
    return hipSuccess;  // ROCm < 10 would block its queue; nothing of it reaches the graph either way
  }
  if (cap) ++g_stats.memops_captured;
  return ret(c.cuStreamWaitValue64(S(s), (CUdeviceptr)(uintptr_t)ptr, value, (unsigned)f));
}

// ---- capture and graphs ---------------------------------------------------------------------
HIPSHIM_API hipError_t hipStreamBeginCapture(hipStream_t s, hipStreamCaptureMode mode) {
  ENTER();
  return ret(c.cuStreamBeginCapture(S(s), mode));  // Global/ThreadLocal/Relaxed: CUDA's numbers
}
HIPSHIM_API hipError_t hipStreamEndCapture(hipStream_t s, hipGraph_t* g) {
  ENTER();
  return ret(c.cuStreamEndCapture(S(s), reinterpret_cast<cu::CUgraph*>(g)));
}
HIPSHIM_API hipError_t hipStreamIsCapturing(hipStream_t s, hipStreamCaptureStatus* st) {
  ENTER();
  return ret(c.cuStreamIsCapturing(S(s), st));
}
HIPSHIM_API hipError_t hipStreamGetCaptureInfo_v2(hipStream_t s, hipStreamCaptureStatus* st, unsigned long long* id,
                                                  hipGraph_t* g, const hipGraphNode_t** deps, size_t* n) {
  ENTER();
  return ret(c.cuStreamGetCaptureInfo(S(s), st, reinterpret_cast<uint64_t*>(id), reinterpret_cast<cu::CUgraph*>(g),
                                      reinterpret_cast<const cu::CUgraphNode**>(deps), n));
}
HIPSHIM_API hipError_t hipStreamUpdateCaptureDependencies(hipStream_t s, hipGraphNode_t* nodes, size_t n,
                                                          unsigned flags) {
  ENTER();
  return ret(c.cuStreamUpdateCaptureDependencies(S(s), reinterpret_cast<cu::CUgraphNode*>(nodes), n, flags));
}
HIPSHIM_API hipError_t hipGraphCreate(hipGraph_t* g, unsigned flags) {
  ENTER();
  return ret(c.cuGraphCreate(reinterpret_cast<cu::CUgraph*>(g), flags));
}
HIPSHIM_API hipError_t hipGraphInstantiate(hipGraphExec_t* e, hipGraph_t g, hipGraphNode_t* err_node, char* log,
                                           size_t log_size) {
  ENTER();
  if (err_node) *err_node = nullptr;
  if (log && log_size) log[0] = 0;
  return ret(c.cuGraphInstantiateWithFlags(reinterpret_cast<cu::CUgraphExec*>(e), reinterpret_cast<cu::CUgraph>(g), 0));
}
HIPSHIM_API hipError_t hipGraphLaunch(hipGraphExec_t e, hipStream_t s) {
  ENTER();
  return ret(c.cuGraphLaunch(reinterpret_cast<cu::CUgraphExec>(e), S(s)));
}
HIPSHIM_API hipError_t hipGraphExecDestroy(hipGraphExec_t e) {
  ENTER();
  return ret(c.cuGraphExecDestroy(reinterpret_cast<cu::CUgraphExec>(e)));
}
HIPSHIM_API hipError_t hipGraphDestroy(hipGraph_t g) {
  ENTER();
  return ret(c.cuGraphDestroy(reinterpret_cast<cu::CUgraph>(g)));
}
HIPSHIM_API hipError_t hipGraphDestroyNode(hipGraphNode_t n) {
  ENTER();
  return ret(c.cuGraphDestroyNode(reinterpret_cast<cu::CUgraphNode>(n)));
}
HIPSHIM_API hipError_t hipGraphGetNodes(hipGraph_t g, hipGraphNode_t* nodes, size_t* n) {
  ENTER();
  return ret(c.cuGraphGetNodes(reinterpret_cast<cu::CUgraph>(g), reinterpret_cast<cu::CUgraphNode*>(nodes), n));
}
// CUDA's node types (kernel 0 ... event record 7, batch memop 12) in hip_types.h's numbering;
// a type HIP has no name for there gets 1000 + CUDA's number.
HIPSHIM_API hipError_t hipGraphNodeGetType(hipGraphNode_t n, hipGraphNodeType* t) {
  ENTER();
  int ct = -1;
  const CUresult rc = c.cuGraphNodeGetType(reinterpret_cast<cu::CUgraphNode>(n), &ct);
  if (rc) return ret(rc);
  static const hipGraphNodeType map[] = {hipGraphNodeTypeKernel,    hipGraphNodeTypeMemcpy, hipGraphNodeTypeMemset,
                                         hipGraphNodeTypeHost,      hipGraphNodeTypeGraph,  hipGraphNodeTypeEmpty,
                                         hipGraphNodeTypeWaitEvent, hipGraphNodeTypeEventRecord};
  *t = (ct >= 0 && ct < 8) ? map[ct] : 1000 + ct;
  return hipSuccess;
}
HIPSHIM_API hipError_t hipGraphAddBatchMemOpNode(hipGraphNode_t* node, hipGraph_t g, const hipGraphNode_t* deps,
                                                 size_t n, const hipBatchMemOpNodeParams* p) {
  ENTER();
  if (!node || !p || !p->paramArray || p->count == 0 || p->count > 256) return ret(hipErrorInvalidValue);
  CuBatchMemOpParams ops[256];
  std::memset(ops, 0, sizeof(CuBatchMemOpParams) * p->count);
  for (unsigned i = 0; i < p->count; ++i) {
    const hipStreamBatchMemOpParams& h = p->paramArray[i];
    CuWaitWrite& o = ops[i].waitValue;  // write and wait share the layout
    o.operation = h.operation;
    if (h.operation == hipStreamMemOpWaitValue64 || h.operation == hipStreamMemOpWaitValue32) {
      const int f = cu_wait_flags(h.waitValue.flags);
      if (f < 0) return ret(hipErrorInvalidValue);
      o.address = (CUdeviceptr)(uintptr_t)h.waitValue.address, o.value64 = h.waitValue.value64, o.flags = f;
    } else if (h.operation == hipStreamMemOpWriteValue64 || h.operation == hipStreamMemOpWriteValue32) {
      o.address = (CUdeviceptr)(uintptr_t)h.writeValue.address, o.value64 = h.writeValue.value64;
      o.flags = cu::STREAM_WRITE_VALUE_DEFAULT;
    } else {
      return ret(hipErrorNotSupported);  // barrier / flush: rejected by ROCm's runtime too
    }
  }
  const CuBatchMemOpNodeParams cp{c.ctx, p->count, ops, 0};  // CUDA copies the array into the node
  const CUresult rc = c.cuGraphAddBatchMemOpNode(reinterpret_cast<cu::CUgraphNode*>(node),
                                                 reinterpret_cast<cu::CUgraph>(g),
                                                 reinterpret_cast<const cu::CUgraphNode*>(deps), n, &cp);
  if (!rc) ++g_stats.batch_nodes;
  return ret(rc);
}
HIPSHIM_API hipError_t hipGraphAddHostNode(hipGraphNode_t* node, hipGraph_t g, const hipGraphNode_t* deps, size_t n,
                                           const hipHostNodeParams* p) {
  ENTER();
  if (!p) return ret(hipErrorInvalidValue);
  const CuHostNodeParams cp{p->fn, p->userData};
  const CUresult rc = c.cuGraphAddHostNode(reinterpret_cast<cu::CUgraphNode*>(node), reinterpret_cast<cu::CUgraph>(g),
                                           reinterpret_cast<const cu::CUgraphNode*>(deps), n, &cp);
  if (!rc) ++g_stats.host_funcs;
  return ret(rc);
}

// ---- events and host functions ---------------------------------------------------------------
// hipEventReleaseToSystem / ReleaseToDevice / DisableSystemFence have no CUDA flag (the NVIDIA
// HIP platform defines them as 0): dropped, and counted so tests see the release was asked for.
HIPSHIM_API hipError_t hipEventCreateWithFlags(hipEvent_t* e, unsigned flags) {
  ENTER();
  if (flags & hipEventReleaseToSystem) ++g_stats.release_events;
  const unsigned cf = flags & (hipEventBlockingSync | hipEventDisableTiming | hipEventInterprocess);
  return ret(c.cuEventCreate(reinterpret_cast<CUevent*>(e), cf));
}
HIPSHIM_API hipError_t hipEventRecord(hipEvent_t e, hipStream_t s) {
  ENTER();
  return ret(c.cuEventRecord(reinterpret_cast<CUevent>(e), S(s)));
}
HIPSHIM_API hipError_t hipEventRecordWithFlags(hipEvent_t e, hipStream_t s, unsigned flags) {
  ENTER();
  if (flags & ~hipEventRecordExternal) return ret(hipErrorInvalidValue);
  const CUresult rc = c.cuEventRecordWithFlags(reinterpret_cast<CUevent>(e), S(s),
                                               flags & hipEventRecordExternal ? kEventRecordExternal : 0);
  if (!rc && (flags & hipEventRecordExternal)) ++g_stats.external_records;
  return ret(rc);
}
HIPSHIM_API hipError_t hipEventDestroy(hipEvent_t e) {
  ENTER();
  return ret(c.cuEventDestroy(reinterpret_cast<CUevent>(e)));
}
HIPSHIM_API hipError_t hipEventSynchronize(hipEvent_t e) {
  ENTER();
  return ret(c.cuEventSynchronize(reinterpret_cast<CUevent>(e)));
}
HIPSHIM_API hipError_t hipLaunchHostFunc(hipStream_t s, hipHostFn_t fn, void* arg) {
  ENTER();
  CUresult err{};
  if (capturing(c, s, &err)) ++g_stats.host_funcs;  // into a graph; an eager call (the probe's) is fine
  return ret(c.cuLaunchHostFunc(S(s), fn, arg));
}

// ---- modules (kernelio): cuModuleLoadData takes CUDA images only, so a HIP code-object
// bundle fails here with CUDA's own error, as it would on a GPU of the wrong vendor --------------
HIPSHIM_API hipError_t hipModuleLoadData(hipModule_t* m, const void* image) {
  ENTER();
  return ret(c.cuModuleLoadData(reinterpret_cast<cu::CUmodule*>(m), image));
}
HIPSHIM_API hipError_t hipModuleUnload(hipModule_t m) {
  ENTER();
  return ret(c.cuModuleUnload(reinterpret_cast<cu::CUmodule>(m)));
}
HIPSHIM_API hipError_t hipModuleGetFunction(hipFunction_t* f, hipModule_t m, const char* name) {
  ENTER();
  return ret(c.cuModuleGetFunction(reinterpret_cast<cu::CUfunction*>(f), reinterpret_cast<cu::CUmodule>(m), name));
}
HIPSHIM_API hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                             unsigned by, unsigned bz, unsigned smem, hipStream_t s, void** args,
                                             void** extra) {
  ENTER();
  return ret(c.cuLaunchKernel(reinterpret_cast<cu::CUfunction>(f), gx, gy, gz, bx, by, bz, smem, S(s), args, extra));
}

// ---- shim-only: status and counters for the tests ----------------------------------------------
// Returns 0 when CUDA is usable; else writes why into msg.
HIPSHIM_API int hipshim_status(char* msg, size_t len) {
  Cuda& c = cuda();
  if (msg && len) std::snprintf(msg, len, "%s", c.ok ? (c.eager_capture ? "eager-capture" : "native") : c.error.c_str());
  return c.ok ? 0 : 1;
}
// out[8]: memops captured, memops executed eagerly under capture, eager waits found unsatisfied,
// batch-memop nodes added, external event records, events created with ReleaseToSystem,
// host functions put into a graph (captured launch or explicit node), signal allocations.
HIPSHIM_API void hipshim_stats(long* out) {
  out[0] = g_stats.memops_captured, out[1] = g_stats.memops_eager, out[2] = g_stats.eager_waits_unsatisfied;
  out[3] = g_stats.batch_nodes, out[4] = g_stats.external_records, out[5] = g_stats.release_events;
  out[6] = g_stats.host_funcs, out[7] = g_stats.signal_allocs;
}
}  // extern "C"

// Every entry point gpusync-hip resolves is exported here with exactly hip_types.h's signature.
#define HIPSHIM_CHECK(name, required) \
  static_assert(std::is_same<decltype(&::name), gpusync::hip::fn::name>::value, #name ": signature differs");
GPUSYNC_HIP_ENTRY_POINTS(HIPSHIM_CHECK)
