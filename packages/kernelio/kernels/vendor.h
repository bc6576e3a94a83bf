// The few vendor differences kernelio.cu needs, so one source builds with nvcc
// (CUDA) and hipcc (ROCm, __HIP_PLATFORM_AMD__). Keep it this thin: anything
// more belongs in the kernel as portable code.
#pragma once

#if defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
// Uncached 16-byte load of memory the CPU writes (y in the mapped IO block):
// a nontemporal load per lane, so no stale cache line is returned.
__device__ inline uint4 kio_load_uncached(const uint4* p) {
  const unsigned* q = reinterpret_cast<const unsigned*>(p);
  uint4 v;
  v.x = __builtin_nontemporal_load(q + 0);
  v.y = __builtin_nontemporal_load(q + 1);
  v.z = __builtin_nontemporal_load(q + 2);
  v.w = __builtin_nontemporal_load(q + 3);
  return v;
}
__device__ inline unsigned short kio_load_uncached(const unsigned short* p) { return __builtin_nontemporal_load(p); }
#else
#include <stdint.h>
// ld.global.cv: "cache volatile", fetch again on every load (never a stale line).
__device__ inline uint4 kio_load_uncached(const uint4* p) { return __ldcv(p); }
__device__ inline unsigned short kio_load_uncached(const unsigned short* p) { return __ldcv(p); }
#endif

// Both platforms spell these the same; named here so the kernel says which
// ordering it relies on.
#define kio_fence_system() __threadfence_system()
#define KIO_EXTERN_C extern "C"
