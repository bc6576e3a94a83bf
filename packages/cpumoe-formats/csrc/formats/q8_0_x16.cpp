// q8_0_x16: q8_0 experts with 16 rows interleaved per 32-block, for CPUs (docs/formats/q8_0.md "q8_0_x16").
// Banks (slots): 0 gate_up [E, 2I/16, (H/32)*544], 1 down [E, H/16, (I/32)*544], uint8. A bank row is a group of 16
// weight rows; per 32-block it holds 544 bytes, the same 34 bytes per row as q8_0, moved (cpumoe_formats.
// repack_q8_0_x16): the 16 rows' fp16 d (row r at 2r), then 8 vectors of 64 bytes, vector v's int32 lane r = row r's
// codes 4v .. 4v+3 (int8).
//
// Mode w4a8 only (q8_0's default): each activation 32-block quantized by the Q8_0 rule (q8_0's codes and d_a).
// Record (x16::BlockToks): per block 40 bytes, q[32], float d_a, int32 corr = -128 * sum(q_b). Per (row, token), from
// acc = 0, block by block in K order:
//   acc = fma(float(corr + sum((w + 128) q)), fp32(d) * d_a, acc)        (the integer is exactly sum(w q))
// The codes w + 128 (w ^ 0x80, unsigned) are vpdpbusd's unsigned operand; every tier forms the same integer and does
// these fp32 operations in this order (std::fma in scalar), so the tiers are bit-identical and a token's result does
// not depend on its batch. avx2 has no int16 run here ((w + 128) q pairs reach 2 * 255 * 127): per step vpmaddubsw
// of |w| and sign(q, w) (ggml's sign trick, <= 2 * 128 * 127), then vpmaddwd with ones, from 0: sum(w q), the
// same integer.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "gguf_x16.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int QK = 32, GR = x16::GR, GB = 544;
constexpr int kMaxNT = CPUMOE_TIER == CPUMOE_T_AVX512VNNI ? 8 : 4;
#ifndef CPUMOE_Q8X16_PF
#define CPUMOE_Q8X16_PF 3072
#endif

// q8_0's w4a8 codes and d_a per 32, corr = -128 sum(q) (the codes' offset 128 in vpdpbusd's unsigned operand)
void prep_x16(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) { x16::q8_records<-128>(src, K, dst); }

