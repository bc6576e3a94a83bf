// Compile-time check of hip_types.h against the real HIP header, when the build
// machine has one (hatch_build.py passes -DGPUSYNC_HIP_CHECK and the include
// dir). Each group is guarded by the HIP_VERSION that introduced it, so an old
// SDK (Debian's 5.2.3) checks what it has and a 6.4+ SDK checks the rest.
// Nothing is linked against libamdhip64: this object holds no code.
//
// Many flags are macros in the real header, so our values are captured into
// ours_<name> BEFORE it is included, then compared after.
#if defined(GPUSYNC_HIP_CHECK) && defined(__has_include)
#if __has_include(<hip/hip_runtime_api.h>)
#include <type_traits>

#include "hip_types.h"

namespace h = gpusync::hip;
#define VALUES_5_0(X) X(hipSuccess) X(hipErrorInvalidValue) X(hipErrorOutOfMemory) X(hipErrorNotInitialized) X(hipErrorInvalidDevice) X(hipErrorNoDevice) X(hipErrorNoBinaryForGpu) X(hipErrorInvalidHandle) X(hipErrorNotFound) X(hipErrorNotReady) X(hipErrorHostMemoryAlreadyRegistered) X(hipErrorHostMemoryNotRegistered) X(hipErrorNotSupported) X(hipErrorStreamCaptureUnsupported) X(hipErrorStreamCaptureInvalidated) X(hipErrorStreamCaptureUnjoined) X(hipErrorStreamCaptureImplicit) X(hipErrorUnknown) X(hipStreamDefault) X(hipStreamNonBlocking) X(hipDeviceMallocDefault) X(hipMallocSignalMemory) X(hipHostRegisterDefault) X(hipHostRegisterPortable) X(hipHostRegisterMapped) X(hipEventDefault) X(hipEventBlockingSync) X(hipEventDisableTiming) X(hipEventInterprocess) X(hipEventReleaseToDevice) X(hipEventReleaseToSystem) X(hipStreamWaitValueGte) X(hipStreamWaitValueEq) X(hipStreamWaitValueAnd) X(hipStreamWaitValueNor) X(hipMemcpyHostToHost) X(hipMemcpyHostToDevice) X(hipMemcpyDeviceToHost) X(hipMemcpyDeviceToDevice) X(hipMemcpyDefault) X(hipStreamCaptureStatusNone) X(hipStreamCaptureStatusActive) X(hipStreamCaptureStatusInvalidated) X(hipStreamCaptureModeGlobal) X(hipStreamCaptureModeThreadLocal) X(hipStreamCaptureModeRelaxed) X(hipStreamAddCaptureDependencies) X(hipStreamSetCaptureDependencies) X(hipGraphNodeTypeKernel) X(hipGraphNodeTypeMemcpy) X(hipGraphNodeTypeMemset) X(hipGraphNodeTypeHost) X(hipGraphNodeTypeGraph) X(hipGraphNodeTypeEmpty) X(hipGraphNodeTypeWaitEvent) X(hipGraphNodeTypeEventRecord) X(hipDeviceAttributeCanUseStreamWaitValue)
#define VALUES_5_6(X) X(hipEventDisableSystemFence)
#define VALUES_6_4(X) X(hipStreamMemOpWaitValue32) X(hipStreamMemOpWriteValue32) X(hipStreamMemOpFlushRemoteWrites) X(hipStreamMemOpWaitValue64) X(hipStreamMemOpWriteValue64) X(hipStreamMemOpBarrier)
#define VALUES_6_4_2(X) X(hipEventRecordDefault) X(hipEventRecordExternal)
#define SIGS_5_0(X) X(hipGetDeviceCount) X(hipSetDevice) X(hipGetDevice) X(hipDeviceGetAttribute) X(hipRuntimeGetVersion) X(hipDriverGetVersion) X(hipGetLastError) X(hipPeekAtLastError) X(hipGetErrorString) X(hipGetErrorName) X(hipStreamCreateWithFlags) X(hipStreamDestroy) X(hipStreamSynchronize) X(hipStreamQuery) X(hipExtMallocWithFlags) X(hipFree) X(hipHostRegister) X(hipHostUnregister) X(hipHostGetDevicePointer) X(hipMemcpyAsync) X(hipStreamWriteValue64) X(hipStreamWaitValue64) X(hipStreamBeginCapture) X(hipStreamEndCapture) X(hipStreamIsCapturing) X(hipStreamGetCaptureInfo_v2) X(hipStreamUpdateCaptureDependencies) X(hipGraphCreate) X(hipGraphInstantiate) X(hipGraphLaunch) X(hipGraphExecDestroy) X(hipGraphDestroy) X(hipGraphDestroyNode) X(hipGraphGetNodes) X(hipGraphNodeGetType) X(hipEventCreateWithFlags) X(hipEventRecord) X(hipEventDestroy) X(hipEventSynchronize) X(hipLaunchHostFunc) X(hipGraphAddHostNode) X(hipModuleLoadData) X(hipModuleUnload) X(hipModuleGetFunction) X(hipModuleLaunchKernel)
#define CAPTURE(name) constexpr long long ours_##name = (long long)(h::name);
VALUES_5_0(CAPTURE)
VALUES_5_6(CAPTURE)
VALUES_6_4(CAPTURE)
VALUES_6_4_2(CAPTURE)

