// Host launchers: grid sizing, alignment choice, parameter marshalling.
#include "launcher.h"

#include <algorithm>
#include <cstddef>

namespace kernelio {

const gpusync_api* bind_api(const void* p) {
  const auto* api = static_cast<const gpusync_api*>(p);
  char err[512];
  // kernelio calls ABI 1.0 entries only (module, launch, memory, copy, sync services): it needs 1.0 and the
  // 1.0 table (which ends where 1.1 appended step_submit), so a provider's minor bump never forces a rebuild.
  if (gpusync_check_api_as(api, 1, 0, offsetof(gpusync_api, step_submit), err, sizeof err)) throw Error(err);
  return api;
}

void KernelIO::check(int rc, const char* op) const {
  if (rc) throw Error(std::string("kernelio: ") + op + ": " + api_->last_error());
}

KernelIO::KernelIO(const gpusync_api* api, gpusync_device* dev, const std::string& image, const IoTarget& io)
    : api_(api), dev_(dev), io_(io) {
  check(api_->module_load(dev_, image.data(), &module_), "loading the kernel image");
  try {
    check(api_->module_function(dev_, module_, "kernelio_publish", &publish_), "kernelio_publish");
    check(api_->module_function(dev_, module_, "kernelio_combine", &combine_), "kernelio_combine");
    check(api_->mem_alloc(dev_, KERNELIO_SCRATCH_BYTES, &scratch_), "scratch allocation");
    // The last-block counter must start at 0; every publish leaves it at 0 again.
    static const unsigned char zeros[KERNELIO_SCRATCH_BYTES] = {0};
    check(api_->memcpy_async(dev_, scratch_, (uint64_t)(uintptr_t)zeros, sizeof zeros, 0), "scratch reset");
    check(api_->stream_sync(dev_, nullptr, 0, 10.0), "scratch reset");
  } catch (...) {
    if (scratch_) api_->mem_free(dev_, scratch_);
    api_->module_unload(dev_, module_);
    throw;
  }
}

KernelIO::~KernelIO() {
  if (scratch_) api_->mem_free(dev_, scratch_);
  if (module_) api_->module_unload(dev_, module_);
}

unsigned KernelIO::blocks_for(int64_t items) {
  // One item per thread per pass; a few blocks spread the PCIe stores over
  // several SMs, more only add last-block traffic for decode-sized steps.
  const int64_t b = (items + KERNELIO_THREADS - 1) / KERNELIO_THREADS;
  return (unsigned)std::clamp<int64_t>(b, 1, 64);
}

void KernelIO::publish(uint64_t stream, int T, uint64_t x, int64_t x_stride, uint64_t ids, int64_t ids_stride,
                       uint64_t w, int64_t w_stride, uint64_t resident, int num_experts, uint64_t task) {
  if (T < 1 || T > io_.max_tokens) throw Error("kernelio: publish: T out of range");
  kio_publish_params p{};
  p.x = x, p.ids = ids, p.w = w;
  p.x_stride = x_stride, p.ids_stride = ids_stride, p.w_stride = w_stride;
  p.resident = resident, p.num_experts = num_experts;
  p.io_x = io_.io_x, p.io_ids = io_.io_ids, p.io_w = io_.io_w, p.ready = io_.ready, p.done = io_.done;
  p.scratch = scratch_, p.task = task, p.T = T, p.H = io_.H, p.K = io_.K;
  p.vec = (io_.H % 8 == 0) && (x % 16 == 0) && ((x_stride * 2) % 16 == 0) && (io_.io_x % 16 == 0);
  const int64_t items = std::max<int64_t>(p.vec ? (int64_t)T * io_.H / 8 : (int64_t)T * io_.H, (int64_t)T * io_.K);
  // One block while it takes at most kOneBlockItems / KERNELIO_THREADS passes (batch 8 at
  // H = 2048): one block fences once; several pay a second, serial fence in the last block.
  // (Batch 1 is one block either way; at batch 8 without a CPU route the H200 read the same
  // 5.2-5.4 us per layer with 8 blocks and with one, so this is the simpler tail, not a speed-up.)
  const uint32_t grid[3] = {items <= kOneBlockItems ? 1u : blocks_for(items), 1, 1};
  const uint32_t block[3] = {KERNELIO_THREADS, 1, 1};
  void* args[] = {&p};
  check(api_->launch(dev_, publish_, grid, block, 0, stream, args), "publish launch");
}

void KernelIO::combine(uint64_t stream, int T, uint64_t out, int64_t out_stride, bool accumulate, bool wait) {
  if (T < 1 || T > io_.max_tokens) throw Error("kernelio: combine: T out of range");
  kio_combine_params p{};
  p.io_y = io_.io_y, p.out = out, p.out_stride = out_stride, p.scratch = scratch_;
  p.T = T, p.H = io_.H, p.accumulate = accumulate ? 1 : 0;
  p.done = io_.done, p.timeout_ns = poll_timeout_ns_, p.wait = wait ? 1 : 0;
  p.vec = (io_.H % 8 == 0) && (out % 16 == 0) && ((out_stride * 2) % 16 == 0) && (io_.io_y % 16 == 0);
  const int64_t items = p.vec ? (int64_t)T * io_.H / 8 : (int64_t)T * io_.H;
  const uint32_t grid[3] = {blocks_for(items), 1, 1}, block[3] = {KERNELIO_THREADS, 1, 1};
  void* args[] = {&p};
  check(api_->launch(dev_, combine_, grid, block, 0, stream, args), "combine launch");
}

uint32_t KernelIO::poll_timeouts(bool clear) {
  uint32_t n = 0;
  const uint64_t at = scratch_ + 2 * sizeof(uint32_t);
  check(api_->memcpy_async(dev_, (uint64_t)(uintptr_t)&n, at, sizeof n, 0), "reading the poll-timeout count");
  check(api_->stream_sync(dev_, nullptr, 0, 10.0), "reading the poll-timeout count");
  if (clear && n) {
    static const uint32_t zero = 0;
    check(api_->memcpy_async(dev_, at, (uint64_t)(uintptr_t)&zero, sizeof zero, 0), "clearing the poll-timeout count");
    check(api_->stream_sync(dev_, nullptr, 0, 10.0), "clearing the poll-timeout count");
  }
  return n;
}
}  // namespace kernelio
