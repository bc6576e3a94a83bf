// The CUDA declarations the shim needs beyond gpusync-cuda's cuda_types.h, so it builds
// without a CUDA toolkit. Values and layouts are ABI (CUDA 12.0 entry points, as resolved):
// cuda_check.cpp static_asserts every one against cuda.h where one is installed.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda_types.h"

struct CUevent_st;  // cuda.h's tag, so the handle type is the same type

namespace hipshim {
namespace cu = gpusync::cu;
using CUevent = CUevent_st*;
constexpr unsigned kHostAllocPortable = 0x01, kHostAllocDeviceMap = 0x02;  // CU_MEMHOSTALLOC_*
constexpr unsigned kEventRecordExternal = 0x1;                              // CU_EVENT_RECORD_EXTERNAL
constexpr int kPointerAttrHostPointer = 4;                                  // CU_POINTER_ATTRIBUTE_HOST_POINTER
constexpr int kWaitEq = 0x1, kWaitAnd = 0x2, kWaitNor = 0x3;                // CU_STREAM_WAIT_VALUE_*
constexpr int kMemOpWait64 = 4, kMemOpWrite64 = 5;                          // CU_STREAM_MEM_OP_*_VALUE_64
constexpr int kNodeTypeBatchMemOp = 12;                                     // CU_GRAPH_NODE_TYPE_BATCH_MEM_OP

// CUstreamBatchMemOpParams (a 48-byte union), CUDA_BATCH_MEM_OP_NODE_PARAMS_v1 and
// CUDA_HOST_NODE_PARAMS_v1: the same layouts as HIP's in hip_types.h, but kept as CUDA's
// own types and translated field by field.
struct CuWaitWrite {
  int operation;
  cu::CUdeviceptr address;
  union {
    uint32_t value;
    uint64_t value64;
  };
  unsigned flags;
  cu::CUdeviceptr alias;
};
union CuBatchMemOpParams {
  int operation;
  CuWaitWrite waitValue;
  CuWaitWrite writeValue;
  struct {
    int operation;
    unsigned flags;
  } flushRemoteWrites, memoryBarrier;
  uint64_t pad[6];
};
struct CuBatchMemOpNodeParams {
  cu::CUcontext ctx;
  unsigned count;
  CuBatchMemOpParams* paramArray;
  unsigned flags;
};
struct CuHostNodeParams {
  void (*fn)(void*);
  void* userData;
};
static_assert(sizeof(CuBatchMemOpParams) == 48 && sizeof(CuBatchMemOpNodeParams) == 32, "CUDA memop layouts");
static_assert(offsetof(CuWaitWrite, value64) == 16 && offsetof(CuWaitWrite, flags) == 24, "CUDA memop layouts");
}  // namespace hipshim
