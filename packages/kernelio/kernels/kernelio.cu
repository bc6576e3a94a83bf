// kernelio: move one decode step's inputs into the executor's IO block and its
// output back, from the GPU stream, with no copies and no host involvement
// (protocol v1, docs/protocol.md). One source for nvcc and hipcc (vendor.h).
//
// publish: done := 0 (one thread, first), then x (bf16), ids (int32, routes of
//   GPU-resident experts -> -1) and w (fp32) are stored through the block's
//   mapped device address by every block; each block's stores are fenced
//   system-wide (CUDA: barrier, then one fence by thread 0; HIP: a fence per
//   thread, vendor.h says why) before the block counts itself done; the
//   LAST block to finish (a device-scope counter, reset by that block for the
//   next launch/replay) fences once more and either completes the step itself
//   (done := 1, no doorbell: no route goes to the CPU) or rings ready := task.
//   So no CPU can see the doorbell before done = 0 and every payload store of
//   every block. A launch of one block (decode sizes up to 2,048 16-byte
//   items) needs no counter and fences once: barrier, then thread 0's fence.
// combine: once done >= 1, y is read uncached from the block and written to
//   `out`, or added into a GPU partial in place with the same arithmetic as
//   torch's bf16 add (fp32 sum, round to nearest even). A skipped step reads
//   no y (and waits for nothing): it writes zeros / adds zeros.
//   wait = 0: the stream's memop wait (done >= 1) ran before the kernel.
//   wait = 1: the kernel waits itself (a satisfied memop wait in a graph costs
//   more than a poll): thread 0 of block 0 polls done with system-scope acquire
//   loads and passes what it saw to the other blocks through a device-scope
//   release of scratch[3] (1 = done, 2 = timed out), which their thread 0 polls
//   in L2 with acquire loads; the PTX model's causality is transitive, so their
//   reads of y still follow the CPU's release of done. The last block to leave
//   clears scratch[3] for the next launch (a counter in scratch[4]). Then each
//   block's barrier releases its threads to read y, so the grid and the
//   parallelism of the PCIe reads of y stay as they were. One PCIe poller per
//   launch, not one per block: on the H200 batch 8 (8 blocks) 14.2-15.0 ->
//   9.1-9.3 us per layer above the CPU's service time. (Measured slower: one
//   warp of a block polling and copying its y alone, +0.9 us at batch 1; 2-8
//   staggered polling warps per block, +6-50 us at batch 8.)
//   Bounded: after timeout_ns block 0 gives up and passes that on (the others
//   give up themselves 1 s later at the latest); a block that gave up counts a
//   timeout in scratch[2] and returns without reading y or writing out; the
//   host reads that count (KernelIO::poll_timeouts) and raises.

#include "vendor.h"
#include "kernelio/params.h"

