/* cpumoe-executor versioned C ABI: what a GPU sync backend (gpusync-cuda,
 * gpusync-hip) binds to. PyCapsule CPUMOE_EXECUTOR_CAPSULE_NAME in
 * cpumoe_executor._native holds a `const cpumoe_executor_api*`. */
#ifndef CPUMOE_EXECUTOR_ABI_H
#define CPUMOE_EXECUTOR_ABI_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cpumoe_executor/protocol.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CPUMOE_EXECUTOR_ABI_MAJOR 1
#define CPUMOE_EXECUTOR_ABI_MINOR 0
#define CPUMOE_EXECUTOR_CAPSULE_NAME "cpumoe_executor._native._C_API_v1"

/* opaque; Python's Executor.handle. Valid while the Python executor lives (hold a reference to it). Every entry
 * may be called from any thread: tasks run one at a time per executor. Once the executor is closed, or in a
 * forked child of the process that created it, run_task and hostfn_submit run nothing and set the error word
 * (CPUMOE_ERR_INTERNAL), hostfn_wait returns at once, and hostfn_arg returns NULL in a forked child
 * (docs/protocol.md, "Threads, lifetime, fork"). */
typedef struct cpumoe_executor cpumoe_executor;

/* Argument of the host-function entry points: one per (layer, num_tokens),
 * allocated by hostfn_arg() and owned by the executor (stable address for
 * graph capture, freed with the executor). */
typedef struct cpumoe_hostfn_arg {
  cpumoe_executor *exec;
  uint64_t task;
} cpumoe_hostfn_arg;

typedef struct cpumoe_executor_api {
  uint32_t abi_major;
  uint32_t abi_minor;
  uint32_t struct_size;
  uint32_t protocol_version;
  const char *build_info;
  /* The IO block (host address). */
  cpumoe_iob_header *(*iob)(cpumoe_executor *e);
  /* Stable argument for hostfn_submit/hostfn_wait; NULL if layer/num_tokens are invalid. */
  cpumoe_hostfn_arg *(*hostfn_arg)(cpumoe_executor *e, uint32_t layer, uint32_t num_tokens);
  /* Host-function entry points (signature of cudaHostFn_t / hipHostFn_t).
   * submit: with the coordinator running, rings the doorbell exactly as the GPU
   * would (done = 0, then ready = task) and returns; without it, runs the task.
   * wait: returns once done >= 1. Neither touches any GPU API. */
  void (*hostfn_submit)(void *arg);
  void (*hostfn_wait)(void *arg);
  /* Run a task on the IO block synchronously on the calling thread (with the
   * pool). Returns a cpumoe_error_code and sets the error word on failure. */
  int32_t (*run_task)(cpumoe_executor *e, uint64_t task);
} cpumoe_executor_api;

static inline int cpumoe_executor_check_api_as(const cpumoe_executor_api *api, uint32_t major, uint32_t minor,
                                               size_t size, char *err, size_t errlen) {
  if (!api) {
    snprintf(err, errlen, "cpumoe-executor: capsule holds no API table");
    return -1;
  }
  if (api->abi_major != major || api->abi_minor < minor || api->struct_size < size ||
      api->protocol_version != CPUMOE_PROTOCOL_VERSION) {
    snprintf(err, errlen,
             "cpumoe-executor ABI mismatch: the installed cpumoe-executor provides ABI %u.%u (protocol v%u) but "
             "this consumer was built against ABI %u.%u (protocol v%d); rebuild/reinstall the consumer against "
             "the installed cpumoe-executor",
             api->abi_major, api->abi_minor, api->protocol_version, major, minor, CPUMOE_PROTOCOL_VERSION);
    return -1;
  }
  return 0;
}
#define cpumoe_executor_check_api(api, err, errlen)                                                       \
  cpumoe_executor_check_api_as((api), CPUMOE_EXECUTOR_ABI_MAJOR, CPUMOE_EXECUTOR_ABI_MINOR,              \
                               sizeof(cpumoe_executor_api), (err), (errlen))

#ifdef __cplusplus
}
#endif
#endif
