// Every HIP type, constant and entry-point signature gpusync-hip uses, declared
// here so the package builds with a plain C++ compiler and no HIP headers, and
// so one build can use APIs newer than any header on the build machine (batch
// memop nodes, hipEventRecordWithFlags: HIP 6.4+). Everything is resolved at
// run time by name (dlsym); a missing entry point means "that path is
// unavailable", never a link error or a crash.
//
// Values and layouts are ABI. hip_check.cpp static_asserts them against the
// real <hip/hip_runtime_api.h> whenever the build machine has one, each group
// guarded by the HIP_VERSION that introduced it (Debian's 5.2.3 checks the old
// ones; a 6.4+ SDK checks the batch-memop structs and event-record flags).
//
// Shared with helper `hip-build` (tests/cuda_shim implements these entry points
// on top of CUDA for the H200): keep this header self-contained (no includes
// beyond <cstddef>/<cstdint>) and append-only.
#pragma once
#include <cstddef>
#include <cstdint>

// Same struct tags as the AMD-platform hip_runtime_api.h, so the handle types
// are the very same types when both headers meet in one translation unit.
struct ihipStream_t;
struct ihipEvent_t;
struct ihipCtx_t;
struct ihipModule_t;
struct ihipModuleSymbol_t;
struct ihipGraph;
struct hipGraphNode;
struct hipGraphExec;

