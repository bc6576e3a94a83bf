// The few CUDA driver types and constants gpusync-cuda uses, declared here so
// the package builds without a CUDA toolkit (no cuda.h, no libcuda at link
// time). Values are ABI: cuda_check.cpp static_asserts them against cuda.h
// whenever the build machine has one.
#pragma once
#include <cstddef>
#include <cstdint>

// Same tag names as cuda.h so the handle types are the very same types.
struct CUctx_st;
struct CUstream_st;
struct CUmod_st;
struct CUfunc_st;
struct CUgraph_st;
struct CUgraphExec_st;
struct CUgraphNode_st;
struct CUevent_st;

namespace gpusync {
namespace cu {
using CUresult = int;
using CUdevice = int;
using CUcontext = CUctx_st*;
using CUstream = CUstream_st*;
using CUmodule = CUmod_st*;
using CUfunction = CUfunc_st*;
using CUgraph = CUgraph_st*;
using CUgraphExec = CUgraphExec_st*;
using CUgraphNode = CUgraphNode_st*;
using CUevent = CUevent_st*;
using CUdeviceptr = unsigned long long;
using cuuint64_t = uint64_t;
using CUhostFn = void (*)(void*);

constexpr CUresult SUCCESS = 0;
constexpr CUresult ERROR_INVALID_VALUE = 1;
constexpr CUresult ERROR_NO_DEVICE = 100;
constexpr CUresult ERROR_NOT_READY = 600;
constexpr CUresult ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712;
constexpr CUresult ERROR_NOT_SUPPORTED = 801;

constexpr unsigned MEMHOSTREGISTER_PORTABLE = 0x01;
constexpr unsigned MEMHOSTREGISTER_DEVICEMAP = 0x02;
constexpr unsigned STREAM_NON_BLOCKING = 0x1;
constexpr unsigned EVENT_DISABLE_TIMING = 0x2;  // the copy fork/join's events: ordering only, no timestamps
constexpr unsigned STREAM_WAIT_VALUE_GEQ = 0x0;
constexpr unsigned STREAM_WRITE_VALUE_DEFAULT = 0x0;  // carries the stream-scoped system fence
constexpr int CAPTURE_STATUS_NONE = 0, CAPTURE_STATUS_ACTIVE = 1, CAPTURE_STATUS_INVALIDATED = 2;
constexpr int CAPTURE_MODE_THREAD_LOCAL = 1;
constexpr int GRAPH_NODE_KERNEL = 0, GRAPH_NODE_MEMCPY = 1, GRAPH_NODE_HOST = 3, GRAPH_NODE_BATCH_MEM_OP = 12;
constexpr int ATTR_UNIFIED_ADDRESSING = 41;
constexpr int ATTR_CC_MAJOR = 75, ATTR_CC_MINOR = 76;
constexpr int ATTR_HOST_POINTER_FOR_REGISTERED_MEM = 91;
constexpr int ATTR_64_BIT_STREAM_MEM_OPS = 122;  // the v2 memop attribute (92 is the legacy v1 one)
constexpr int GET_PROC_ADDRESS_DEFAULT = 0;
constexpr int PROC_ADDRESS_SUCCESS = 0;

// Driver API version whose ABI these signatures are (cuGetProcAddress's
// cudaVersion): 12.0 maps the memops to their _v2 entries (no module
// parameter needed) and cuMemHostRegister etc. to their current ABI.
constexpr int kApiVersion = 12000;
// Oldest driver with the v2 memops (11.7): on 11.7/11.8 the _v2 names are dlsym'd.
constexpr int kMinMemopDriver = 11070;
}  // namespace cu
}  // namespace gpusync
