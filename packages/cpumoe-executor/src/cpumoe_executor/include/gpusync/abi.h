/* gpusync versioned C ABI: the GPU side of the CPU MoE doorbell (protocol v1,
 * docs/protocol.md), backend-neutral. gpusync-cuda implements it on CUDA
 * (capsule "gpusync_cuda._native._C_API_v1"); gpusync-hip implements the same
 * table on ROCm (capsule "gpusync_hip._native._C_API_v1"). kernelio launches its
 * publish/combine kernels through the module/launch services at the end, so it
 * never loads a GPU runtime itself.
 *
 * Rules (docs/architecture.md, rule 2): the struct starts {abi_major, abi_minor,
 * struct_size}; functions are only appended (minor bump); a layout change
 * bumps the major and the capsule name. Enums are append-only.
 *
 * Every int-returning entry returns 0 on success, else a backend error code
 * (CUresult / hipError_t, or GPUSYNC_E_* below); the message, naming the
 * operation and the error, is in last_error() on the calling thread. */
#ifndef GPUSYNC_ABI_H
#define GPUSYNC_ABI_H
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "cpumoe_executor/abi.h" /* cpumoe_executor_api, protocol v1 */

#ifdef __cplusplus
extern "C" {
#endif

#define GPUSYNC_ABI_MAJOR 1
/* 1.1: step_submit and step_finish appended (the copy step in two halves) */
#define GPUSYNC_ABI_MINOR 1
#define GPUSYNC_CUDA_CAPSULE_NAME "gpusync_cuda._native._C_API_v1"
#define GPUSYNC_HIP_CAPSULE_NAME "gpusync_hip._native._C_API_v1"

/* Handshake paths (append-only). KERNEL is composed by the caller: kernelio's
 * publish rings, wait(MEMOP) waits, kernelio's combine reads y back. */
enum gpusync_path {
  GPUSYNC_PATH_EAGER = 0,  /* no GPU involvement: synchronous CPU decode */
  GPUSYNC_PATH_MEMOP = 1,  /* stream memops on the ready/done words */
  GPUSYNC_PATH_HOSTFN = 2, /* host-function nodes call the executor's hostfn_submit/hostfn_wait */
  GPUSYNC_PATH_KERNEL = 3  /* kernelio publish + MEMOP wait + kernelio combine */
};
#define GPUSYNC_PATH_COUNT 4

/* Errors that are not the runtime's own (negative, so they never collide). */
enum gpusync_error {
  GPUSYNC_E_NO_DRIVER = -1,       /* libcuda / libamdhip64 not loadable, or no device */
  GPUSYNC_E_UNSUPPORTED = -2,     /* entry point or device feature missing */
  GPUSYNC_E_INVALID = -3,         /* bad argument (layer, num_tokens, path...) */
  GPUSYNC_E_CAPTURE_REFUSED = -4, /* capturing, but no probe proved this path replay-safe */
  GPUSYNC_E_TIMEOUT = -5,         /* a bounded wait expired (the stream was released) */
  GPUSYNC_E_MISMATCH = -6,        /* probe: the result differs from the synchronous CPU result */
  GPUSYNC_E_INTERNAL = -7
};

typedef struct gpusync_device gpusync_device; /* one device's primary context, retained */
typedef struct gpusync_iob gpusync_iob;       /* one executor's IO block registered on a device */

typedef struct gpusync_api {
  uint32_t abi_major;
  uint32_t abi_minor;
  uint32_t struct_size;
  uint32_t protocol_version; /* CPUMOE_PROTOCOL_VERSION it speaks */
  const char *build_info;
  const char *backend; /* "cuda" or "hip" */
  const char *(*last_error)(void);

  /* Device: the primary context of `ordinal` (shared with torch/cupy), made
   * current around every call. Streams are integer handles (cudaStream_t). */
  int (*device_open)(int ordinal, gpusync_device **out);
  void (*device_close)(gpusync_device *d);

  /* IO block: register the executor's block for device access (host register
   * with device map) and bind its host-function entries. */
  int (*iob_register)(gpusync_device *d, const cpumoe_executor_api *exec_api, cpumoe_executor *exec,
                      gpusync_iob **out);
  void (*iob_release)(gpusync_iob *b);
  /* Device address of a host address inside the block (words and arrays). */
  int (*iob_device_ptr)(gpusync_iob *b, const void *host, uint64_t *dptr);

  /* Start-up probe of one path (MEMOP or HOSTFN): eager, then capture,
   * instantiate and replay with changed inputs against the running
   * coordinator, compared bit for bit with the synchronous CPU result.
   * *replay_safe = 1 only if all of it passed; report says what ran/failed.
   * Returns 0 when the probe ran (whatever its verdict). */
  int (*probe)(gpusync_iob *b, int path, double timeout_s, int *replay_safe, char *report, size_t report_len);
  /* Mark a path replay-safe without the native probe (the caller proved it). */
  int (*set_replay_safe)(gpusync_iob *b, int path, int safe);

  /* Doorbell on `stream`: submit = done := 0, ready := layer<<32|num_tokens;
   * wait = until done >= 1. Capture is refused (GPUSYNC_E_CAPTURE_REFUSED)
   * for a path no probe proved replay-safe. */
  int (*submit)(gpusync_iob *b, int path, uint64_t stream, uint32_t layer, uint32_t num_tokens);
  int (*wait)(gpusync_iob *b, int path, uint64_t stream);
  /* Copy path: x/ids/w (device, contiguous) -> block, submit, wait, block y -> y. */
  int (*step)(gpusync_iob *b, int path, uint64_t stream, uint32_t layer, uint32_t num_tokens, uint64_t x,
              uint64_t ids, uint64_t w, uint64_t y);
  const char *(*path_name)(int path);

  /* Stream helpers. capture_status: 0 none, 1 active, 2 invalidated.
   * sync waits at most timeout_s; on expiry it releases the stream (done :=
   * SHUTDOWN on the block) and returns GPUSYNC_E_TIMEOUT. */
  int (*stream_capture_status)(gpusync_device *d, uint64_t stream, int *status);
  int (*stream_sync)(gpusync_device *d, gpusync_iob *b_or_null, uint64_t stream, double timeout_s);

  /* Driver services for kernel modules (kernelio): a fatbin/cubin/PTX image
   * (CUDA) or code-object bundle (HIP), its functions, launches, memory. */
  int (*module_load)(gpusync_device *d, const void *image, void **module);
  int (*module_unload)(gpusync_device *d, void *module);
  int (*module_function)(gpusync_device *d, void *module, const char *name, void **fn);
  int (*launch)(gpusync_device *d, void *fn, const uint32_t grid[3], const uint32_t block[3], uint32_t smem,
                uint64_t stream, void **args);
  int (*mem_alloc)(gpusync_device *d, size_t bytes, uint64_t *dptr);
  int (*mem_free)(gpusync_device *d, uint64_t dptr);
  /* Register host memory for device access; *dptr = its device address. */
  int (*host_register)(gpusync_device *d, void *host, size_t bytes, uint64_t *dptr);
  int (*host_unregister)(gpusync_device *d, void *host);
  /* Stream-ordered copy between any two addresses (unified addressing). */
  int (*memcpy_async)(gpusync_device *d, uint64_t dst, uint64_t src, size_t bytes, uint64_t stream);

  /* ---- ABI 1.1 (appended) ----
   * The copy step in two halves on one stream, so the caller can enqueue other GPU work (its
   * GPU-resident experts) between them while the CPU runs the task (hybrid overlap):
   * step_submit = x/ids/w (device, contiguous) -> block (HIP: then the system-release event),
   * then submit; step_finish = wait, then block y -> y, for the submitted num_tokens.
   * step == step_submit + step_finish, the same operations in the same order. One task in flight
   * per IO block: every step_submit is followed by its step_finish on the same stream (under
   * capture, in the same graph) before the next step_submit; the caller keeps that order. Both
   * check everything before enqueuing anything; capture is refused as for step. */
  int (*step_submit)(gpusync_iob *b, int path, uint64_t stream, uint32_t layer, uint32_t num_tokens, uint64_t x,
                     uint64_t ids, uint64_t w);
  int (*step_finish)(gpusync_iob *b, int path, uint64_t stream, uint32_t num_tokens, uint64_t y);
} gpusync_api;

/* Consumer check: major equal, minor and size at least what it was built with. A consumer that
 * calls only ABI 1.0 entries may bind with minor 0 and offsetof(gpusync_api, step_submit) as the size
 * (a 1.0 provider's table ends there). */
static inline int gpusync_check_api_as(const gpusync_api *api, uint32_t major, uint32_t minor, size_t size,
                                       char *err, size_t errlen) {
  if (!api) {
    snprintf(err, errlen, "gpusync: capsule holds no API table");
    return -1;
  }
  if (api->abi_major != major || api->abi_minor < minor || api->struct_size < size ||
      api->protocol_version != CPUMOE_PROTOCOL_VERSION) {
    snprintf(err, errlen,
             "gpusync ABI mismatch: the installed gpusync-%s provides ABI %u.%u (protocol v%u) but this consumer "
             "was built against ABI %u.%u (protocol v%d); rebuild/reinstall the consumer (e.g. kernelio) against "
             "the installed gpusync-%s",
             api->backend ? api->backend : "?", api->abi_major, api->abi_minor, api->protocol_version, major, minor,
             CPUMOE_PROTOCOL_VERSION, api->backend ? api->backend : "?");
    return -1;
  }
  return 0;
}
#define gpusync_check_api(api, err, errlen) \
  gpusync_check_api_as((api), GPUSYNC_ABI_MAJOR, GPUSYNC_ABI_MINOR, sizeof(gpusync_api), (err), (errlen))

#ifdef __cplusplus
}
#endif
#endif
