// Compiled only when the build machine has cuda.h (GPUSYNC_HAVE_CUDA_H): pins
// the constants of cuda_types.h to the real header. Nothing here is linked
// against libcuda; it is a compile-time check.
#ifdef GPUSYNC_HAVE_CUDA_H
#include <cuda.h>

#include "cuda_types.h"

namespace c = gpusync::cu;
static_assert(c::ERROR_INVALID_VALUE == CUDA_ERROR_INVALID_VALUE, "CUresult");
static_assert(c::ERROR_NO_DEVICE == CUDA_ERROR_NO_DEVICE, "CUresult");
static_assert(c::ERROR_NOT_READY == CUDA_ERROR_NOT_READY, "CUresult");
static_assert(c::ERROR_HOST_MEMORY_ALREADY_REGISTERED == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUresult");
static_assert(c::ERROR_NOT_SUPPORTED == CUDA_ERROR_NOT_SUPPORTED, "CUresult");
static_assert(c::MEMHOSTREGISTER_PORTABLE == CU_MEMHOSTREGISTER_PORTABLE, "flag");
static_assert(c::MEMHOSTREGISTER_DEVICEMAP == CU_MEMHOSTREGISTER_DEVICEMAP, "flag");
static_assert(c::STREAM_NON_BLOCKING == CU_STREAM_NON_BLOCKING, "flag");
static_assert(c::EVENT_DISABLE_TIMING == CU_EVENT_DISABLE_TIMING, "flag");
static_assert(c::STREAM_WAIT_VALUE_GEQ == CU_STREAM_WAIT_VALUE_GEQ, "flag");
static_assert(c::STREAM_WRITE_VALUE_DEFAULT == CU_STREAM_WRITE_VALUE_DEFAULT, "flag");
static_assert(c::CAPTURE_STATUS_ACTIVE == CU_STREAM_CAPTURE_STATUS_ACTIVE, "enum");
static_assert(c::CAPTURE_STATUS_INVALIDATED == CU_STREAM_CAPTURE_STATUS_INVALIDATED, "enum");
static_assert(c::CAPTURE_MODE_THREAD_LOCAL == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, "enum");
static_assert(c::GRAPH_NODE_KERNEL == CU_GRAPH_NODE_TYPE_KERNEL, "enum");
static_assert(c::GRAPH_NODE_MEMCPY == CU_GRAPH_NODE_TYPE_MEMCPY, "enum");
static_assert(c::GRAPH_NODE_HOST == CU_GRAPH_NODE_TYPE_HOST, "enum");
static_assert(c::GRAPH_NODE_BATCH_MEM_OP == CU_GRAPH_NODE_TYPE_BATCH_MEM_OP, "enum");
static_assert(c::ATTR_UNIFIED_ADDRESSING == CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING, "attr");
static_assert(c::ATTR_CC_MAJOR == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "attr");
static_assert(c::ATTR_CC_MINOR == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "attr");
static_assert(c::ATTR_HOST_POINTER_FOR_REGISTERED_MEM == CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
              "attr");
static_assert(c::ATTR_64_BIT_STREAM_MEM_OPS == CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, "attr");
static_assert(c::GET_PROC_ADDRESS_DEFAULT == CU_GET_PROC_ADDRESS_DEFAULT, "flag");
static_assert(c::PROC_ADDRESS_SUCCESS == CU_GET_PROC_ADDRESS_SUCCESS, "enum");
static_assert(sizeof(c::CUdeviceptr) == sizeof(CUdeviceptr), "CUdeviceptr");
// The handle types are the same types as cuda.h's (same struct tags).
static_assert(sizeof(c::CUstream) == sizeof(CUstream), "CUstream");
#endif
