// ds_fp4_x16: ds_fp4 experts with 16 rows interleaved per 32-block, for CPUs (docs/formats/ds_fp4.md "ds_fp4_x16").
// Banks (slots): 0 gate_up [E, 2I/16, (H/32)*272], 1 down [E, H/16, (I/32)*272], uint8. A bank row is a group of
// 16 weight rows; per 32-block it holds 272 bytes: the 16 rows' e8m0 scales (row r at byte r), then 4 x 64 code
// bytes, vector j's int32 lane r = row r's codes of elements 4j..4j+3 in the low nibbles and 16+4j..16+4j+3 in the
// high ones (byte i of the lane: elements 4j+i and 16+4j+i). The same 17 bytes per row and block as ds_fp4 (16
// packed bytes, 1 scale), moved (cpumoe_formats.repack_ds_fp4_x16; ds_fp4 pairs elements 2i, 2i+1 in a byte).
//
// Mode w4a8 only: the activation goes through ds_fp4's prep (ds_fp4_act.h: the FP8 round trip per 128, then the
// Q8_0 rule per 32: the same codes q and 0.5 s_b as ds_fp4's w4a8). Record: int8 q[K] (element order), fp32
// hs[K/32] = 0.5 s_b, int32 corr[K/32] = -12 sum(q_b). Weights enter the integer dots as u = 2 E2M1 + 12 in
// [0, 24] (vpshufb of the nibble), so per (row, block) the exact
//   S_b = corr_b + sum(u q) = sum(2 E2M1 q)      (|S_b| <= 32 * 12 * 127)
// and per (row, token), from acc = 0, block by block in K order:
//   acc = fma((float)S_b * hs_b, 2^(min(s,254) - 127), acc)      (s = 0: 2^-127, exact)
// The e8m0 factor comes last, as in ds_fp4 (hs_b * 2^-127 could be an fp32 subnormal). The integer is exact and
// every tier does these fp32 operations in this order (std::fma in scalar), so the tiers are bit-identical and a
// token's result does not depend on its batch. Not bit-identical to ds_fp4, whose kernels add per-8-element lane
// sums (SIMD) or sum blocks unfused (scalar). Lanes are rows: the per-block fold (cvt, scale, fma) is paid once
// per 16 rows and token, not once per (row, token) as in ds_fp4's row-major kernels.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../x16.h"
#include "ds_fp4_act.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
using namespace fp4;
using namespace dsfp4;

constexpr int QK = 32, GR = x16::GR, GB = 272, SB = 16;  // SB: the scale bytes that open a group block
// tokens per group call: 8 in 32 zmm registers; the 16-register tiers take the 16 rows in two halves of 8, with
// their 8 code vectors and one accumulator per token live
constexpr int kMaxNT = CPUMOE_TIER == CPUMOE_T_AVX512VNNI ? 8 : 4;
// Software prefetch 3 KB ahead in each group stream (q4_0_x16's distance), 5 lines per 272-byte block step.
#ifndef CPUMOE_DSX16_PF
#define CPUMOE_DSX16_PF 3072
#endif

void prep_x16(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  int8_t* q = (int8_t*)dst;
  float* hs = (float*)(q + K);
  int32_t* corr = (int32_t*)(hs + K / QK);
  for (int32_t b0 = 0; b0 < K; b0 += 128) {
#if defined(__AVX2__)
    __m256i v[4];
    quant_w8_128_simd(src + b0, v, hs + b0 / QK);  // quant_w8_128's codes and 0.5 s_b, bit for bit
    for (int j = 0; j < 4; ++j) {
      _mm256_storeu_si256((__m256i*)(q + b0 + QK * j), v[j]);
      corr[b0 / QK + j] = -kW2Offset * hsum8_i32(sum4_i8(v[j]));
    }
#else
    quant_w8_128(src + b0, q + b0, hs + b0 / QK);
    for (int j = 0; j < 4; ++j) {
      int32_t s = 0;
      for (int i = 0; i < QK; ++i) s += q[b0 + QK * j + i];
      corr[b0 / QK + j] = -kW2Offset * s;
    }
#endif
  }
}

