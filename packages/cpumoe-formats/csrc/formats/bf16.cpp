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

struct Dot {
  static constexpr bool kRoundGateUp = false, kRoundRouteTerm = false;
  static float dot(const cpumoe_kernel* k, const cpumoe_bank* banks, int pass, int e, int row, const void* act) {
    int K;
    const uint16_t* w = row_of(k, banks, pass, e, row, &K);
    int i = 0;
#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
    const uint16_t* x = (const uint16_t*)act;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 128 <= K; i += 128) {
      CPUMOE_PREFETCH(w + i + 512);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + i + 32), (__m512bh)_mm512_loadu_si512(x + i + 32));
      a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w + i + 64), (__m512bh)_mm512_loadu_si512(x + i + 64));
      a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w + i + 96), (__m512bh)_mm512_loadu_si512(x + i + 96));
    }
    for (; i < K; i += 32) {  // masked tail: zero lanes contribute nothing
      __mmask32 m = K - i >= 32 ? 0xFFFFFFFFu : ((1u << (K - i)) - 1u);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, w + i), (__m512bh)_mm512_maskz_loadu_epi16(m, x + i));
    }
    return hsum512(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
    const float* x = (const float*)act;
    float s = 0.f;
#if CPUMOE_TIER == CPUMOE_T_AVX512F
    auto wide = [&](int o) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + o))), 16));
    };
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 64 <= K; i += 64) {
      CPUMOE_PREFETCH(w + i + 512);
      a0 = _mm512_fmadd_ps(wide(i), _mm512_loadu_ps(x + i), a0);
      a1 = _mm512_fmadd_ps(wide(i + 16), _mm512_loadu_ps(x + i + 16), a1);
      a2 = _mm512_fmadd_ps(wide(i + 32), _mm512_loadu_ps(x + i + 32), a2);
      a3 = _mm512_fmadd_ps(wide(i + 48), _mm512_loadu_ps(x + i + 48), a3);
    }
    for (; i + 16 <= K; i += 16) a0 = _mm512_fmadd_ps(wide(i), _mm512_loadu_ps(x + i), a0);
    s = hsum512(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif CPUMOE_TIER == CPUMOE_T_AVX2
    auto wide = [&](int o) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + o))), 16));
    };
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 32 <= K; i += 32) {
      CPUMOE_PREFETCH(w + i + 256);
      a0 = _mm256_fmadd_ps(wide(i), _mm256_loadu_ps(x + i), a0);
      a1 = _mm256_fmadd_ps(wide(i + 8), _mm256_loadu_ps(x + i + 8), a1);
      a2 = _mm256_fmadd_ps(wide(i + 16), _mm256_loadu_ps(x + i + 16), a2);
      a3 = _mm256_fmadd_ps(wide(i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= K; i += 8) a0 = _mm256_fmadd_ps(wide(i), _mm256_loadu_ps(x + i), a0);
    s = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; i < K; ++i) s += bf16_to_f32(w[i]) * x[i];
    return s;
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
