// The e2m1 "_x16" group layout and its group dot, shared by ds_fp4_x16 and mxfp4_x16 (private header): both store
// e2m1 codes with one e8m0 scale per 32-block and quantize activations to int8 per 32 (w4a8); they differ only in
// how a block's exact integer sum is folded into the fp32 result (their source formats' definitions), which each
// supplies as a Fold policy.
//
// A bank row is a group of 16 weight rows; per 32-block it holds 272 bytes: the 16 rows' e8m0 scales (row r at
// byte r), then 4 x 64 code bytes, vector j's int32 lane r = row r's codes of elements 4j..4j+3 in the low
// nibbles and 16+4j..16+4j+3 in the high ones (byte i of the lane: elements 4j+i and 16+4j+i). Weights enter the
// integer dots as u = 2 E2M1 + 12 in [0, 24] (vpshufb of the nibble); the token record's corr_b = -12 sum(q_b)
// makes S_b = corr_b + sum(u q) = sum(2 E2M1 q) exact (|S_b| <= 32 * 12 * 127). The record is x16::BlockToks<NT,
// 32>: per block 40 bytes, its int8 q[32] (element order), fp32 s (the fold's per-block activation factor), int32
// corr (x16::put_block_tail).
//
// Fold policy F (per (row, token), from acc = 0, block by block in K order; every tier does the same fp32
// operations, so the tiers are bit-identical and a token's result does not depend on its batch):
//   F::scale16(p) / F::scale8(p) / F::scale1(code): the block's per-row weight factor from its e8m0 bytes
//   F::fold(acc, S, sw, s_b): acc updated with the integer S (as int vector or int32), the weight factor and the
//   token's per-block factor s_b (a pointer in the vector tiers, folded into a broadcast)
#pragma once
#include <cmath>
#include <cstring>