#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
// the 16 e8m0 bytes at p -> 2^(min(s,254) - 127), s = 0 -> 2^-127 (e8m0_to_f32 lane by lane): s << 23 is at
// least 2^23 for s >= 1, so the unsigned max with 0x00400000 (2^-127) changes only s = 0
CPUMOE_INLINE __m512 e8m0x16(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512i v = _mm512_slli_epi32(_mm512_min_epu32(b, _mm512_set1_epi32(254)), 23);
  return _mm512_castsi512_ps(_mm512_max_epu32(v, _mm512_set1_epi32(0x00400000)));
}
#endif

// The layout for x16.h's loops: a group is one bank row.
struct G16 {
  static constexpr int kMaxNT = cpumoe::CPUMOE_NS::kMaxNT;
  static constexpr int64_t kPf = CPUMOE_DSX16_PF;
  static constexpr int kSlot[2] = {0, 1};
  static constexpr bool kRoundGateUp = true, kRoundRouteTerm = true;  // ds_fp4's bf16 roundings
  struct Ref {
    const uint8_t* w;
  };
  static CPUMOE_INLINE Ref ref(const cpumoe_kernel*, const cpumoe_bank* banks, int mat, int32_t e, int32_t g) {
    return {bank_row<uint8_t>(banks[mat], e, g)};
  }
  template <int G, int NT>
  static void groups(const Ref* gp, int K, const void* const* act, float* out);
};

