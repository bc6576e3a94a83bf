// Backend-neutral pieces of the doorbell shared by gpusync-cuda and gpusync-hip
// (header-only, C++ only, internal to the two backends; consumers use abi.h):
// path names, the check of an executor's IO block before it is registered, and
// the probe's deterministic inputs.
#ifndef GPUSYNC_BACKEND_COMMON_H
#define GPUSYNC_BACKEND_COMMON_H
#ifndef __cplusplus
#error "gpusync/backend_common.h is C++ only; C consumers include gpusync/abi.h"
#endif
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cpumoe_executor/abi.h"
#include "gpusync/abi.h"

namespace gpusync {
namespace common {

inline const char* path_name(int path) {
  switch (path) {
    case GPUSYNC_PATH_EAGER: return "eager";
    case GPUSYNC_PATH_MEMOP: return "memop";
    case GPUSYNC_PATH_HOSTFN: return "host-func";
    case GPUSYNC_PATH_KERNEL: return "kernel";
    default: return "unknown";
  }
}

inline std::string hex(uint64_t v) {
  char b[32];
  std::snprintf(b, sizeof b, "0x%llx", (unsigned long long)v);
  return b;
}

// The executor's IO block, after checking its table, its handle and the
// block's protocol; throws the backend's Error naming the package (`pkg`).
template <class Error>
cpumoe_iob_header* checked_iob(const cpumoe_executor_api* api, cpumoe_executor* exec, const char* pkg) {
  char err[512];
  if (cpumoe_executor_check_api(api, err, sizeof err)) throw Error(GPUSYNC_E_INVALID, err);
  if (!exec) throw Error(GPUSYNC_E_INVALID, "executor handle is NULL");
  cpumoe_iob_header* hdr = api->iob(exec);
  if (!hdr || hdr->magic != CPUMOE_IOB_MAGIC || hdr->version != CPUMOE_PROTOCOL_VERSION)
    throw Error(GPUSYNC_E_INVALID, "IO block protocol mismatch: the executor's block is version " +
                                       std::to_string(hdr ? hdr->version : 0) + " (magic " +
                                       hex(hdr ? hdr->magic : 0) + ") but " + pkg + " speaks protocol v" +
                                       std::to_string(CPUMOE_PROTOCOL_VERSION) +
                                       "; reinstall matching cpumoe-executor and " + pkg);
  return hdr;
}

// A probe's task inputs.
struct ProbeInputs {
  std::vector<uint16_t> x;
  std::vector<int32_t> ids;
  std::vector<float> w;
};

// Deterministic, changes with the seed: finite bf16 x, routes to expert 0 (the
// only id every executor has) or -1, positive weights.
inline ProbeInputs make_probe_inputs(uint32_t seed, size_t T, size_t H, size_t K) {
  uint64_t s = 0x9E3779B97F4A7C15ull * (seed + 1);
  auto next = [&s] { return (uint32_t)((s = s * 6364136223846793005ull + 1442695040888963407ull) >> 33); };
  ProbeInputs in;
  in.x.resize(T * H), in.ids.resize(T * K), in.w.resize(T * K);
  for (auto& v : in.x) {
    float f = ((int)(next() % 4001) - 2000) / 1000.0f;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    v = (uint16_t)(u >> 16);
  }
  for (size_t r = 0; r < T * K; ++r) {
    in.ids[r] = (r == 0 || next() % 3) ? 0 : -1;
    in.w[r] = 0.05f + (next() % 1000) / 1000.0f;
  }
  return in;
}

}  // namespace common
}  // namespace gpusync
#endif  // GPUSYNC_BACKEND_COMMON_H