namespace {
__device__ __forceinline__ float bf16_to_f32(unsigned b) { return __uint_as_float(b << 16); }

// Round to nearest even; NaN -> 0x7FC0 (torch's c10::BFloat16 rule).
__device__ __forceinline__ unsigned f32_to_bf16(float f) {
  const unsigned u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ unsigned add_pair(unsigned o, unsigned y) {  // two bf16 lanes per word
  const unsigned lo = f32_to_bf16(bf16_to_f32(o & 0xFFFFu) + bf16_to_f32(y & 0xFFFFu));
  const unsigned hi = f32_to_bf16(bf16_to_f32(o >> 16) + bf16_to_f32(y >> 16));
  return lo | (hi << 16);
}

__device__ __forceinline__ int cpu_route(const kio_publish_params& p, int i) {
  const int t = i / p.K, k = i % p.K;
  int id = reinterpret_cast<const int*>(p.ids)[(int64_t)t * p.ids_stride + k];
  const unsigned char* res = reinterpret_cast<const unsigned char*>(p.resident);
  // Out-of-range ids are passed through: the executor rejects them loudly (error word).
  if (res && id >= 0 && id < p.num_experts && res[id]) id = -1;
  return id;
}
}  // namespace

KIO_EXTERN_C __global__ void __launch_bounds__(KERNELIO_THREADS) kernelio_publish(kio_publish_params p) {
  const int nthr = blockDim.x * gridDim.x;
  const int gid = blockIdx.x * blockDim.x + threadIdx.x;
  // This thread's first x item and first route are loaded before anything is stored, so their
  // loads (x; the id, its weight, the id's residency byte) are in flight together instead of
  // queueing behind stores the compiler must assume may alias them.
  const int per_row = p.H / 8, nx = p.vec ? p.T * per_row : p.T * p.H, nr = p.T * p.K;
  uint4 x0 = make_uint4(0, 0, 0, 0);
  if (p.vec && gid < nx)
    x0 = reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(p.x) +
                                        (int64_t)(gid / per_row) * p.x_stride)[gid % per_row];
  const float* w = reinterpret_cast<const float*>(p.w);
  int id0 = -1;
  float w0 = 0.f;
  if (gid < nr) w0 = w[(int64_t)(gid / p.K) * p.w_stride + gid % p.K], id0 = cpu_route(p, gid);
  // done := 0 before the payload: this step's completion cannot be wiped, and the payload
  // fence below orders this store before the doorbell too.
  if (gid == 0) kio_store_system(reinterpret_cast<volatile unsigned long long*>(p.done), 0ull);
  if (p.vec) {
    for (int i = gid; i < nx; i += nthr) {
      const int t = i / per_row, c = i % per_row;
      const uint4 v = i == gid ? x0
                               : reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(p.x) +
                                                                (int64_t)t * p.x_stride)[c];
      reinterpret_cast<uint4*>(reinterpret_cast<unsigned short*>(p.io_x) + (int64_t)t * p.H)[c] = v;
    }
  } else {
    for (int i = gid; i < nx; i += nthr) {
      const int t = i / p.H, h = i % p.H;
      reinterpret_cast<unsigned short*>(p.io_x)[i] =
          reinterpret_cast<const unsigned short*>(p.x)[(int64_t)t * p.x_stride + h];
    }
  }
  int any = 0;  // does a route of this thread go to the CPU?
  for (int i = gid; i < nr; i += nthr) {
    const int id = i == gid ? id0 : cpu_route(p, i);
    any |= id >= 0;
    reinterpret_cast<int*>(p.io_ids)[i] = id;
    reinterpret_cast<float*>(p.io_w)[i] = i == gid ? w0 : w[(int64_t)(i / p.K) * p.w_stride + i % p.K];
  }
  // The payload (and done = 0) must reach the system before the doorbell. One block: the
  // barrier, then thread 0's one fence before the word (CUDA; HIP: every thread fences
  // first). Several blocks: each block's stores are fenced before it counts itself, and
  // the last block to count fences once more before the word.
  const bool one = gridDim.x == 1, by_one = KIO_BLOCK_FENCE_BY_ONE;
  if (!by_one) kio_fence_system();
  any = __syncthreads_or(any);
  __shared__ int last;
  unsigned* scratch = reinterpret_cast<unsigned*>(p.scratch);
  if (!one) {
    // One RMW counts the block (low 16 bits) and whether it has a CPU route (high bits), so the
    // last block learns both from the same chain of atomics (grid <= 64 blocks).
    if (threadIdx.x == 0) {
      if (by_one) kio_fence_system();
      const unsigned mine = 1u + (any ? 0x10000u : 0u), seen = atomicAdd(&scratch[0], mine) + mine;
      last = (seen & 0xFFFFu) == gridDim.x ? 1 + (seen >> 16 != 0) : 0;
    }
    __syncthreads();
    if (!last) return;
    any = last == 2;
  }
  if (threadIdx.x == 0) {
    if (!one) scratch[0] = 0;  // next launch (or graph replay) starts counting from 0
    scratch[1] = any ? 0 : 1;  // combine: skipped step, no y to read
    volatile unsigned long long* done = reinterpret_cast<volatile unsigned long long*>(p.done);
    volatile unsigned long long* ready = reinterpret_cast<volatile unsigned long long*>(p.ready);
    // Several blocks: every block's payload and done = 0 (seen through the counter) before
    // the word; one block: this is its only fence (after the barrier above, on CUDA).
    if (!one || by_one) kio_fence_system();
    if (!any)
      kio_store_system(done, 1ull);  // complete without waking the CPU; the stream's wait passes at once
    else
      kio_store_system(ready, (unsigned long long)p.task);
  }
}