// out[(g * NT + t) * 16 + r] = dot(row r of group g, token t) for G groups (bank rows gp[g]) and NT tokens.
template <int G, int NT>
CPUMOE_INLINE void G16::groups(const Ref* gp, int K, const void* const* act, float* out) {
  const x16::Int8Toks<NT, QK> a(act, K);
  const int nb = K / QK;
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  const __m512i m = _mm512_set1_epi8(0x0F), lut = tbl512(w2_offset());
  __m512 acc[G][NT];
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = gp[g].w + (size_t)b * GB;
      for (int l = 0; l < 5; ++l) __builtin_prefetch(p + CPUMOE_DSX16_PF + 64 * l, 0, 3);
      const __m512 sw = e8m0x16(p);
      __m512i lo[4], hi[4];
      CPUMOE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __m512i w = _mm512_loadu_si512((const void*)(p + SB + 64 * j));
        lo[j] = _mm512_shuffle_epi8(lut, _mm512_and_si512(w, m));
        hi[j] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(w, 4), m));
      }
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        // the token's 4-code groups: elements 4j.. (low nibbles) and 16+4j.. (high)
        const int32_t* qa = (const int32_t*)(a.q[t] + (size_t)b * QK);
        __m512i s0 = _mm512_set1_epi32(a.corr[t][b]), s1 = _mm512_setzero_si512();  // two chains
        CPUMOE_UNROLL
        for (int j = 0; j < 4; ++j) {
          s0 = x16::dpbusd_bcast(s0, lo[j], qa + j);
          s1 = x16::dpbusd_bcast(s1, hi[j], qa + 4 + j);
        }
        const __m512 f = x16::mul_bcast(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), a.s[t] + b);
        acc[g][t] = _mm512_fmadd_ps(f, sw, acc[g][t]);
      }
    }
  }
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + (size_t)(g * NT + t) * GR, acc[g][t]);
#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
  // rows 8h..8h+7 of each group in turn: the first half's pass brings the lines in, the second reads them from L1/L2
  const __m256i m = _mm256_set1_epi8(0x0F), lut = w2_offset();
  for (int g = 0; g < G; ++g)
    for (int h = 0; h < 2; ++h) {
      __m256 acc[NT];
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
      for (int b = 0; b < nb; ++b) {
        const uint8_t* p = gp[g].w + (size_t)b * GB;
        if (h == 0)
          for (int l = 0; l < 5; ++l) __builtin_prefetch(p + CPUMOE_DSX16_PF + 64 * l, 0, 3);
        const __m256 sw = e8m0x8(load8(p + 8 * h));
        __m256i lo[4], hi[4];
        CPUMOE_UNROLL
        for (int j = 0; j < 4; ++j) {
          const __m256i w = _mm256_loadu_si256((const __m256i*)(p + SB + 64 * j + 32 * h));
          lo[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(w, m));
          hi[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(w, 4), m));
        }
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          int32_t qa[8];
          std::memcpy(qa, a.q[t] + (size_t)b * QK, 32);
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
          __m256i s0 = _mm256_set1_epi32(a.corr[t][b]), s1 = _mm256_setzero_si256();
          CPUMOE_UNROLL
          for (int j = 0; j < 4; ++j) {
            s0 = _mm256_dpbusd_avx_epi32(s0, lo[j], _mm256_set1_epi32(qa[j]));
            s1 = _mm256_dpbusd_avx_epi32(s1, hi[j], _mm256_set1_epi32(qa[4 + j]));
          }
          const __m256i S = _mm256_add_epi32(s0, s1);
#else
          // u8 x s8 pairs by vpmaddubsw: each int16 <= 2 * 24 * 127 = 6096, so four of them <= 24384 (exact in
          // int16; eight could wrap): two int16 sums, each widened by vpmaddwd by 1, give the exact int32 of the
          // other tiers
          __m256i s16a = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(qa[0]));
          s16a = _mm256_add_epi16(s16a, _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(qa[4])));
          s16a = _mm256_add_epi16(s16a, _mm256_maddubs_epi16(lo[1], _mm256_set1_epi32(qa[1])));
          s16a = _mm256_add_epi16(s16a, _mm256_maddubs_epi16(hi[1], _mm256_set1_epi32(qa[5])));
          __m256i s16b = _mm256_maddubs_epi16(lo[2], _mm256_set1_epi32(qa[2]));
          s16b = _mm256_add_epi16(s16b, _mm256_maddubs_epi16(hi[2], _mm256_set1_epi32(qa[6])));
          s16b = _mm256_add_epi16(s16b, _mm256_maddubs_epi16(lo[3], _mm256_set1_epi32(qa[3])));
          s16b = _mm256_add_epi16(s16b, _mm256_maddubs_epi16(hi[3], _mm256_set1_epi32(qa[7])));
          const __m256i one = _mm256_set1_epi16(1);
          const __m256i S = _mm256_add_epi32(
              _mm256_add_epi32(_mm256_madd_epi16(s16a, one), _mm256_madd_epi16(s16b, one)),
              _mm256_set1_epi32(a.corr[t][b]));
#endif
          const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(S), _mm256_set1_ps(a.s[t][b]));
          acc[t] = _mm256_fmadd_ps(f, sw, acc[t]);
        }
      }
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + (size_t)(g * NT + t) * GR + 8 * h, acc[t]);
    }
#else  // scalar: the same integers and fp32 operations, row by row
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < GR; ++r) {
        float acc = 0.f;
        for (int b = 0; b < nb; ++b) {
          const uint8_t* p = gp[g].w + (size_t)b * GB;
          const int8_t* qb = a.q[t] + (size_t)b * QK;
          int32_t s = 0;
          for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = p[SB + 64 * j + 4 * r + i];
              s += kW2[byte & 15] * qb[4 * j + i] + kW2[byte >> 4] * qb[16 + 4 * j + i];
            }
          acc = std::fma((float)s * a.s[t][b], e8m0_to_f32(p[r]), acc);
        }
        out[(size_t)(g * NT + t) * GR + r] = acc;
      }
#endif
}

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(ds_fp4_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || \
    CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  return x16::install<G16>(k, CPUMOE_MODE_W4A8, &x16::int8_record_bytes<QK>, &prep_x16);
#else
  (void)k;
  return false;  // avx512f / avx512bf16 / amx: the tier below (avxvnni or avx2) or avx512vnni runs
#endif
}
