// Run-time loading of the HIP runtime (see runtime.h for why) and the error scope.
#include "runtime.h"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <mutex>

#include "gpusync/abi.h"

namespace gpusync {
namespace {
// Newest first: a process normally holds one of these already (torch on ROCm).
const char* const kCandidates[] = {"libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so"};

std::string path_of(void* h, const std::string& fallback) {
  link_map* lm = nullptr;
  if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && *lm->l_name) return lm->l_name;
  return fallback;
}

void* open_library(Runtime& rt) {
  const char* env = std::getenv("GPUSYNC_HIP_LIBRARY");
  if (env && *env) {
    void* h = dlopen(env, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      rt.error = std::string("no HIP runtime: dlopen(\"") + env + "\") failed: " + (e ? e : "?") +
                 " (GPUSYNC_HIP_LIBRARY names it; unset it to search libamdhip64.so.{7,6,5})";
      return nullptr;
    }
    rt.choice = "GPUSYNC_HIP_LIBRARY";
    return h;
  }
  // 1. The runtime the process already loaded (torch-rocm bundles one): never a second copy.
  for (const char* name : kCandidates)
    if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) {
      rt.choice = std::string("already loaded in this process as ") + name;
      return h;
    }
  // 2. The newest installed one.
  std::string tried;
  for (const char* name : kCandidates) {
    if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) {
      rt.choice = std::string("first found of libamdhip64.so.{7,6,5,} on the library path: ") + name;
      return h;
    }
    const char* e = dlerror();
    tried += std::string(tried.empty() ? "" : "; ") + (e ? e : name);
  }
  rt.error = "no HIP runtime: none of libamdhip64.so.7/.so.6/.so.5/.so could be loaded (" + tried +
             "). Install ROCm (or set GPUSYNC_HIP_LIBRARY=/path/to/libamdhip64.so); decoding stays eager";
  return nullptr;
}

void load(Runtime& rt) {
  void* h = open_library(rt);
  if (!h) return;
  rt.library = path_of(h, std::getenv("GPUSYNC_HIP_LIBRARY") ? std::getenv("GPUSYNC_HIP_LIBRARY") : "?");
  if (!dlsym(h, "hipRuntimeGetVersion") && !dlsym(h, "hipGetDeviceCount")) {
    rt.error = "not a HIP runtime: " + rt.library + " exports neither hipRuntimeGetVersion nor hipGetDeviceCount";
    return;
  }
  std::string missing_required;
#define GPUSYNC_HIP_RESOLVE(name, required)                                                    \
  rt.name = reinterpret_cast<fn::name>(dlsym(h, #name));                                       \
  if (!rt.name) {                                                                              \
    if (required)                                                                              \
      missing_required += std::string(missing_required.empty() ? "" : ", ") + #name;           \
    else                                                                                       \
      rt.missing.push_back(#name);                                                             \
  }
  GPUSYNC_HIP_ENTRY_POINTS(GPUSYNC_HIP_RESOLVE)
#undef GPUSYNC_HIP_RESOLVE
  if (rt.hipRuntimeGetVersion) rt.hipRuntimeGetVersion(&rt.runtime_version);
  if (rt.hipDriverGetVersion) rt.hipDriverGetVersion(&rt.driver_version);
  if (!missing_required.empty()) {
    rt.error = "HIP runtime " + std::to_string(rt.runtime_version) + " (" + rt.library + ") lacks " +
               missing_required;
    return;
  }
  rt.loaded = true;
  // Our probe of the device count must not hide an error someone else left, nor leave ours.
  const hipError_t before = rt.hipPeekAtLastError();
  const hipError_t rc = rt.hipGetDeviceCount(&rt.device_count);
  if (before == hipSuccess) rt.hipGetLastError();
  if (rc != hipSuccess || rt.device_count < 1) {
    rt.error = "no usable HIP device: hipGetDeviceCount " +
               (rc != hipSuccess ? "failed: " + rt.name(rc) : std::string("found 0 devices"));
    return;
  }
  rt.initialized = true;
}
}  // namespace

std::string Runtime::name(hipError_t rc) const {
  const char* n = hipGetErrorName ? hipGetErrorName(rc) : nullptr;
  const char* s = hipGetErrorString ? hipGetErrorString(rc) : nullptr;
  std::string out = n ? n : ("hipError_t " + std::to_string(rc));
  if (s && (!n || std::string(s) != n)) out += std::string(" (") + s + ")";
  return out;
}

void Runtime::fail(hipError_t rc, const std::string& op, const std::string& note) const {
  throw Error(rc, op + " failed: " + name(rc) + note);
}

void Runtime::require() const {
  if (!loaded || !initialized) throw Error(GPUSYNC_E_NO_DRIVER, error);
}

const Runtime& Runtime::get() {
  static Runtime rt;
  static std::once_flag once;
  std::call_once(once, [] { load(rt); });
  return rt;
}

namespace {
thread_local int g_scope_depth = 0;  // only the outermost scope checks and consumes
}

ErrorScope::ErrorScope(const Runtime& rt, const char* op) : rt_(rt) {
  if (g_scope_depth > 0) {
    ++g_scope_depth;
    return;
  }
  const hipError_t pending = rt.hipPeekAtLastError();
  if (pending != hipSuccess)
    throw Error(pending, std::string(op) + ": refused: an earlier HIP error is pending on this thread: " +
                             rt.name(pending) +
                             ". gpusync_hip did not cause it and leaves it in place for its owner (hipGetLastError "
                             "/ torch.cuda.synchronize() shows where it came from)");
  ++g_scope_depth;
}

ErrorScope::~ErrorScope() {
  if (--g_scope_depth == 0) rt_.hipGetLastError();
}
}  // namespace gpusync