// The group dots for gguf_x16.h's RowG16: zmm (avx512vnni), ymm row halves (avx2 / avxvnni), scalar. kSwPf: the
// software prefetch (x16.h gguf_sw_prefetch; false is built on avx512vnni only).
template <bool kSwPf>
struct Q8X16 {
  static constexpr int QK = cpumoe::CPUMOE_NS::QK, kMaxNT = cpumoe::CPUMOE_NS::kMaxNT;
  static constexpr int64_t kPf = x16::gguf_pf(kSwPf, CPUMOE_Q8X16_PF);

#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
template <int G, int NT>
static CPUMOE_INLINE void zmm(const uint8_t* const* w, int nb, const void* const* act, float* out) {
  x16::BlockToks<NT, QK> a(act);
  __m512 acc[G][NT];
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) acc[g][t] = _mm512_setzero_ps();
  const __m512i k80 = _mm512_set1_epi8((char)0x80);
  for (int b = 0; b < nb; ++b) {
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = w[g] + (size_t)b * GB;
      if constexpr (kPf > 0)
        for (int l = 0; l < 9; ++l) __builtin_prefetch(p + kPf + 64 * l, 0, 3);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
      __m512i u[8];
      CPUMOE_UNROLL
      for (int v = 0; v < 8; ++v) u[v] = _mm512_xor_si512(_mm512_loadu_si512(p + 32 + 64 * v), k80);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const int32_t* qa = (const int32_t*)a.q(t, 0);
        __m512i s0 = _mm512_set1_epi32(*a.corr(t, 0)), s1 = _mm512_setzero_si512();  // two chains
        CPUMOE_UNROLL
        for (int v = 0; v < 4; ++v) s0 = x16::dpbusd_bcast(s0, u[v], qa + v), s1 = x16::dpbusd_bcast(s1, u[4 + v], qa + 4 + v);
        acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), x16::mul_bcast(d, a.s(t, 0)), acc[g][t]);
      }
    }
    a.advance(1);
  }
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + (size_t)(g * NT + t) * GR, acc[g][t]);
}
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
// G groups x NT tokens, rows 8h..8h+7 (h in [H0, H0 + NH)) per ymm; a lone token takes both row halves per block.
template <int G, int NT, int H0, int NH>
static CPUMOE_INLINE void ymm(const uint8_t* const* w, int nb, const void* const* act, float* out) {
  x16::BlockToks<NT, QK> a(act);
  __m256 acc[G][NH][NT];
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int hh = 0; hh < NH; ++hh)
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) acc[g][hh][t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = w[g] + (size_t)b * GB;
      if (H0 == 0)
        for (int l = 0; l < 9; ++l) __builtin_prefetch(p + CPUMOE_Q8X16_PF + 64 * l, 0, 3);
      CPUMOE_UNROLL
      for (int hh = 0; hh < NH; ++hh) {
        const int h = H0 + hh;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
        __m256i S[NT];
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t)  // vpdpbusd sums (w + 128) q: from corr; the sign trick sums w q: from 0
          S[t] = CPUMOE_TIER == CPUMOE_T_AVXVNNI ? _mm256_set1_epi32(*a.corr(t, 0)) : _mm256_setzero_si256();
        CPUMOE_UNROLL
        for (int v = 0; v < 8; ++v) {
          const __m256i wv = _mm256_loadu_si256((const __m256i*)(p + 32 + 64 * v + 32 * h));
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
          const __m256i u = _mm256_xor_si256(wv, _mm256_set1_epi8((char)0x80));
          CPUMOE_UNROLL
          for (int t = 0; t < NT; ++t) S[t] = _mm256_dpbusd_avx_epi32(S[t], u, x16::bcast4(a.q(t, 0) + 4 * v));
#else
          const __m256i aw = _mm256_sign_epi8(wv, wv);
          CPUMOE_UNROLL
          for (int t = 0; t < NT; ++t)
            S[t] = _mm256_add_epi32(S[t], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x16::bcast4(a.q(t, 0) + 4 * v), wv)),
                                                            _mm256_set1_epi16(1)));
#endif
        }
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t)
          acc[g][hh][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[t]), _mm256_mul_ps(d, _mm256_set1_ps(*a.s(t, 0))), acc[g][hh][t]);
      }
    }
    a.advance(1);
  }
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      CPUMOE_UNROLL
      for (int hh = 0; hh < NH; ++hh) _mm256_storeu_ps(out + (size_t)(g * NT + t) * GR + 8 * (H0 + hh), acc[g][hh][t]);
}
#endif

#if CPUMOE_TIER == CPUMOE_T_SCALAR
  // scalar: the same integer and fp32 operations, row by row
  template <int G, int NT>
  static void scalar(const uint8_t* const* w, int nb, const void* const* act, float* out) {
    const x16::BlockToks<NT, QK> a(act);
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < NT; ++t)
        for (int r = 0; r < GR; ++r) {
          float acc = 0.f;
          for (int b = 0; b < nb; ++b) {
            const uint8_t* p = w[g] + (size_t)b * GB;
            uint16_t dh;
            std::memcpy(&dh, p + 2 * r, 2);
            const int8_t* qb = a.q(t, b);
            int32_t s = *a.corr(t, b);
            for (int v = 0; v < 8; ++v)
              for (int i = 0; i < 4; ++i) s += (((int8_t)p[32 + 64 * v + 4 * r + i]) + 128) * qb[4 * v + i];
            acc = std::fma((float)s, fp16_to_f32(dh) * *a.s(t, b), acc);
          }
          out[(size_t)(g * NT + t) * GR + r] = acc;
        }
  }
#endif
};

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(q8_0_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
  return x16::install_row_groups<Q8X16<true>, Q8X16<false>>(k, &x16::int8_record_bytes<QK>, &prep_x16);
}
