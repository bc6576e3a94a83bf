// bf16_x16: bf16 experts with 16 rows interleaved per K pair, for CPUs (docs/formats/bf16.md "bf16_x16").
// Banks (slots): 0 gate_up [E, 2I/16, H*16] bf16, 1 down [E, H/16, I*16] bf16. A bank row is a group of 16 weight
// rows: per K pair p, 32 values, row r's elements 2p and 2p+1 at 2r and 2r+1 (cpumoe_formats.repack_bf16_x16).
//
// Mode native (W16A16; x as its exact bf16, the prepared record is the bf16 row itself). Per (row, token), two
// chains from 0: c0 over the even K pairs and c1 over the odd ones, each pair as c = fma(w_odd, x_odd, c) then
// c = fma(w_even, x_even, c) (vdpbf16ps: exact products, one rounding per step, subnormal x and results read as
// zero), then c0 + c1. The scalar tier does the same steps (x16.h dp_step), so the tiers are bit-identical and a
// token's result does not depend on its batch. The avx2 and avx512f tiers do them with fp32 FMAs (x16_fma.h: the
// flush to zero by MXCSR, checked, and redone explicitly where it was needed), bit-identical for every input.
// vdpbf16ps parts from dp_step at two edges (seen on the H200 host's Xeon, test_vdpbf16ps_edges): it reads
// subnormal weights as zero too, and it flushes exact results just under FLT_MIN (from FLT_MIN - 2^-150) that
// dp_step's gradual underflow rounds up to FLT_MIN.
//
// Why: a 64-byte load is a vector of 16 rows' bf16 pairs, and one vdpbf16ps with the token's pair broadcast
// (folded into the instruction) takes 32 products, so each token sharing an expert costs one instruction per 32
// weights and no activation stream per row (bf16's row-major kernels' cost for batches that share experts).
#include "../x16.h"
#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F
#define BF16X16_FMA 1
#include "x16_fma.h"
#else
#define BF16X16_FMA 0
#endif

// Software prefetch distance in each group stream (bytes, one line per 64-byte step).
#ifndef CPUMOE_BF16X16_PF
#define CPUMOE_BF16X16_PF 3072
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int GR = x16::GR;

struct G16 {
#if BF16X16_FMA
  static constexpr int kMaxNT = x16fma::kMaxNT;
  static constexpr int kBlk = 0, kStep = 128;  // x16_fma.h: one unscaled sum; 2 K pairs are 2 lines
  static constexpr bool kParity = false;
  static constexpr float kXs = 0;  // the values are exact as they are
  // 2 K pairs at p, rows 8h..8h+7 (avx2) or all 16 (avx512f): their even and odd values, exact in fp32
  template <bool>
  static CPUMOE_INLINE void quad(const uint8_t* p, [[maybe_unused]] int h, x16fma::V* w) {
    x16fma::bf16_pairs(p + 4 * x16fma::VL * h, w[0], w[1]);
    x16fma::bf16_pairs(p + 64 + 4 * x16fma::VL * h, w[2], w[3]);
  }
#else
  static constexpr int kMaxNT = 8;
#endif
  static constexpr int64_t kPf = CPUMOE_BF16X16_PF;
  static constexpr int kSlot[2] = {0, 1};
  struct Ref {
    const uint8_t* w;  // the group's values (bytes, for the loops' prefetch)
  };
  static CPUMOE_INLINE Ref ref(const cpumoe_kernel*, const cpumoe_bank* banks, int mat, int32_t e, int32_t g) {
    return {bank_row<uint8_t>(banks[mat], e, g)};
  }
  template <int G, int NT>
  static void groups(const Ref* gp, int K, const void* const* act, float* out);
};

#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
template <int G, int NT>
void G16::groups(const Ref* gp, int K, const void* const* act, float* out) {
  const uint16_t* x[NT];
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) x[t] = (const uint16_t*)act[t];
  __m512 c0[G][NT], c1[G][NT];
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) c0[g][t] = c1[g][t] = _mm512_setzero_ps();
  for (int k = 0; k < K; k += 4) {  // pairs k/2 (-> c0) and k/2 + 1 (-> c1): 128 bytes per group
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = gp[g].w + (size_t)k * GR * 2;
      __builtin_prefetch(p + kPf, 0, 3);
      __builtin_prefetch(p + kPf + 64, 0, 3);
      const __m512i w0 = _mm512_loadu_si512((const void*)p), w1 = _mm512_loadu_si512((const void*)(p + 64));
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const int32_t* xa = (const int32_t*)(x[t] + k);
        c0[g][t] = x16::dpbf16_bcast(c0[g][t], w0, xa);
        c1[g][t] = x16::dpbf16_bcast(c1[g][t], w1, xa + 1);
      }
    }
  }
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + (g * NT + t) * GR, _mm512_add_ps(c0[g][t], c1[g][t]));
}
#elif BF16X16_FMA
template <int G, int NT>
void G16::groups(const Ref* gp, int K, const void* const* act, float* out) {
  x16fma::groups<G16, G, NT>(gp, K, act, out);
}
#else
template <int G, int NT>
void G16::groups(const Ref* gp, int K, const void* const* act, float* out) {
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < NT; ++t) {
      const uint16_t* x = (const uint16_t*)act[t];
      const uint16_t* w = (const uint16_t*)gp[g].w;
      for (int r = 0; r < GR; ++r) {
        float c[2] = {0.f, 0.f};
        for (int k = 0; k < K; k += 2) {
          const uint16_t* p = w + (size_t)k * GR + 2 * r;
          float& ch = c[(k >> 1) & 1];
          ch = x16::dp_step(bf16_to_f32(p[1]), x[k + 1], ch);
          ch = x16::dp_step(bf16_to_f32(p[0]), x[k], ch);
        }
        out[(g * NT + t) * GR + r] = c[0] + c[1];
      }
    }
}
#endif

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(bf16_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX512BF16
  return x16::install<G16>(k, CPUMOE_MODE_NATIVE, &act_bytes_bf16, &prep_act_bf16);
#elif BF16X16_FMA
  return x16::install<G16>(k, CPUMOE_MODE_NATIVE, &act_bytes_f32, &x16fma::prep_act_daz);  // fp32 x, daz'd
#else
  (void)k;
  return false;  // avxvnni / avx512vnni: avx2 / avx512f runs
#endif
}
