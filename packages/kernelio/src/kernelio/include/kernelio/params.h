/* kernelio kernel parameters: one struct per kernel, passed by value as the
 * kernel's only argument. Shared by kernels/kernelio.cu (nvcc / hipcc) and the
 * host launcher (c++), so every field is fixed-width and addresses are u64:
 * the layout is identical on both sides without any CUDA header. */
#ifndef KERNELIO_PARAMS_H
#define KERNELIO_PARAMS_H
#include <stdint.h>

#define KERNELIO_PARAMS_VERSION 2
#define KERNELIO_THREADS 256 /* block size of both kernels */
#define KERNELIO_SCRATCH_BYTES 64 /* device scratch per IO block: u32 blocks_done | blocks_with_cpu_routes << 16, u32 skip, u32 poll_timeouts, u32 combine flag, u32 combine blocks left */

typedef struct kio_publish_params {
  uint64_t x, ids, w;      /* device inputs: bf16 [T, x_stride], int32 [T, ids_stride], fp32 [T, w_stride] */
  int64_t x_stride, ids_stride, w_stride; /* in elements */
  uint64_t resident;       /* device u8 [num_experts], 1 = expert runs on the GPU (route -> -1); 0 = none */
  uint64_t io_x, io_ids, io_w; /* mapped device addresses of the IO block arrays */
  uint64_t ready, done;    /* mapped device addresses of the doorbell words */
  uint64_t scratch;        /* device u32[2]: blocks finished and CPU-routed (last-block-done), skip flag for combine */
  uint64_t task;           /* layer << 32 | num_tokens */
  int32_t T, H, K, num_experts;
  int32_t vec;             /* 1: x rows and io_x 16-byte aligned and H % 8 == 0 (16-byte copies) */
  int32_t reserved;
} kio_publish_params;

typedef struct kio_combine_params {
  uint64_t io_y;       /* mapped device address of the IO block's y, bf16 [T, H] */
  uint64_t out;        /* device bf16 [T, out_stride] */
  int64_t out_stride;  /* in elements */
  uint64_t scratch;    /* the publish kernel's scratch: skip flag at [1], poll timeouts at [2] */
  int32_t T, H;
  int32_t accumulate;  /* 0: out = y; 1: out = bf16(float(out) + float(y)) (a GPU partial, in place) */
  int32_t vec;         /* 1: out rows 16-byte aligned and H % 8 == 0 */
  uint64_t done;       /* mapped device address of the done word (wait = 1 polls it) */
  uint64_t timeout_ns; /* wait = 1: give up after this long, count it in scratch[2], read no y */
  int32_t wait;        /* 1: wait for done >= 1 in the kernel; 0: the stream waited (memop) already */
  int32_t reserved;
} kio_combine_params;

#endif