#include "../x16.h"
#include "fp4_common.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
namespace e2m1x16 {

constexpr int QK = 32, GR = x16::GR, GB = 272, SB = 16;  // SB: the scale bytes that open a group block
// tokens per group call: 8 in 32 zmm registers; the 16-register tiers take the 16 rows in two halves of 8, with
// their 8 code vectors and one accumulator per token live
constexpr int kMaxNT = CPUMOE_X16_ZMM ? 8 : 4;
// Software prefetch 3 KB ahead in each group stream (q4_0_x16's distance), 5 lines per 272-byte block step.
#ifndef CPUMOE_E2M1X16_PF
#define CPUMOE_E2M1X16_PF 3072
#endif
constexpr int64_t kPf = CPUMOE_E2M1X16_PF;

#if CPUMOE_X16_ZMM
// the 16 e8m0 bytes at p -> 2^(min(s,254) - 127), s = 0 -> 2^-127 (e8m0_to_f32 lane by lane): s << 23 is at
// least 2^23 for s >= 1, so the unsigned max with 0x00400000 (2^-127) changes only s = 0
CPUMOE_INLINE __m512 e8m0x16(const uint8_t* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512i v = _mm512_slli_epi32(_mm512_min_epu32(b, _mm512_set1_epi32(254)), 23);
  return _mm512_castsi512_ps(_mm512_max_epu32(v, _mm512_set1_epi32(0x00400000)));
}
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2
// One token's exact block sums of all 16 rows (AVX2): S0 / S1 (rows 0-7 / 8-15) = corr + sum(u x q), the integers
// in two int16 runs of 4 vpmaddubsw each (u <= 24: <= 24384 a run), in inline asm as q4_0_x16's and nvfp4_x16's one-token
// blocks (no spills; the codes masked straight from memory). p: the group block, rec: the token's block record.
CPUMOE_INLINE void sums_one_token(const uint8_t* p, const int8_t* rec, __m256i m, __m256i lut, __m256i& S0,
                                  __m256i& S1) {
  static_assert(x16::BlockToks<1, QK>::kStride == 40, "record: 32 codes, float s at 32, int32 corr at 36");
  __m256i s0, s1;
  // code vector j: rows 0-7 at SB + 64j, rows 8-15 at SB + 64j + 32; its low nibbles meet codes 4j.., the high
  // 16 + 4j..; u = lut[nibble]
#define CPUMOE_E2M1_STEP(j, FIRST)                                           \
  CPUMOE_X16_ASM_NIBBLES(#j "*64+16(%[p])", #j "*64+48(%[p])")              \
  "vpshufb %%ymm0, %[lut], %%ymm0\n\t"                                       \
  "vpshufb %%ymm1, %[lut], %%ymm1\n\t"                                       \
  "vpshufb %%ymm2, %[lut], %%ymm2\n\t"                                       \
  "vpshufb %%ymm3, %[lut], %%ymm3\n\t"                                       \
  "vpbroadcastd " #j "*4(%[r]), %%ymm4\n\t"                                  \
  "vpbroadcastd " #j "*4+16(%[r]), %%ymm5\n\t"                               \
  CPUMOE_X16_ASM_MADD4(FIRST)
  __asm__(CPUMOE_E2M1_STEP(0, CPUMOE_X16_ASM_FIRST) CPUMOE_E2M1_STEP(1, CPUMOE_X16_ASM_NEXT)
          // the first int16 runs (u <= 24: 4 products per run, <= 24384) -> int32, + corr
          "vpmaddwd %[ones], %[s0], %[S0]\n\t"
          "vpmaddwd %[ones], %[s1], %[S1]\n\t"
          "vpbroadcastd 36(%[r]), %%ymm4\n\t"
          "vpaddd %%ymm4, %[S0], %[S0]\n\t"
          "vpaddd %%ymm4, %[S1], %[S1]\n\t"
          CPUMOE_E2M1_STEP(2, CPUMOE_X16_ASM_FIRST) CPUMOE_E2M1_STEP(3, CPUMOE_X16_ASM_NEXT)
          "vpmaddwd %[ones], %[s0], %[s0]\n\t"
          "vpmaddwd %[ones], %[s1], %[s1]\n\t"
          "vpaddd %[s0], %[S0], %[S0]\n\t"
          "vpaddd %[s1], %[S1], %[S1]\n\t"
          : [S0] "=&x"(S0), [S1] "=&x"(S1), [s0] "=&x"(s0), [s1] "=&x"(s1)
          : [p] "r"(p), [r] "r"(rec), [m] "x"(m), [lut] "x"(lut), [ones] "m"(x16::kOnes16),
            "m"(*(const uint8_t(*)[GB])p), "m"(*(const int8_t(*)[40])rec)
          : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5");
#undef CPUMOE_E2M1_STEP
}
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2
// Rows 8h..8h+7 of a group (codes at w) for NT >= 2 tokens into out[t * 16 + r] (avx2): code step j outermost, its
// two u vectors meet every token in turn and each token's pair of products (<= 2 * 2 * 24 * 127 = 12192) is widened
// at once, so 2 code registers and NT int32 sums are live where the earlier order (8 code vectors first, two int16
// runs) spilled at NT = 4; the same exact integers. Out of line, with an ordering asm per step, as q4_0_x16's.
template <class F, int NT>
__attribute__((noinline)) void half_pass(const uint8_t* w, int nb, int h, const void* const* act, float* out) {
  const __m256i m = _mm256_set1_epi8(0x0F), lut = fp4::w2_offset(), one = _mm256_set1_epi16(1);
  using A = x16::BlockToks<NT, QK>;
  x16::half_pass_blocks<NT, QK>(w, nb, GB, h, kPf, act, out, [&](int b, const uint8_t* p, const A& a, __m256* acc)
                                                                  CPUMOE_LAMBDA_INLINE {
    __m256i S[NT];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) S[t] = _mm256_set1_epi32(*a.corr(t, b));
    CPUMOE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(p + SB + 64 * j + 32 * h));
      const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m));
      const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const __m256i pr = x16::maddubs_pair(lo, hi, a.q(t, b) + 4 * j, a.q(t, b) + 16 + 4 * j);
        S[t] = _mm256_add_epi32(S[t], _mm256_madd_epi16(pr, one));
        __asm__("" : "+x"(S[t]), "+r"(p));  // the next step's codes load after these sums
      }
    }
    const __m256 sw = F::scale8(p + 8 * h);
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) acc[t] = F::fold(acc[t], S[t], sw, a.s(t, b));
  });
}
#endif

