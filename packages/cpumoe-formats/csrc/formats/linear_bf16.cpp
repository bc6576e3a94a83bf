// The dense bf16 linear (abi.h cpumoe_linear, ABI 1.9): y = x W^T (+ bias) for a row-major bf16 W [M, K] and a few
// tokens, by the bf16 expert kernels' row dot (bf16_rows.h dot_rt: 4 independent chains per (row, token), reduced
// the same way whatever the rows and tokens beside it, so a result never depends on the work split or the batch).
// Tiers: scalar (fp32 x, one sequential sum), avx2 and avx512f (bf16 widened, fp32 x prepared), avx512bf16
// (vdpbf16ps on the bf16 x as given). The VNNI tiers have nothing of their own (the ladder runs avx2 / avx512f);
// amx CPUs run avx512bf16 (a few tokens make no tile product).
//
// A lone token reads kFar rows far apart at once (rows h, h + q, h + 2q, h + 3q of a work item of 4q rows): kFar
// independent sequential streams, which the hardware prefetchers follow. Zen 4 VM, 2 threads, from DRAM: 4096x2048
// 34.6 GB/s with 4 far-apart rows against 28.1 with one row at a time and 25-29 with 2-8 adjacent rows (the read
// ceiling ~35). Several tokens share each row read (dot_rt<R, NT>, up to kMaxNT tokens a pass; the row stays in L1
// for the next pass).
// Software prefetch of the weight rows (bf16_rows.h's knobs, this file's own values): CPUMOE_LINEAR_PF elements
// ahead with locality CPUMOE_LINEAR_PF_LOC (0 = prefetchnta).
#if defined(CPUMOE_LINEAR_PF)
#define CPUMOE_BF16_PF CPUMOE_LINEAR_PF
#endif
#if defined(CPUMOE_LINEAR_PF_LOC)
#define CPUMOE_BF16_PF_LOC CPUMOE_LINEAR_PF_LOC
#endif
#include "bf16_rows.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

CPUMOE_INLINE void store(void* y, int64_t y_stride, int t, int r, float v, const uint16_t* bias, int32_t fp32) {
  if (bias) v += bf16_to_f32(bias[r]);
  char* row = (char*)y + (int64_t)t * y_stride;
  if (fp32)
    ((float*)row)[r] = v;
  else
    ((uint16_t*)row)[r] = f32_to_bf16(v);
}

CPUMOE_INLINE const uint16_t* wrow(const void* w, int64_t w_stride, int r) {
  return (const uint16_t*)((const char*)w + (int64_t)r * w_stride);
}

size_t x_bytes_none(const cpumoe_linear*, int32_t) { return 0; }
size_t x_bytes_f32(const cpumoe_linear*, int32_t K) { return (size_t)K * sizeof(float); }
void prep_f32(const cpumoe_linear*, const uint16_t* src, int32_t K, void* dst) {
  float* d = (float*)dst;
  for (int32_t i = 0; i < K; ++i) d[i] = bf16_to_f32(src[i]);
}

#if CPUMOE_TIER == CPUMOE_T_SCALAR
void rows(const cpumoe_linear*, const void* w, int64_t w_stride, int32_t K, int32_t r0, int32_t r1, int32_t n,
          const void* x, int64_t x_stride, const uint16_t* bias, void* y, int64_t y_stride, int32_t y_fp32) {
  for (int32_t r = r0; r < r1; ++r) {
    const uint16_t* wr = wrow(w, w_stride, r);
    for (int32_t t = 0; t < n; ++t) {
      const float* xt = (const float*)((const char*)x + (int64_t)t * x_stride);
      float s = 0.f;
      for (int32_t i = 0; i < K; ++i) s += bf16_to_f32(wr[i]) * xt[i];
      store(y, y_stride, t, r, s, bias, y_fp32);
    }
  }
}
#else
using XT = Lanes::XT;
// Accumulator budget of dot_rt (R * NT pairs of 4 chains): 3 pairs in 16 ymm, 4 in 32 zmm.
#if CPUMOE_TIER == CPUMOE_T_AVX2
constexpr int kMaxNT = 3;
#else
constexpr int kMaxNT = 4;
#endif
constexpr int kFar = 4;  // rows a lone token reads at once (far apart)

