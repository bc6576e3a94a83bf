// Compile-only (g++ -fsyntax-only -I<cuda>/include): the shim's own CUDA declarations
// (cuda_extra.h, cuda_types.h) against the real cuda.h. tests/test_hip_on_cuda.py runs
// it wherever a CUDA toolkit's headers are installed.
#include <cuda.h>

#include "cuda_extra.h"

namespace h = hipshim;
static_assert(h::kHostAllocPortable == CU_MEMHOSTALLOC_PORTABLE && h::kHostAllocDeviceMap == CU_MEMHOSTALLOC_DEVICEMAP, "");
static_assert(h::kEventRecordExternal == CU_EVENT_RECORD_EXTERNAL, "");
static_assert(h::kPointerAttrHostPointer == CU_POINTER_ATTRIBUTE_HOST_POINTER, "");
static_assert(h::kWaitEq == CU_STREAM_WAIT_VALUE_EQ && h::kWaitAnd == CU_STREAM_WAIT_VALUE_AND &&
                  h::kWaitNor == CU_STREAM_WAIT_VALUE_NOR && gpusync::cu::STREAM_WAIT_VALUE_GEQ == CU_STREAM_WAIT_VALUE_GEQ,
              "");
static_assert(h::kMemOpWait64 == CU_STREAM_MEM_OP_WAIT_VALUE_64 && h::kMemOpWrite64 == CU_STREAM_MEM_OP_WRITE_VALUE_64, "");
static_assert(h::kNodeTypeBatchMemOp == CU_GRAPH_NODE_TYPE_BATCH_MEM_OP, "");
static_assert(sizeof(h::CuBatchMemOpParams) == sizeof(CUstreamBatchMemOpParams), "");
static_assert(offsetof(h::CuWaitWrite, address) == offsetof(CUstreamBatchMemOpParams_union::CUstreamMemOpWaitValueParams_st, address), "");
static_assert(offsetof(h::CuWaitWrite, value64) == offsetof(CUstreamBatchMemOpParams_union::CUstreamMemOpWaitValueParams_st, value64), "");
static_assert(offsetof(h::CuWaitWrite, flags) == offsetof(CUstreamBatchMemOpParams_union::CUstreamMemOpWaitValueParams_st, flags), "");
static_assert(offsetof(h::CuWaitWrite, address) == offsetof(CUstreamBatchMemOpParams_union::CUstreamMemOpWriteValueParams_st, address), "");
static_assert(offsetof(h::CuWaitWrite, value64) == offsetof(CUstreamBatchMemOpParams_union::CUstreamMemOpWriteValueParams_st, value64), "");
static_assert(sizeof(h::CuBatchMemOpNodeParams) == sizeof(CUDA_BATCH_MEM_OP_NODE_PARAMS_v1), "");
static_assert(offsetof(h::CuBatchMemOpNodeParams, count) == offsetof(CUDA_BATCH_MEM_OP_NODE_PARAMS_v1, count), "");
static_assert(offsetof(h::CuBatchMemOpNodeParams, paramArray) ==
                  offsetof(CUDA_BATCH_MEM_OP_NODE_PARAMS_v1, paramArray), "");
static_assert(offsetof(h::CuBatchMemOpNodeParams, flags) == offsetof(CUDA_BATCH_MEM_OP_NODE_PARAMS_v1, flags), "");
static_assert(sizeof(h::CuHostNodeParams) == sizeof(CUDA_HOST_NODE_PARAMS_v1), "");
static_assert(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL == 1 && CU_STREAM_CAPTURE_MODE_RELAXED == 2 &&
                  CU_STREAM_CAPTURE_MODE_GLOBAL == 0, "hipStreamCaptureMode has CUDA's numbers");
static_assert(CU_STREAM_CAPTURE_STATUS_ACTIVE == 1 && CU_STREAM_CAPTURE_STATUS_INVALIDATED == 2, "");
static_assert(CU_STREAM_ADD_CAPTURE_DEPENDENCIES == 0 && CU_STREAM_SET_CAPTURE_DEPENDENCIES == 1, "");
// The shim passes CUresult through as hipError_t: the codes gpusync-hip names must mean the same.
static_assert(CUDA_ERROR_INVALID_VALUE == 1 && CUDA_ERROR_OUT_OF_MEMORY == 2 && CUDA_ERROR_NOT_INITIALIZED == 3 &&
                  CUDA_ERROR_NO_DEVICE == 100 && CUDA_ERROR_INVALID_DEVICE == 101 &&
                  CUDA_ERROR_NO_BINARY_FOR_GPU == 209 && CUDA_ERROR_INVALID_HANDLE == 400 &&
                  CUDA_ERROR_NOT_FOUND == 500 && CUDA_ERROR_NOT_READY == 600 &&
                  CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED == 712 && CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED == 713 &&
                  CUDA_ERROR_NOT_SUPPORTED == 801 && CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED == 900 &&
                  CUDA_ERROR_STREAM_CAPTURE_INVALIDATED == 901 && CUDA_ERROR_STREAM_CAPTURE_UNJOINED == 904 &&
                  CUDA_ERROR_STREAM_CAPTURE_IMPLICIT == 906,
              "CUresult and hipError_t numbers");