// out[(g * NT + t) * 16 + r] = dot(row r of group g, token t) for G groups (their bank rows gp[g].w: any layout Ref
// with the group's codes as w) and NT tokens.
template <class F, int G, int NT, class Ref>
CPUMOE_INLINE void groups(const Ref* gp, int K, const void* const* act, float* out) {
  using namespace fp4;
  const int nb = K / QK;
#if CPUMOE_X16_ZMM
  x16::BlockToks<NT, QK> a(act);
  const __m512i lut = tbl512(w2_offset());
  __m512 acc[G][NT];
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = gp[g].w + (size_t)b * GB;
      for (int l = 0; l < 5; ++l) __builtin_prefetch(p + kPf + 64 * l, 0, 3);
      const __m512 sw = F::scale16(p);
      __m512i lo[4], hi[4];
      CPUMOE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512((const void*)(p + SB + 64 * j));
        lo[j] = nib_lo512(v, lut);
        hi[j] = nib_hi512(v, lut);
      }
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        // the token's 4-code groups: elements 4j.. (low nibbles) and 16+4j.. (high)
        const int32_t* qa = (const int32_t*)a.q(t, 0);
        __m512i s0 = _mm512_set1_epi32(*a.corr(t, 0));
        if constexpr (G * NT >= 4) {  // enough independent chains (one per group and token): one add fewer
          CPUMOE_UNROLL
          for (int j = 0; j < 4; ++j) {
            s0 = x16::dpbusd_bcast(s0, lo[j], qa + j);
            s0 = x16::dpbusd_bcast(s0, hi[j], qa + 4 + j);
          }
        } else {  // two chains (the same exact integer)
          __m512i s1 = _mm512_setzero_si512();
          CPUMOE_UNROLL
          for (int j = 0; j < 4; ++j) {
            s0 = x16::dpbusd_bcast(s0, lo[j], qa + j);
            s1 = x16::dpbusd_bcast(s1, hi[j], qa + 4 + j);
          }
          s0 = _mm512_add_epi32(s0, s1);
        }
        acc[g][t] = F::fold(acc[g][t], s0, sw, a.s(t, 0));
      }
    }
    a.advance(1);
  }
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + (size_t)(g * NT + t) * GR, acc[g][t]);
#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
  const __m256i m = _mm256_set1_epi8(0x0F), lut = w2_offset();
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
  // the block's u vectors of rows 8h..8h+7 (block32_sum's lo / hi)
  const auto codes = [&](const uint8_t* p, int h, __m256i* lo, __m256i* hi) {
    CPUMOE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(p + SB + 64 * j + 32 * h));
      lo[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, m));
      hi[j] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
    }
  };
#endif
  if constexpr (NT == 1) {  // one token: both halves of the G groups per block, side by side
    const x16::BlockToks<1, QK> a(act);
    x16::one_token_groups<G>(nb, [&](int b, int g, __m256& a0, __m256& a1) CPUMOE_LAMBDA_INLINE {
      const uint8_t* p = gp[g].w + (size_t)b * GB;
      x16::prefetch_one_token(p, 5);
#if CPUMOE_TIER == CPUMOE_T_AVX2
      __m256i S[2];
      sums_one_token(p, a.q(0, b), m, lut, S[0], S[1]);
#endif
      CPUMOE_UNROLL
      for (int h = 0; h < 2; ++h) {
#if CPUMOE_TIER != CPUMOE_T_AVX2
        __m256i lo[4], hi[4];
        codes(p, h, lo, hi);
        const __m256i Sh = x16::block32_sum(lo, hi, a.q(0, b), *a.corr(0, b));
#else
        const __m256i Sh = S[h];
#endif
        __m256& A = h ? a1 : a0;
        A = F::fold(A, Sh, F::scale8(p + 8 * h), a.s(0, b));
      }
    }, out);
    return;
  }
  // more tokens: rows 8h..8h+7 of each group in turn, NT tokens' accumulators each; the first half's pass brings
  // the lines in, the second reads them from L1/L2 while it prefetches the next group (a second pass without
  // memory traffic left DRAM idle: batch 1 ran 10-15% slower than the row-major kernels on Zen 3)
#if CPUMOE_TIER == CPUMOE_T_AVX2
  for (int g = 0; g < G; ++g)
    for (int h = 0; h < 2; ++h) half_pass<F, NT>(gp[g].w, nb, h, act, out + (size_t)g * NT * GR + 8 * h);
#else
  for (int g = 0; g < G; ++g)
    for (int h = 0; h < 2; ++h) {
      __m256 acc[NT];
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
      const x16::BlockToks<NT, QK> a(act);
      for (int b = 0; b < nb; ++b) {
        const uint8_t* p = gp[g].w + (size_t)b * GB;
        x16::prefetch_half_pass(p, 5, h == 0, kPf, (size_t)nb * GB);
        const __m256 sw = F::scale8(p + 8 * h);
        __m256i lo[4], hi[4];
        codes(p, h, lo, hi);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) acc[t] = F::fold(acc[t], x16::block32_sum(lo, hi, a.q(t, b), *a.corr(t, b)), sw,
                                                      a.s(t, b));
      }
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + (size_t)(g * NT + t) * GR + 8 * h, acc[t]);
    }
#endif
#else  // scalar: the same integers and fp32 operations, row by row
  const x16::BlockToks<NT, QK> a(act);
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < GR; ++r) {
        float acc = 0.f;
        for (int b = 0; b < nb; ++b) {
          const uint8_t* p = gp[g].w + (size_t)b * GB;
          const int8_t* qb = a.q(t, b);
          int32_t s = 0;
          for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = p[SB + 64 * j + 4 * r + i];
              s += kW2[byte & 15] * qb[4 * j + i] + kW2[byte >> 4] * qb[16 + 4 * j + i];
            }
          acc = F::fold(acc, s, F::scale1(p[r]), a.s(t, b));
        }
        out[(size_t)(g * NT + t) * GR + r] = acc;
      }
#endif
}

}  // namespace e2m1x16
}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe
