// The HIP runtime, loaded at run time: every entry point of hip_types.h is
// resolved by name with dlsym, so one build serves ROCm 5.x, 6.x, 7.x and 10.x
// (and Debian's 5.2.3, which lacks hipLaunchHostFunc and every 6.x API). A
// missing optional entry point makes the path that needs it unavailable; it is
// never a link error or a crash. Nothing links libamdhip64.
#pragma once
#include <stdexcept>
#include <string>
#include <vector>

#include "hip_types.h"

namespace gpusync {
using namespace hip;

// A failed HIP operation: the operation, the hipError_t and its name.
struct Error : std::runtime_error {
  int code;
  Error(int c, const std::string& msg) : std::runtime_error(msg), code(c) {}
};

struct Runtime {
  // ---- status ----
  bool loaded = false;        // library opened and the required entries resolved
  bool initialized = false;   // hipGetDeviceCount found at least one device
  std::string error;          // why not, when !loaded or !initialized
  std::string library;        // the file that was opened (resolved path when known)
  std::string choice;         // which candidate was chosen and why
  int runtime_version = 0;    // hipRuntimeGetVersion (HIP_VERSION encoding: major*1e7 + minor*1e5 + patch)
  int driver_version = 0;     // hipDriverGetVersion, 0 if unavailable
  int device_count = 0;
  std::vector<std::string> missing;  // optional entries the runtime lacks

  // ---- entry points ----
#define GPUSYNC_HIP_SLOT(name, required) fn::name name = nullptr;
  GPUSYNC_HIP_ENTRY_POINTS(GPUSYNC_HIP_SLOT)
#undef GPUSYNC_HIP_SLOT

  bool has_memops() const { return hipStreamWriteValue64 && hipStreamWaitValue64; }
  bool has_signal_memory() const { return hipExtMallocWithFlags != nullptr; }
  bool has_graphs() const {
    return hipStreamBeginCapture && hipStreamEndCapture && hipGraphInstantiate && hipGraphLaunch &&
           hipGraphExecDestroy && hipGraphDestroy;
  }
  // The explicit-node splice: capture info, add node, update dependencies, rollback.
  bool has_splice() const {
    return hipStreamGetCaptureInfo_v2 && hipGraphAddBatchMemOpNode && hipStreamUpdateCaptureDependencies &&
           hipGraphDestroyNode;
  }
  // The release event, recorded as a replayed node under capture (HIP 6.4.2+).
  bool has_release_event() const { return hipEventCreateWithFlags && hipEventRecord && hipEventDestroy; }
  bool has_captured_release_event() const { return has_release_event() && hipEventRecordWithFlags; }
  bool has_modules() const {
    return hipModuleLoadData && hipModuleUnload && hipModuleGetFunction && hipModuleLaunchKernel;
  }

  // "hipErrorInvalidValue (invalid argument)"
  std::string name(hipError_t rc) const;
  void check(hipError_t rc, const std::string& op) const {
    if (rc != hipSuccess) fail(rc, op);
  }
  [[noreturn]] void fail(hipError_t rc, const std::string& op, const std::string& note = "") const;
  // Throws Error(GPUSYNC_E_NO_DRIVER) with the reason unless usable.
  void require() const;

  // The process-wide runtime, loaded on first use (GPUSYNC_HIP_LIBRARY overrides the choice).
  static const Runtime& get();
};

// The error scope of every gpusync-hip operation (seed 000's recovery rules):
// on entry, an error the caller already had (hipPeekAtLastError) is raised and
// left in place, never hidden or consumed; on exit, the errors our own calls
// created are consumed (hipGetLastError), so the caller's next ordinary HIP
// call does not fail on our leftovers. Failures we report are thrown as Error.
class ErrorScope {
 public:
  ErrorScope(const Runtime& rt, const char* op);
  ~ErrorScope();
  ErrorScope(const ErrorScope&) = delete;
  ErrorScope& operator=(const ErrorScope&) = delete;

 private:
  const Runtime& rt_;
};
}  // namespace gpusync
