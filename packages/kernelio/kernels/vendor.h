// The few vendor differences kernelio.cu needs, so one source builds with nvcc
// (CUDA) and hipcc/clang -x hip (ROCm). Keep it this thin: anything more
// belongs in the kernel as portable code. kernelio.cu must spell every
// vendor-specific operation through a kio_* name below (tests/test_hip.py
// scans it for CUDA-only spellings).
//
// The HIP branch is chosen by __HIP__ (clang's HIP language mode), not by
// __HIP_PLATFORM_AMD__: hipcc 5.x only defines the latter inside
// hip_runtime.h, which is what this branch includes.
#pragma once

#if defined(__HIP__) || defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>
#include <stdint.h>
// Load of memory the CPU writes (y in the mapped IO block) that no stale cache
// line can answer: a relaxed system-scope atomic load per 32/16-bit word, which
// the AMDGPU memory model lowers to a load bypassing the non-coherent caches
// (glc on gfx90a, glc dlc on gfx1030; a plain nontemporal load gives only slc
// on gfx10). Ordering comes from the stream wait before the kernel.
__device__ inline unsigned kio_load_sys(const unsigned* p) {
  return __hip_atomic_load(const_cast<unsigned*>(p), __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ inline uint4 kio_load_uncached(const uint4* p) {
  const unsigned* q = reinterpret_cast<const unsigned*>(p);
  uint4 v;
  v.x = kio_load_sys(q + 0);
  v.y = kio_load_sys(q + 1);
  v.z = kio_load_sys(q + 2);
  v.w = kio_load_sys(q + 3);
  return v;
}
__device__ inline unsigned short kio_load_uncached(const unsigned short* p) {
  return __hip_atomic_load(const_cast<unsigned short*>(p), __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// One system fence for a whole block's prior stores is NOT relied on here:
// every thread fences its own (the AMDGPU memory model's waits are per wave).
#define KIO_BLOCK_FENCE_BY_ONE 0
// Device-scope flag between the blocks of one launch (combine's grid poll).
__device__ inline void kio_store_release_device(unsigned* p, unsigned v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_AGENT);
}
__device__ inline unsigned kio_load_acquire_device(unsigned* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_AGENT);
}
// HIP's __threadfence_system: a system-scope seq_cst fence (on gfx9: L2
// write-back, wait for outstanding memory, L1/L2 invalidate).
#define kio_fence_system() __threadfence_system()
// Doorbell words: a system-scope release store (buffer_wbl2 + wait + store on
// gfx90a), so the word reaches host memory after everything fenced before it.
__device__ inline void kio_store_system(volatile unsigned long long* p, unsigned long long v) {
  __hip_atomic_store(const_cast<unsigned long long*>(p), v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
// The in-kernel wait's poll of done (combine with wait = 1): a system-scope
// acquire load, so the loads of y after it (and, through the block barrier,
// every thread's) see what the CPU stored before its release of done.
__device__ inline unsigned long long kio_load_acquire_system(const volatile unsigned long long* p) {
  return __hip_atomic_load(const_cast<unsigned long long*>(p), __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
// Nanoseconds for the poll's timeout: wall_clock64() runs at a constant rate
// the device reports (hipDeviceAttributeWallClockRate); 100 MHz on gfx90a,
// gfx942 and RDNA parts. Assumed here: a device at another rate scales the
// timeout (a safety net of ~10 s), never the result.
#define KIO_WALL_CLOCK_HZ 100000000ull
__device__ inline unsigned long long kio_time_ns() { return wall_clock64() * (1000000000ull / KIO_WALL_CLOCK_HZ); }
#else
#include <stdint.h>
// ld.global.cv: "cache volatile", fetch again on every load (never a stale line).
__device__ inline uint4 kio_load_uncached(const uint4* p) { return __ldcv(p); }
__device__ inline unsigned short kio_load_uncached(const unsigned short* p) { return __ldcv(p); }
// membar.sys: orders this thread's prior stores before its later ones for every observer.
#define kio_fence_system() __threadfence_system()
// A volatile store (st.volatile.global): never cached or merged; the ordering
// comes from the kio_fence_system() calls around it.
__device__ inline void kio_store_system(volatile unsigned long long* p, unsigned long long v) { *p = v; }
// The in-kernel wait's poll of done (combine with wait = 1): ld.acquire.sys,
// a system-scope acquire load (never answered by a stale cache line), so the
// loads of y after it (and, through the block barrier, every thread's) see
// what the CPU stored before its release of done. sm_70+ (we build sm_75+).
__device__ inline unsigned long long kio_load_acquire_system(const volatile unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// The PTX memory model's causality order is transitive and bar.sync synchronizes
// the threads of a CTA, so after __syncthreads() ONE thread's fence.sc.sys orders
// every thread's earlier stores before that thread's later ones, for every
// observer: a block pays one system fence, not one per thread.
#define KIO_BLOCK_FENCE_BY_ONE 1
// Device-scope flag between the blocks of one launch (combine's grid poll).
__device__ inline void kio_store_release_device(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ inline unsigned kio_load_acquire_device(unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// %globaltimer: nanoseconds, the same clock on every SM (the poll's timeout).
__device__ inline unsigned long long kio_time_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

// Device-scope fence (combine's block counter): the same spelling in CUDA and HIP.
#define kio_fence_device() __threadfence()
#define KIO_EXTERN_C extern "C"