KIO_EXTERN_C __global__ void __launch_bounds__(KERNELIO_THREADS) kernelio_combine(kio_combine_params p) {
  const int nthr = blockDim.x * gridDim.x;
  const int gid = blockIdx.x * blockDim.x + threadIdx.x;
  const bool skip = reinterpret_cast<volatile const unsigned*>(p.scratch)[1] != 0;
  if (p.wait && !skip) {
    __shared__ int timed_out;
    if (threadIdx.x == 0) {
      unsigned* sc = reinterpret_cast<unsigned*>(p.scratch);
      const unsigned long long t0 = kio_time_ns();
      int late = 0;
      if (blockIdx.x == 0) {
        const volatile unsigned long long* done = reinterpret_cast<const volatile unsigned long long*>(p.done);
        // done >= 1 as the memop's cyclic GEQ reads it: (int64)(done - 1) >= 0, so
        // COMPLETE (1) and the host's release on timeout (SHUTDOWN, 2^63-1) both pass.
        while ((long long)(kio_load_acquire_system(done) - 1ull) < 0) {
          if (kio_time_ns() - t0 > p.timeout_ns) {
            late = 1;
            break;
          }
        }
        // Block 0 passes what it saw on to the other blocks (device-scope release; their
        // acquire of it orders their reads of y after the CPU's release of done).
        if (gridDim.x > 1) kio_store_release_device(&sc[3], late ? 2u : 1u);
      } else {
        unsigned v;  // bounded too: block 0 always stores the flag before its own timeout ends
        while ((v = kio_load_acquire_device(&sc[3])) == 0)
          if (kio_time_ns() - t0 > p.timeout_ns + 1000000000ull) break;
        late = v != 1;
      }
      if (gridDim.x > 1) {
        // The last block to leave clears the flag for the next launch (after every block read it).
        kio_fence_device();
        if (atomicAdd(&sc[4], 1u) == gridDim.x - 1) {
          kio_fence_device();
          sc[3] = 0, sc[4] = 0;
        }
      }
      if (late) atomicAdd(&sc[2], 1u);
      timed_out = late;
    }
    __syncthreads();
    if (timed_out) return;  // no y was published: leave out untouched, the host check raises
  }
  if (p.vec) {
    const int per_row = p.H / 8, n = p.T * per_row;
    for (int i = gid; i < n; i += nthr) {
      const int t = i / per_row, c = i % per_row;
      uint4 y = make_uint4(0, 0, 0, 0);
      if (!skip) y = kio_load_uncached(reinterpret_cast<const uint4*>(p.io_y) + (int64_t)t * per_row + c);
      uint4* o = reinterpret_cast<uint4*>(reinterpret_cast<unsigned short*>(p.out) + (int64_t)t * p.out_stride) + c;
      if (p.accumulate) {
        const uint4 a = *o;
        y = make_uint4(add_pair(a.x, y.x), add_pair(a.y, y.y), add_pair(a.z, y.z), add_pair(a.w, y.w));
      }
      *o = y;
    }
  } else {
    const int n = p.T * p.H;
    for (int i = gid; i < n; i += nthr) {
      const int t = i / p.H, h = i % p.H;
      unsigned y = skip ? 0u : kio_load_uncached(reinterpret_cast<const unsigned short*>(p.io_y) + i);
      unsigned short* o = reinterpret_cast<unsigned short*>(p.out) + (int64_t)t * p.out_stride + h;
      if (p.accumulate) y = f32_to_bf16(bf16_to_f32(*o) + bf16_to_f32(y));
      *o = (unsigned short)y;
    }
  }
}
