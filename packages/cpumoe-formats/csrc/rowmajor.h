// Work-item loops shared by the row-major formats (bf16, nvfp4, ds_fp4, q4_0,
// fp8_block): a format supplies only its row dot for its tier.
//
//   struct Dot {
//     static constexpr bool kRoundGateUp = false;   // ds_fp4: gate/up -> bf16 before the activation
//     static constexpr bool kRoundRouteTerm = false; // ds_fp4: each route's term -> bf16 before the sum
//     // pass 0: gate_up row `row` (K = H), pass 1: down row `row` (K = I); act is a prepared vector
//     static float dot(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row, const void* act);
//   };
//
// Several tokens routed to one expert share each weight row: the row is pulled
// from DRAM once and stays in L1 for the other tokens' dots.
#pragma once
#include "common.h"

namespace cpumoe {
namespace CPUMOE_NS {

template <class Dot>
void rowmajor_gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
                      const void* const* xs, const float* w_in, uint16_t* const* g) {
  const cpumoe_params& p = k->params;
  for (int32_t i = i0; i < i1; ++i) {
    for (int32_t j = 0; j < n; ++j) {
      float gate = Dot::dot(k, banks, 0, e, i, xs[j]) * w_in[j];
      float up = Dot::dot(k, banks, 0, e, p.inter + i, xs[j]) * w_in[j];
      if (Dot::kRoundGateUp) gate = round_bf16(gate), up = round_bf16(up);
      g[j][i] = f32_to_bf16(activate(p, gate, up));
    }
  }
}

template <class Dot>
void rowmajor_down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
                   int32_t n, float* acc, int64_t acc_stride) {
  for (int32_t a = 0; a < n;) {
    int32_t b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    const int32_t e = routes[a].expert;
    for (int32_t h = h0; h < h1; ++h)
      for (int32_t r = a; r < b; ++r) {
        float t = Dot::dot(k, banks, 1, e, h, routes[r].act) * routes[r].weight;
        if (Dot::kRoundRouteTerm) t = round_bf16(t);
        acc[routes[r].token * acc_stride + (h - h0)] += t;
      }
    a = b;
  }
}

// Installs the shared loops for a Dot.
template <class Dot>
void install_rowmajor(cpumoe_kernel* k) {
  k->gate_up = &rowmajor_gate_up<Dot>;
  k->down = &rowmajor_down<Dot>;
}

// Horizontal sums.
#if defined(__AVX2__)
CPUMOE_INLINE float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
CPUMOE_INLINE int32_t hsum256_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
#endif
#if defined(__AVX512F__)
CPUMOE_INLINE float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

// bf16 activation vector -> fp32 (the usual prepared form for fp32 dots).
inline size_t act_bytes_f32(const cpumoe_kernel*, int32_t K) { return (size_t)K * sizeof(float); }
inline void prep_act_f32(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  float* d = (float*)dst;
  for (int32_t i = 0; i < K; ++i) d[i] = bf16_to_f32(src[i]);
}
inline size_t act_bytes_bf16(const cpumoe_kernel*, int32_t K) { return (size_t)K * sizeof(uint16_t); }
inline void prep_act_bf16(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  std::memcpy(dst, src, (size_t)K * sizeof(uint16_t));
}

}  // namespace CPUMOE_NS
}  // namespace cpumoe