#ifndef __HIP_PLATFORM_AMD__
#define __HIP_PLATFORM_AMD__ 1
#endif
#include <hip/hip_runtime_api.h>
#include <hip/hip_version.h>

// Our signatures use int for the header's enums (same size): compare after mapping
// every enum (and pointer to enum) in the header's signature to int.
template <class T, class = void>
struct norm { using type = T; };
template <class T>
struct norm<T, std::enable_if_t<std::is_enum<T>::value>> { using type = int; };
template <class T>
struct norm<T*, void> { using type = typename norm<T>::type*; };
template <class T>
struct norm<const T, std::enable_if_t<!std::is_pointer<T>::value>> { using type = const typename norm<T>::type; };
template <>
struct norm<::hipHostNodeParams, void> { using type = h::hipHostNodeParams; };
#if HIP_VERSION >= 60400000
template <>
struct norm<::hipBatchMemOpNodeParams, void> { using type = h::hipBatchMemOpNodeParams; };
#endif
template <class F>
struct sig;
template <class R, class... A>
struct sig<R (*)(A...)> { using type = typename norm<R>::type (*)(typename norm<A>::type...); };

#define SAME(name) static_assert(ours_##name == (long long)(name), #name " differs from the HIP header");
#define SIG(name) \
  static_assert(std::is_same<h::fn::name, sig<decltype(&::name)>::type>::value, #name " signature differs");

static_assert(std::is_same<h::hipStream_t, ::hipStream_t>::value, "hipStream_t");
static_assert(std::is_same<h::hipEvent_t, ::hipEvent_t>::value, "hipEvent_t");
static_assert(std::is_same<h::hipGraph_t, ::hipGraph_t>::value, "hipGraph_t");
static_assert(std::is_same<h::hipGraphNode_t, ::hipGraphNode_t>::value, "hipGraphNode_t");
static_assert(std::is_same<h::hipGraphExec_t, ::hipGraphExec_t>::value, "hipGraphExec_t");
static_assert(std::is_same<h::hipModule_t, ::hipModule_t>::value, "hipModule_t");
static_assert(std::is_same<h::hipFunction_t, ::hipFunction_t>::value, "hipFunction_t");
static_assert(std::is_same<h::hipCtx_t, ::hipCtx_t>::value, "hipCtx_t");
static_assert(sizeof(::hipError_t) == sizeof(int) && sizeof(::hipStreamCaptureStatus) == sizeof(int) &&
                  sizeof(::hipMemcpyKind) == sizeof(int) && sizeof(::hipDeviceAttribute_t) == sizeof(int),
              "enums are int-sized");
static_assert(sizeof(h::hipHostNodeParams) == sizeof(::hipHostNodeParams), "hipHostNodeParams");
static_assert(offsetof(h::hipHostNodeParams, userData) == offsetof(::hipHostNodeParams, userData), "userData");
VALUES_5_0(SAME)
SIGS_5_0(SIG)

#if HIP_VERSION >= 50600000  // hipEventDisableSystemFence: rocm-5.6
VALUES_5_6(SAME)
#endif

#if HIP_VERSION >= 60400000  // batch memops and their graph node: HIP 6.4
VALUES_6_4(SAME)
static_assert(sizeof(h::hipStreamBatchMemOpParams) == sizeof(::hipStreamBatchMemOpParams), "batch op params");
static_assert(offsetof(h::hipStreamBatchMemOpParams, waitValue.address) ==
                  offsetof(::hipStreamBatchMemOpParams, waitValue.address), "waitValue.address");
static_assert(offsetof(h::hipStreamBatchMemOpParams, waitValue.value64) ==
                  offsetof(::hipStreamBatchMemOpParams, waitValue.value64), "waitValue.value64");
static_assert(offsetof(h::hipStreamBatchMemOpParams, waitValue.flags) ==
                  offsetof(::hipStreamBatchMemOpParams, waitValue.flags), "waitValue.flags");
static_assert(offsetof(h::hipStreamBatchMemOpParams, writeValue.value64) ==
                  offsetof(::hipStreamBatchMemOpParams, writeValue.value64), "writeValue.value64");
static_assert(sizeof(h::hipBatchMemOpNodeParams) == sizeof(::hipBatchMemOpNodeParams), "node params");
static_assert(offsetof(h::hipBatchMemOpNodeParams, count) == offsetof(::hipBatchMemOpNodeParams, count), "count");
static_assert(offsetof(h::hipBatchMemOpNodeParams, paramArray) == offsetof(::hipBatchMemOpNodeParams, paramArray),
              "paramArray");
static_assert(offsetof(h::hipBatchMemOpNodeParams, flags) == offsetof(::hipBatchMemOpNodeParams, flags), "flags");
SIG(hipGraphAddBatchMemOpNode)
#endif

#if HIP_VERSION >= 60402000  // hipEventRecordWithFlags implemented in HIP 6.4.2
VALUES_6_4_2(SAME)
SIG(hipEventRecordWithFlags)
#endif
#endif  // __has_include
#endif  // GPUSYNC_HIP_CHECK
