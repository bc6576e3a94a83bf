// bf16 experts: gate_up [E, 2I, H], down [E, H, I], both bf16, row-major.
// Banks (slots): 0 gate_up, 1 down. Ragged H and I allowed (scalar tails).
// Tiers: scalar; avx2 and avx512f widen bf16 to fp32 (x prepared as fp32,
// 4 independent FMA chains); avx512bf16 feeds vdpbf16ps with bf16 x.
#include "../rowmajor.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

CPUMOE_INLINE const uint16_t* row_of(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row, int* K) {
  *K = pass == 0 ? k->params.hidden : k->params.inter;
  return bank_row<uint16_t>(banks[pass], e, row);
}

// Each token has 4 accumulator chains (chunk c of the main loop goes to chain c % 4, the one-vector tail to
// chain 0), summed as (a0 + a1) + (a2 + a3), then the scalar tail in order: the same operations for every NT,
// so a token's dot never depends on which tokens share the call. A weight vector is loaded (and widened)
// once per NT tokens. NT <= 3 on AVX2 (12 of 16 ymm hold accumulators), <= 4 on AVX-512 (16 of 32 zmm).
struct Dot {
  static constexpr bool kRoundGateUp = false, kRoundRouteTerm = false;
#if CPUMOE_TIER == CPUMOE_T_SCALAR
  static constexpr int kMaxNT = 1;
#elif CPUMOE_TIER == CPUMOE_T_AVX2
  static constexpr int kMaxNT = 3;
#else
  static constexpr int kMaxNT = 4;
#endif
  template <int NT>
  static void dotn(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row,
                   const void* const* acts, float* out) {
    int K;
    const uint16_t* w = row_of(k, banks, pass, e, row, &K);
    int i = 0;
#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
    const uint16_t* x[NT];
    __m512 a[NT][4];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) {
      x[t] = (const uint16_t*)acts[t];
      a[t][0] = a[t][1] = a[t][2] = a[t][3] = _mm512_setzero_ps();
    }
    for (; i + 128 <= K; i += 128) {
      CPUMOE_PREFETCH(w + i + 512);
      CPUMOE_UNROLL
      for (int c = 0; c < 4; ++c) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i + 32 * c);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t)
          a[t][c] = _mm512_dpbf16_ps(a[t][c], wv, (__m512bh)_mm512_loadu_si512(x[t] + i + 32 * c));
      }
    }
    for (; i < K; i += 32) {  // masked tail: zero lanes contribute nothing
      const __mmask32 m = K - i >= 32 ? 0xFFFFFFFFu : ((1u << (K - i)) - 1u);
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + i);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t)
        a[t][0] = _mm512_dpbf16_ps(a[t][0], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, x[t] + i));
    }
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      out[t] = hsum512(_mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3])));
#else
    const float* x[NT];
    float s[NT];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) x[t] = (const float*)acts[t], s[t] = 0.f;
#if CPUMOE_TIER == CPUMOE_T_AVX512F
    auto wide = [&](int o) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + o))), 16));
    };
    __m512 a[NT][4];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) a[t][0] = a[t][1] = a[t][2] = a[t][3] = _mm512_setzero_ps();
    for (; i + 64 <= K; i += 64) {
      CPUMOE_PREFETCH(w + i + 512);
      CPUMOE_UNROLL
      for (int c = 0; c < 4; ++c) {
        const __m512 wv = wide(i + 16 * c);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) a[t][c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[t] + i + 16 * c), a[t][c]);
      }
    }
    for (; i + 16 <= K; i += 16) {
      const __m512 wv = wide(i);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) a[t][0] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x[t] + i), a[t][0]);
    }
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      s[t] = hsum512(_mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]), _mm512_add_ps(a[t][2], a[t][3])));
#elif CPUMOE_TIER == CPUMOE_T_AVX2
    auto wide = [&](int o) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + o))), 16));
    };
    __m256 a[NT][4];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) a[t][0] = a[t][1] = a[t][2] = a[t][3] = _mm256_setzero_ps();
    for (; i + 32 <= K; i += 32) {
      CPUMOE_PREFETCH(w + i + 256);
      CPUMOE_UNROLL
      for (int c = 0; c < 4; ++c) {
        const __m256 wv = wide(i + 8 * c);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) a[t][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[t] + i + 8 * c), a[t][c]);
      }
    }
    for (; i + 8 <= K; i += 8) {
      const __m256 wv = wide(i);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) a[t][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[t] + i), a[t][0]);
    }
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      s[t] = hsum256(_mm256_add_ps(_mm256_add_ps(a[t][0], a[t][1]), _mm256_add_ps(a[t][2], a[t][3])));
#endif
    for (; i < K; ++i) {
      const float wf = bf16_to_f32(w[i]);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) s[t] += wf * x[t][i];
    }
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) out[t] = s[t];
#endif
  }
};

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(bf16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  (void)k;
  return false;  // no int8 variant: the tier below runs
#else
#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
  k->act_bytes = &act_bytes_bf16;
  k->prep_act = &prep_act_bf16;
#else
  k->act_bytes = &act_bytes_f32;
  k->prep_act = &prep_act_f32;
#endif
  install_rowmajor<Dot>(k);
  return true;
#endif
}