namespace gpusync {
namespace hip {
// ---- handles -------------------------------------------------------------------------------
using hipError_t = int;  // an enum in the header; int-sized, returned by value
using hipStream_t = ihipStream_t*;
using hipEvent_t = ihipEvent_t*;
using hipCtx_t = ihipCtx_t*;
using hipModule_t = ihipModule_t*;
using hipFunction_t = ihipModuleSymbol_t*;
using hipGraph_t = ihipGraph*;
using hipGraphNode_t = hipGraphNode*;
using hipGraphExec_t = hipGraphExec*;
using hipDeviceptr_t = void*;
using hipHostFn_t = void (*)(void* userData);
using hipStreamCaptureStatus = int;  // enum
using hipStreamCaptureMode = int;    // enum
using hipMemcpyKind = int;           // enum
using hipDeviceAttribute_t = int;    // enum
using hipGraphNodeType = int;        // enum
using hipStreamBatchMemOpType = int; // enum

// ---- hipError_t (values shared with CUDA's cudaError_t where they exist) -------------------
constexpr hipError_t hipSuccess = 0;
constexpr hipError_t hipErrorInvalidValue = 1;
constexpr hipError_t hipErrorOutOfMemory = 2;
constexpr hipError_t hipErrorNotInitialized = 3;
constexpr hipError_t hipErrorInvalidDevice = 101;
constexpr hipError_t hipErrorNoDevice = 100;
constexpr hipError_t hipErrorNoBinaryForGpu = 209;
constexpr hipError_t hipErrorInvalidHandle = 400;
constexpr hipError_t hipErrorNotFound = 500;
constexpr hipError_t hipErrorNotReady = 600;
constexpr hipError_t hipErrorHostMemoryAlreadyRegistered = 712;
constexpr hipError_t hipErrorHostMemoryNotRegistered = 713;
constexpr hipError_t hipErrorNotSupported = 801;
constexpr hipError_t hipErrorStreamCaptureUnsupported = 900;
constexpr hipError_t hipErrorStreamCaptureInvalidated = 901;
constexpr hipError_t hipErrorStreamCaptureUnjoined = 904;  // seed 000: a spliced node left outside the chain
constexpr hipError_t hipErrorStreamCaptureImplicit = 906;
constexpr hipError_t hipErrorUnknown = 999;

// ---- flags and enums ----------------------------------------------------------------------
// The real header #defines most flags: each is declared here only when no such macro
// exists, so this header may follow <hip/hip_runtime_api.h> in one translation unit.
#ifndef hipStreamDefault
constexpr unsigned hipStreamDefault = 0x00;
#endif
#ifndef hipStreamNonBlocking
constexpr unsigned hipStreamNonBlocking = 0x01;
#endif
// hipExtMallocWithFlags: memory the stream memops may wait on (HSA signal storage,
// fine-grained, host-accessible at the same address). The runtime wants 8 bytes.
#ifndef hipDeviceMallocDefault
constexpr unsigned hipDeviceMallocDefault = 0x0;
#endif
#ifndef hipMallocSignalMemory
constexpr unsigned hipMallocSignalMemory = 0x2;
#endif
#ifndef hipHostRegisterDefault
constexpr unsigned hipHostRegisterDefault = 0x0;
#endif
#ifndef hipHostRegisterPortable
constexpr unsigned hipHostRegisterPortable = 0x1;
#endif
#ifndef hipHostRegisterMapped
constexpr unsigned hipHostRegisterMapped = 0x2;
#endif
// hipEventCreateWithFlags
#ifndef hipEventDefault
constexpr unsigned hipEventDefault = 0x0;
#endif
#ifndef hipEventBlockingSync
constexpr unsigned hipEventBlockingSync = 0x1;
#endif
#ifndef hipEventDisableTiming
constexpr unsigned hipEventDisableTiming = 0x2;
#endif
#ifndef hipEventInterprocess
constexpr unsigned hipEventInterprocess = 0x4;
#endif
#ifndef hipEventDisableSystemFence
constexpr unsigned hipEventDisableSystemFence = 0x20000000u;
#endif
#ifndef hipEventReleaseToDevice
constexpr unsigned hipEventReleaseToDevice = 0x40000000u;
#endif
// "Use a system-scope release when recording this event ... make non-coherent
// host memory visible to the host": the fence between the D2H copies and the doorbell.
#ifndef hipEventReleaseToSystem
constexpr unsigned hipEventReleaseToSystem = 0x80000000u;
#endif
// hipEventRecordWithFlags (HIP 6.4.2+): under capture, External makes the record a
// graph node of its own (a plain hipEventRecord only adds a dependency edge).
#ifndef hipEventRecordDefault
constexpr unsigned hipEventRecordDefault = 0x00;
#endif
#ifndef hipEventRecordExternal
constexpr unsigned hipEventRecordExternal = 0x01;
#endif
// hipStreamWaitValue64 flags: masked and NON-cyclic on ROCm ((*ptr & mask) >= value).
#ifndef hipStreamWaitValueGte
constexpr unsigned hipStreamWaitValueGte = 0x0;
#endif
#ifndef hipStreamWaitValueEq
constexpr unsigned hipStreamWaitValueEq = 0x1;
#endif
#ifndef hipStreamWaitValueAnd
constexpr unsigned hipStreamWaitValueAnd = 0x2;
#endif
#ifndef hipStreamWaitValueNor
constexpr unsigned hipStreamWaitValueNor = 0x3;
#endif
constexpr unsigned hipStreamWriteValueDefault = 0x0;  // write flags are "reserved" on ROCm
constexpr hipMemcpyKind hipMemcpyHostToHost = 0, hipMemcpyHostToDevice = 1, hipMemcpyDeviceToHost = 2,
                        hipMemcpyDeviceToDevice = 3, hipMemcpyDefault = 4;
constexpr hipStreamCaptureStatus hipStreamCaptureStatusNone = 0, hipStreamCaptureStatusActive = 1,
                                 hipStreamCaptureStatusInvalidated = 2;
constexpr hipStreamCaptureMode hipStreamCaptureModeGlobal = 0, hipStreamCaptureModeThreadLocal = 1,
                               hipStreamCaptureModeRelaxed = 2;
// hipStreamUpdateCaptureDependencies flags
#ifndef hipStreamAddCaptureDependencies
constexpr unsigned hipStreamAddCaptureDependencies = 0, hipStreamSetCaptureDependencies = 1;
#endif
// hipGraphNodeType (AMD numbering: Kernel = 1)
constexpr hipGraphNodeType hipGraphNodeTypeKernel = 1, hipGraphNodeTypeMemcpy = 2, hipGraphNodeTypeMemset = 3,
                           hipGraphNodeTypeHost = 4, hipGraphNodeTypeGraph = 5, hipGraphNodeTypeEmpty = 6,
                           hipGraphNodeTypeWaitEvent = 7, hipGraphNodeTypeEventRecord = 8;
// hipDeviceAttribute_t: AMD-specific range (hipDeviceAttributeAmdSpecificBegin = 10000).
constexpr hipDeviceAttribute_t hipDeviceAttributeCanUseStreamWaitValue = 10013;
// hipStreamBatchMemOpType (HIP 6.4+)
constexpr hipStreamBatchMemOpType hipStreamMemOpWaitValue32 = 1, hipStreamMemOpWriteValue32 = 2,
                                  hipStreamMemOpFlushRemoteWrites = 3, hipStreamMemOpWaitValue64 = 4,
                                  hipStreamMemOpWriteValue64 = 5, hipStreamMemOpBarrier = 6;

// ---- structs --------------------------------------------------------------------------------
struct hipHostNodeParams {
  hipHostFn_t fn;
  void* userData;
};

// hipStreamBatchMemOpParams (HIP 6.4+): a 48-byte union like CUstreamBatchMemOpParams.
struct hipStreamMemOpWaitValueParams_t {
  hipStreamBatchMemOpType operation;
  hipDeviceptr_t address;
  union {
    uint32_t value;
    uint64_t value64;
  };
  unsigned int flags;
  hipDeviceptr_t alias;  // unused
};
struct hipStreamMemOpWriteValueParams_t {
  hipStreamBatchMemOpType operation;
  hipDeviceptr_t address;
  union {
    uint32_t value;
    uint64_t value64;
  };
  unsigned int flags;
  hipDeviceptr_t alias;  // unused
};
struct hipStreamMemOpFlushRemoteWritesParams_t {
  hipStreamBatchMemOpType operation;
  unsigned int flags;
};
struct hipStreamMemOpMemoryBarrierParams_t {
  hipStreamBatchMemOpType operation;
  unsigned int flags;
};
union hipStreamBatchMemOpParams {
  hipStreamBatchMemOpType operation;
  hipStreamMemOpWaitValueParams_t waitValue;
  hipStreamMemOpWriteValueParams_t writeValue;
  hipStreamMemOpFlushRemoteWritesParams_t flushRemoteWrites;
  hipStreamMemOpMemoryBarrierParams_t memoryBarrier;
  uint64_t pad[6];
};
// Before HIP 10 the runtime keeps `paramArray` (no deep copy) and may run the ops
// of one node in parallel: gpusync-hip puts ONE op in each node and keeps the
// array alive for as long as any graph may use it.
struct hipBatchMemOpNodeParams {
  hipCtx_t ctx;
  unsigned int count;
  hipStreamBatchMemOpParams* paramArray;
  unsigned int flags;
};

static_assert(sizeof(hipStreamMemOpWaitValueParams_t) == 40, "hipStreamMemOpWaitValueParams_t layout");
static_assert(offsetof(hipStreamMemOpWaitValueParams_t, address) == 8, "waitValue.address offset");
static_assert(offsetof(hipStreamMemOpWaitValueParams_t, value64) == 16, "waitValue.value64 offset");
static_assert(offsetof(hipStreamMemOpWaitValueParams_t, flags) == 24, "waitValue.flags offset");
static_assert(sizeof(hipStreamBatchMemOpParams) == 48, "hipStreamBatchMemOpParams layout");
static_assert(sizeof(hipBatchMemOpNodeParams) == 32, "hipBatchMemOpNodeParams layout");
static_assert(offsetof(hipBatchMemOpNodeParams, paramArray) == 16, "hipBatchMemOpNodeParams.paramArray offset");

// ---- entry points (one typedef per resolved symbol; names are the exported ones) -------------
namespace fn {
using hipGetDeviceCount = hipError_t (*)(int*);
using hipSetDevice = hipError_t (*)(int);
using hipGetDevice = hipError_t (*)(int*);
using hipDeviceGetAttribute = hipError_t (*)(int*, hipDeviceAttribute_t, int);
using hipRuntimeGetVersion = hipError_t (*)(int*);
using hipDriverGetVersion = hipError_t (*)(int*);
using hipGetLastError = hipError_t (*)();
using hipPeekAtLastError = hipError_t (*)();
using hipGetErrorString = const char* (*)(hipError_t);
using hipGetErrorName = const char* (*)(hipError_t);
using hipStreamCreateWithFlags = hipError_t (*)(hipStream_t*, unsigned);
using hipStreamDestroy = hipError_t (*)(hipStream_t);
using hipStreamSynchronize = hipError_t (*)(hipStream_t);
using hipStreamQuery = hipError_t (*)(hipStream_t);
using hipExtMallocWithFlags = hipError_t (*)(void**, size_t, unsigned);
using hipMalloc = hipError_t (*)(void**, size_t);
using hipFree = hipError_t (*)(void*);
using hipHostRegister = hipError_t (*)(void*, size_t, unsigned);
using hipHostUnregister = hipError_t (*)(void*);
using hipHostGetDevicePointer = hipError_t (*)(void**, void*, unsigned);
using hipMemcpyAsync = hipError_t (*)(void*, const void*, size_t, hipMemcpyKind, hipStream_t);
using hipStreamWriteValue64 = hipError_t (*)(hipStream_t, void*, uint64_t, unsigned);
using hipStreamWaitValue64 = hipError_t (*)(hipStream_t, void*, uint64_t, unsigned, uint64_t /*mask*/);
using hipStreamBeginCapture = hipError_t (*)(hipStream_t, hipStreamCaptureMode);
using hipStreamEndCapture = hipError_t (*)(hipStream_t, hipGraph_t*);
using hipStreamIsCapturing = hipError_t (*)(hipStream_t, hipStreamCaptureStatus*);
using hipStreamGetCaptureInfo_v2 = hipError_t (*)(hipStream_t, hipStreamCaptureStatus*, unsigned long long*,
                                                  hipGraph_t*, const hipGraphNode_t**, size_t*);
using hipStreamUpdateCaptureDependencies = hipError_t (*)(hipStream_t, hipGraphNode_t*, size_t, unsigned);
using hipGraphCreate = hipError_t (*)(hipGraph_t*, unsigned);
using hipGraphInstantiate = hipError_t (*)(hipGraphExec_t*, hipGraph_t, hipGraphNode_t*, char*, size_t);
using hipGraphLaunch = hipError_t (*)(hipGraphExec_t, hipStream_t);
using hipGraphExecDestroy = hipError_t (*)(hipGraphExec_t);
using hipGraphDestroy = hipError_t (*)(hipGraph_t);
using hipGraphDestroyNode = hipError_t (*)(hipGraphNode_t);
using hipGraphGetNodes = hipError_t (*)(hipGraph_t, hipGraphNode_t*, size_t*);
using hipGraphNodeGetType = hipError_t (*)(hipGraphNode_t, hipGraphNodeType*);
using hipGraphAddBatchMemOpNode = hipError_t (*)(hipGraphNode_t*, hipGraph_t, const hipGraphNode_t*, size_t,
                                                 const hipBatchMemOpNodeParams*);
using hipEventCreateWithFlags = hipError_t (*)(hipEvent_t*, unsigned);
using hipEventRecord = hipError_t (*)(hipEvent_t, hipStream_t);
using hipEventRecordWithFlags = hipError_t (*)(hipEvent_t, hipStream_t, unsigned);
using hipEventDestroy = hipError_t (*)(hipEvent_t);
using hipEventSynchronize = hipError_t (*)(hipEvent_t);
using hipLaunchHostFunc = hipError_t (*)(hipStream_t, hipHostFn_t, void*);
using hipGraphAddHostNode = hipError_t (*)(hipGraphNode_t*, hipGraph_t, const hipGraphNode_t*, size_t,
                                           const hipHostNodeParams*);
using hipModuleLoadData = hipError_t (*)(hipModule_t*, const void*);
using hipModuleUnload = hipError_t (*)(hipModule_t);
using hipModuleGetFunction = hipError_t (*)(hipFunction_t*, hipModule_t, const char*);
using hipModuleLaunchKernel = hipError_t (*)(hipFunction_t, unsigned, unsigned, unsigned, unsigned, unsigned,
                                             unsigned, unsigned, hipStream_t, void**, void**);
}  // namespace fn

// X-macro of every entry point: X(name, required). Required = the package cannot
// do anything useful without it (the loader reports "lacks ..."); optional = one
// path is unavailable without it. The loader, the fake runtime's symbol table
// and the CUDA shim can all expand this one list.
#define GPUSYNC_HIP_ENTRY_POINTS(X)            \
  X(hipGetDeviceCount, true)                   \
  X(hipSetDevice, true)                        \
  X(hipGetDevice, true)                        \
  X(hipDeviceGetAttribute, true)               \
  X(hipRuntimeGetVersion, true)                \
  X(hipDriverGetVersion, false)                \
  X(hipGetLastError, true)                     \
  X(hipPeekAtLastError, true)                  \
  X(hipGetErrorString, true)                   \
  X(hipGetErrorName, false)                    \
  X(hipStreamCreateWithFlags, true)            \
  X(hipStreamDestroy, true)                    \
  X(hipStreamSynchronize, true)                \
  X(hipStreamQuery, true)                      \
  X(hipExtMallocWithFlags, false)              \
  X(hipMalloc, true)                           \
  X(hipFree, true)                             \
  X(hipHostRegister, true)                     \
  X(hipHostUnregister, true)                   \
  X(hipHostGetDevicePointer, true)             \
  X(hipMemcpyAsync, true)                      \
  X(hipStreamWriteValue64, false)              \
  X(hipStreamWaitValue64, false)               \
  X(hipStreamBeginCapture, false)              \
  X(hipStreamEndCapture, false)                \
  X(hipStreamIsCapturing, true)                \
  X(hipStreamGetCaptureInfo_v2, false)         \
  X(hipStreamUpdateCaptureDependencies, false) \
  X(hipGraphCreate, false)                     \
  X(hipGraphInstantiate, false)                \
  X(hipGraphLaunch, false)                     \
  X(hipGraphExecDestroy, false)                \
  X(hipGraphDestroy, false)                    \
  X(hipGraphDestroyNode, false)                \
  X(hipGraphGetNodes, false)                   \
  X(hipGraphNodeGetType, false)                \
  X(hipGraphAddBatchMemOpNode, false)          \
  X(hipEventCreateWithFlags, false)            \
  X(hipEventRecord, false)                     \
  X(hipEventRecordWithFlags, false)            \
  X(hipEventDestroy, false)                    \
  X(hipEventSynchronize, false)                \
  X(hipLaunchHostFunc, false)                  \
  X(hipGraphAddHostNode, false)                \
  X(hipModuleLoadData, false)                  \
  X(hipModuleUnload, false)                    \
  X(hipModuleGetFunction, false)               \
  X(hipModuleLaunchKernel, false)
}  // namespace hip
}  // namespace gpusync
