// Host launchers of the publish/combine kernels. kernelio loads no GPU runtime
// itself: the image is loaded and launched through a gpusync backend's C ABI
// (gpusync/abi.h: module_load, module_function, launch, mem_alloc...), so the
// CUDA build shares gpusync-cuda's dlopen'd driver and primary context, and a
// ROCm build will share gpusync-hip's.
#pragma once
#include <stdexcept>
#include <string>

#include "gpusync/abi.h"
#include "kernelio/params.h"

namespace kernelio {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Where a step's data lives: the IO block's mapped device addresses.
struct IoTarget {
  uint64_t io_x = 0, io_ids = 0, io_w = 0, io_y = 0, ready = 0, done = 0;
  int32_t H = 0, K = 0, max_tokens = 0;
};

class KernelIO {
 public:
  // image: fatbin (CUDA) or code-object bundle (HIP), loaded once here, never
  // during capture (module loading is not a capturable operation).
  KernelIO(const gpusync_api* api, gpusync_device* dev, const std::string& image, const IoTarget& io);
  ~KernelIO();
  KernelIO(const KernelIO&) = delete;
  KernelIO& operator=(const KernelIO&) = delete;

  // x: bf16 [T, x_stride]; ids: int32 [T, ids_stride]; w: fp32 [T, w_stride];
  // resident: u8 [num_experts] or 0.
  void publish(uint64_t stream, int T, uint64_t x, int64_t x_stride, uint64_t ids, int64_t ids_stride, uint64_t w,
               int64_t w_stride, uint64_t resident, int num_experts, uint64_t task);
  // out: bf16 [T, out_stride]; accumulate: add into it (a GPU partial) instead of writing.
  // wait: the kernel itself waits for done >= 1 (no stream memop wait before it), at most
  // poll_timeout_ns; a timed-out launch reads no y and is counted (poll_timeouts()).
  void combine(uint64_t stream, int T, uint64_t out, int64_t out_stride, bool accumulate, bool wait = false);
  // How many combine blocks gave up waiting since the last clear; synchronizes the device's
  // null stream to read it (call it after the stream was synchronized). clear: reset to 0.
  uint32_t poll_timeouts(bool clear);
  uint64_t poll_timeout_ns() const { return poll_timeout_ns_; }
  void set_poll_timeout_ns(uint64_t ns) { poll_timeout_ns_ = ns; }

  const IoTarget& io() const { return io_; }
  uint64_t scratch() const { return scratch_; }

 private:
  void check(int rc, const char* op) const;
  static unsigned blocks_for(int64_t items);
  static constexpr int64_t kOneBlockItems = 8 * KERNELIO_THREADS;  // publish: up to 8 passes in one block

  const gpusync_api* api_;
  gpusync_device* dev_;
  IoTarget io_;
  void* module_ = nullptr;
  void* publish_ = nullptr;
  void* combine_ = nullptr;
  uint64_t scratch_ = 0;
  uint64_t poll_timeout_ns_ = 10'000'000'000ull;  // 10 s: far beyond any CPU step, short of a hang
};

// Bind the backend's C ABI from its capsule pointer: major/minor/size checked,
// the error names both versions.
const gpusync_api* bind_api(const void* capsule_ptr);

// Start-up self-test on scratch pinned memory (no IO block, no CPU involvement):
// publish with and without CPU routes, vector and scalar copies, several blocks,
// and combine in both modes, all compared bit for bit. wait: also combine's in-kernel
// wait (released by a host store while spinning; skipped steps; its timeout).
// Returns "" when it passed.
std::string probe(const gpusync_api* api, gpusync_device* dev, const std::string& image, double timeout_s,
                  bool wait);
}  // namespace kernelio