// Rows [r0, r1) for tokens [t0, t0 + NT): R rows far apart per pass (rows h + j q), the rows left over one at a time.
template <int R, int NT>
void rows_rt(const void* w, int64_t w_stride, int32_t K, int32_t r0, int32_t r1, int t0, const void* x,
             int64_t x_stride, const uint16_t* bias, void* y, int64_t y_stride, int32_t y_fp32) {
  const XT* xt[NT];
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) xt[t] = (const XT*)((const char*)x + (int64_t)(t0 + t) * x_stride);
  int32_t h = r0;
  if constexpr (R > 1) {
    const int32_t q = (r1 - r0) / R;
    for (; h < r0 + q; ++h) {
      const uint16_t* wr[R];
      float o[R * NT];
      CPUMOE_UNROLL
      for (int j = 0; j < R; ++j) wr[j] = wrow(w, w_stride, h + j * q);
      dot_rt<R, NT>(wr, K, xt, o);
      CPUMOE_UNROLL
      for (int j = 0; j < R; ++j)
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) store(y, y_stride, t0 + t, h + j * q, o[j * NT + t], bias, y_fp32);
    }
    h = r0 + R * q;
  }
  for (; h < r1; ++h) {
    const uint16_t* wr = wrow(w, w_stride, h);
    float o[NT];
    dot_rt<1, NT>(&wr, K, xt, o);
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) store(y, y_stride, t0 + t, h, o[t], bias, y_fp32);
  }
}

void rows(const cpumoe_linear*, const void* w, int64_t w_stride, int32_t K, int32_t r0, int32_t r1, int32_t n,
          const void* x, int64_t x_stride, const uint16_t* bias, void* y, int64_t y_stride, int32_t y_fp32) {
  if (n == 1) return rows_rt<kFar, 1>(w, w_stride, K, r0, r1, 0, x, x_stride, bias, y, y_stride, y_fp32);
  if (n == 2) return rows_rt<kMaxNT / 2, 2>(w, w_stride, K, r0, r1, 0, x, x_stride, bias, y, y_stride, y_fp32);
  // Several passes over a block of rows, kMaxNT tokens each: the block's rows stay in L1/L2 between the passes.
  constexpr int32_t kBlock = 8;
  for (int32_t b0 = r0; b0 < r1; b0 += kBlock) {
    const int32_t b1 = b0 + kBlock < r1 ? b0 + kBlock : r1;
    int t = 0;
    for (; t + kMaxNT <= n; t += kMaxNT)
      rows_rt<1, kMaxNT>(w, w_stride, K, b0, b1, t, x, x_stride, bias, y, y_stride, y_fp32);
    switch (n - t) {
      case 1: rows_rt<1, 1>(w, w_stride, K, b0, b1, t, x, x_stride, bias, y, y_stride, y_fp32); break;
      case 2: rows_rt<1, 2>(w, w_stride, K, b0, b1, t, x, x_stride, bias, y, y_stride, y_fp32); break;
#if CPUMOE_TIER != CPUMOE_T_AVX2
      case 3: rows_rt<1, 3>(w, w_stride, K, b0, b1, t, x, x_stride, bias, y, y_stride, y_fp32); break;
#endif
      default: break;
    }
  }
}
#endif

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(linear_bf16)(cpumoe_linear* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI || CPUMOE_TIER == CPUMOE_T_AMX
  (void)k;
  return false;  // nothing of its own: the tier below runs
#else
#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
  k->x_bytes = &x_bytes_none;  // vdpbf16ps reads the bf16 row as given
#else
  k->x_bytes = &x_bytes_f32;
#endif
  k->prep_x = &prep_f32;
  k->rows = &rows;
  k->row_block = 256;
  return true;
#endif
}
