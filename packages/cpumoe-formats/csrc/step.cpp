// Single-threaded MoE step through a format kernel, and the exported API table.
// The step groups routes by expert (each weight row block is read once per step
// for all tokens routed to it) and walks rows in the kernel's block size, so it
// exercises the same work items the executor schedules.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "common.h"
#include "registry.h"
#include "tiers.h"

namespace cpumoe {
namespace {
constexpr size_t kAlign = 64;
size_t up64(size_t n) { return (n + kAlign - 1) & ~(kAlign - 1); }

struct Layout {
  size_t xa, ga, xprep, g, gprep, acc, total;
};
Layout layout(const cpumoe_kernel* k, int32_t T, int32_t top_k) {
  Layout L{};
  const auto& p = k->params;
  L.xa = up64(k->act_bytes(k, p.hidden));
  L.ga = up64(k->act_bytes(k, p.inter));
  const size_t R = (size_t)T * top_k;
  L.xprep = 0;
  L.g = L.xprep + L.xa * T;
  L.gprep = L.g + up64(R * p.inter * sizeof(uint16_t));
  L.acc = L.gprep + L.ga * R;
  L.total = L.acc + up64((size_t)T * p.hidden * sizeof(float));
  return L;
}
}  // namespace

size_t step_scratch_bytes(const cpumoe_kernel* k, int32_t T, int32_t top_k) { return layout(k, T, top_k).total + kAlign; }

int32_t moe_step(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t T, int32_t top_k, const uint16_t* x,
                 const int32_t* ids, const float* w, uint16_t* y, void* scratch_raw, char* err, size_t errlen) {
  using namespace CPUMOE_NS;
  const auto& p = k->params;
  const int32_t H = p.hidden, I = p.inter, E = p.num_experts;
  if (T < 0 || top_k <= 0) {
    std::snprintf(err, errlen, "num_tokens=%d must be >= 0 and top_k=%d must be > 0", T, top_k);
    return -1;
  }
  for (int32_t r = 0; r < T * top_k; ++r)
    if (ids[r] < -1 || ids[r] >= E) {
      std::snprintf(err, errlen, "topk_ids[%d, %d] = %d is not in [-1, %d)", r / top_k, r % top_k, ids[r], E);
      return -1;
    }
  char* s = (char*)(((uintptr_t)scratch_raw + kAlign - 1) & ~(uintptr_t)(kAlign - 1));
  const Layout L = layout(k, T, top_k);
  auto xprep = [&](int32_t t) { return (void*)(s + L.xprep + L.xa * t); };
  auto grow = [&](int32_t r) { return (uint16_t*)(s + L.g) + (size_t)r * I; };
  auto gprep = [&](int32_t r) { return (void*)(s + L.gprep + L.ga * r); };
  float* acc = (float*)(s + L.acc);

  for (int32_t t = 0; t < T; ++t) k->prep_act(k, x + (size_t)t * H, H, xprep(t));
  // Routes (t, k) sorted by expert, stable in (t, k): the executor's grouping.
  std::vector<int32_t> order;
  for (int32_t r = 0; r < T * top_k; ++r)
    if (ids[r] >= 0) order.push_back(r);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
  // One thread: no parallelism to keep, so take wide blocks (long runs per row for
  // transposed layouts, fewer calls for all).
  const int32_t blk = std::max(256, k->block_hint);
  std::vector<const void*> xs;
  std::vector<float> win;
  std::vector<uint16_t*> gs;
  for (size_t a = 0; a < order.size();) {
    size_t b = a;
    while (b < order.size() && ids[order[b]] == ids[order[a]]) ++b;
    xs.clear(), win.clear(), gs.clear();
    for (size_t j = a; j < b; ++j) {
      const int32_t r = order[j];
      xs.push_back(xprep(r / top_k));
      win.push_back(p.apply_router_weight_on_input ? w[r] : 1.0f);
      gs.push_back(grow(r));
    }
    for (int32_t i0 = 0; i0 < I; i0 += blk)
      k->gate_up(k, banks, ids[order[a]], i0, std::min(I, i0 + blk), (int32_t)(b - a), xs.data(), win.data(), gs.data());
    for (size_t j = a; j < b; ++j) k->prep_act(k, grow(order[j]), I, gprep(order[j]));
    a = b;
  }
  std::vector<cpumoe_route> routes;
  for (int32_t r : order)
    routes.push_back({r / top_k, ids[r], p.apply_router_weight_on_input ? 1.0f : w[r], 0, gprep(r)});
  std::fill(acc, acc + (size_t)T * H, 0.0f);
  for (int32_t h0 = 0; h0 < H; h0 += blk)
    if (!routes.empty()) k->down(k, banks, h0, std::min(H, h0 + blk), routes.data(), (int32_t)routes.size(), acc + h0, H);
  for (size_t i = 0; i < (size_t)T * H; ++i) y[i] = f32_to_bf16(acc[i]);
  return 0;
}

// Single-thread read bandwidth over [p, p+n): the ceiling the benches compare to. The range is read as four
// streams (its quarters, advanced together): the kernels keep 2-16 weight rows in flight, and one stream left the
// bus partly idle (executor steps read up to 147% of a one-stream ceiling), and a ceiling a kernel exceeds is not a
// ceiling. The streams start kStagger bytes more than a quarter apart: quarters a power of two >= 128 MiB apart
// collided (a 2 GiB buffer, 2 threads on the Zen 4 VM: 28 GB/s against 52 for one stream; 4 KiB further apart, 49).
// The gaps between the streams and the tail are read afterwards, so every 128-byte block is read once.
constexpr size_t kStagger = 4096 + 128;
struct Streams {
  size_t q, d, tail;  // stream length, stream spacing, where the tail starts
};
static Streams streams_of(size_t n, size_t unit) {
  const size_t q = n > 3 * kStagger ? (n - 3 * kStagger) / 4 / unit * unit : 0;
  return {q, q + kStagger, q ? 3 * (q + kStagger) + q : 0};
}
// 128 bytes at c into four 64-bit-lane accumulators (kept in registers: separate references, not an array)
__attribute__((target("avx2"), always_inline)) static inline void read128(const char* c, __m256i& a0, __m256i& a1,
                                                                         __m256i& a2, __m256i& a3) {
  a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i*)c));
  a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i*)(c + 32)));
  a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i*)(c + 64)));
  a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i*)(c + 96)));
}
__attribute__((target("avx2"))) static uint64_t read_avx2(const char* p, size_t n) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  const Streams st = streams_of(n, 128);
  for (size_t i = 0; i < st.q; i += 128)
    for (int s = 0; s < 4; ++s) read128(p + s * st.d + i, a0, a1, a2, a3);
  for (int s = 0; s < 3 && st.q; ++s)
    for (size_t i = s * st.d + st.q; i < (s + 1) * st.d; i += 128) read128(p + i, a0, a1, a2, a3);
  for (size_t i = st.tail; i + 128 <= n; i += 128) read128(p + i, a0, a1, a2, a3);
  a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  return (uint64_t)_mm256_extract_epi64(a0, 0) + (uint64_t)_mm256_extract_epi64(a0, 3);
}
static uint64_t read_scalar(const char* p, size_t n) {
  uint64_t s = 0;
  const Streams st = streams_of(n, 64);
  for (size_t i = 0; i < st.q; i += 64)
    for (int k = 0; k < 4; ++k) s += *(const volatile uint64_t*)(p + k * st.d + i);
  for (int k = 0; k < 3 && st.q; ++k)
    for (size_t i = k * st.d + st.q; i < (k + 1) * st.d; i += 64) s += *(const volatile uint64_t*)(p + i);
  for (size_t i = st.tail; i + 8 <= n; i += 64) s += *(const volatile uint64_t*)(p + i);
  return s;
}
uint64_t read_sum(const void* p, size_t n) {
  static const bool avx2 = usable_tier_mask() & (1u << CPUMOE_TIER_AVX2);
  n &= ~(size_t)127;
  return avx2 ? read_avx2((const char*)p, n) : read_scalar((const char*)p, n);
}
volatile uint64_t g_bw_sink;
double read_bandwidth_gbps(const void* p, size_t n, int reps) {
  double best = 0;
  n &= ~(size_t)127;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    g_bw_sink += read_sum(p, n);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, n / dt / 1e9);
  }
  return best;
}

// ---- exported C API table ----
namespace {
int32_t api_detected_tier() { return detected_tier(); }
int32_t api_tier_cap() { return env_tier_cap(); }
const char* api_tier_name(int32_t t) { return tier_name(t); }
#ifndef CPUMOE_BUILD_INFO
#define CPUMOE_BUILD_INFO "unknown build"
#endif
const cpumoe_formats_api kApi = {
    CPUMOE_FORMATS_ABI_MAJOR, CPUMOE_FORMATS_ABI_MINOR, sizeof(cpumoe_formats_api), CPUMOE_BUILD_INFO,
    &api_detected_tier,       &api_tier_cap,           &api_tier_name,             &kernel_create,
    &kernel_destroy,          &format_bank_count,      &step_scratch_bytes,        &moe_step,
    &read_sum,                &peak_loop,              &linear_create,             &linear_destroy,
    &attention_create,        &attention_destroy,
};
}  // namespace
const cpumoe_formats_api* api_table() { return &kApi; }
}  // namespace cpumoe
