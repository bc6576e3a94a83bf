// The group dots of the "_x16" layouts of the K-quants with scales and mins, q4_k_x16 and q5_k_x16 (mode w4a8):
// KMinsX16<kFifth> for gguf_x16.h's RowG16. A bank row is a group of 16 weight rows; per 256-block it holds the
// block's bytes of the 16 rows, moved:
//   [0, 32)      the 16 rows' fp16 d (row r at 2r)
//   [32, 64)     their fp16 dmin
//   [64, 256)    12 planes of 16 bytes: plane k byte r = row r's packed scale byte k
//   kFifth (q5_k_x16) only:
//   [256, 768)   8 vectors of 64 bytes: vector v, int32 lane r = row r's qh[4v .. 4v + 3] (bit j of byte 4v + i:
//                the fifth bit of element 32j + 4v + i)
//   [QS, GB)     32 vectors of 64 bytes: vector 8c + v, int32 lane r = row r's qs[32c + 4v .. 32c + 4v + 3]
//                (low nibbles: elements 64c + 4v .. of sub-block 2c; high: 64c + 32 + 4v .. of sub-block 2c + 1);
//                QS = 256, GB = 2304 (q4_k_x16) / QS = 768, GB = 2816 (q5_k_x16)
// The code of an element: its nibble, with kFifth its fifth bit << 4 (0..15 / 0..31).
//
// Activations (w4a8): each 256-block quantized by the Q8_0 rule (q4_k's and q5_k's codes and d_a), with the int16
// sum of each 32 codes. Record: per block 288 bytes, q[256], float d_a at 256, int16 bs32[8] at 260.
// Per (row, token), from acc = 0, block by block in K order:
//   S = sum_j sc[j] sum_{i in j} q_i a_i,  M = sum_j m[j] bs32[j]     (exact int32)
//   acc = fma(float(S), fp32(d) * d_a, acc);  acc = fma(float(M), -(fp32(dmin) * d_a), acc)
// Every tier does these operations in this order (std::fma in scalar): the tiers are bit-identical, and a token's
// result does not depend on its batch. Lanes are rows: a vpdpbusd serves 16 rows (zmm) and the scales, the mins and
// the fold are paid once per 16 rows and token, where the row-major kernels pay them per (row, token).
#pragma once
#include <cmath>
#include <cstring>

#include "gguf_rows.h"
#include "gguf_x16.h"
#include "kquant_mins.h"  // gguf::fifth_bits

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int QK = 256, GR = x16::GR, REC = 288;
// tokens per group call: zmm: per token an int32 block sum and an fp32 accumulator live across the block beside a run
// pair's 16 code vectors (16 + 2 * 4 + temporaries of 32 registers); ymm: per token two int16 runs, the block sum and
// the accumulator beside 6 weight-side registers (of 16)
constexpr int kMaxNT = CPUMOE_TIER == CPUMOE_T_AVX512VNNI ? 4 : 2;
#ifndef CPUMOE_KMINSX16_PF
#define CPUMOE_KMINSX16_PF 3072
#endif

// The record of one token: per 256-block q[256], d_a, bs32[8] (the sum of each 32 codes), padding to 288; the codes
// and d_a are q4_k's prep's (gguf_rows.h prep_act_i8<256>, run on the block).
inline void prep_x16(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  alignas(64) int8_t one[QK + 4 + 32];  // a one-block q4_k record: q[256], d_a, bsum[16]
  for (int32_t b = 0; b < K / QK; ++b) {
    gguf::prep_act_i8<QK>(nullptr, src + (size_t)b * QK, QK, one);
    int8_t* rec = (int8_t*)dst + (size_t)b * REC;
    std::memcpy(rec, one, QK + 4);
    for (int j = 0; j < 8; ++j) {
      int16_t b0, b1;
      std::memcpy(&b0, one + QK + 4 + 4 * j, 2);
      std::memcpy(&b1, one + QK + 4 + 4 * j + 2, 2);
      const int16_t sum = (int16_t)(b0 + b1);  // |sum| <= 32 * 127
      std::memcpy(rec + QK + 4 + 2 * j, &sum, 2);
    }
    std::memset(rec + QK + 20, 0, REC - QK - 20);
  }
}
inline size_t act_bytes_x16(const cpumoe_kernel*, int32_t K) { return (size_t)(K / QK) * REC; }

// The scales and mins of the 16 rows of a group-block (planes at p + 64): sc[j] / m[j] as 16 bytes each (row r at
// byte r), j = 0..7: out[0 .. 127] sc, out[128 .. 255] m.
CPUMOE_INLINE void unpack_scales(const uint8_t* planes, uint8_t* out) {
#if defined(__AVX2__)
  for (int h = 0; h < 2; ++h) {  // planes 0-3 / 4-7 / 8-11 as 2 x 32 bytes each
    const __m256i A = _mm256_loadu_si256((const __m256i*)(planes + 32 * h));
    const __m256i B = _mm256_loadu_si256((const __m256i*)(planes + 64 + 32 * h));
    const __m256i C = _mm256_loadu_si256((const __m256i*)(planes + 128 + 32 * h));
    const __m256i m63 = _mm256_set1_epi8(63), m15 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    _mm256_storeu_si256((__m256i*)(out + 32 * h), _mm256_and_si256(A, m63));
    _mm256_storeu_si256((__m256i*)(out + 128 + 32 * h), _mm256_and_si256(B, m63));
    _mm256_storeu_si256((__m256i*)(out + 64 + 32 * h),
                        _mm256_or_si256(_mm256_and_si256(C, m15), _mm256_and_si256(_mm256_srli_epi16(A, 2), m30)));
    _mm256_storeu_si256((__m256i*)(out + 192 + 32 * h),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(C, 4), m15),
                                        _mm256_and_si256(_mm256_srli_epi16(B, 2), m30)));
  }
#else
  for (int r = 0; r < GR; ++r)
    for (int j = 0; j < 4; ++j) {
      const uint8_t a = planes[16 * j + r], b = planes[16 * (j + 4) + r], c = planes[16 * (j + 8) + r];
      out[16 * j + r] = a & 63;
      out[128 + 16 * j + r] = b & 63;
      out[16 * (j + 4) + r] = (c & 15) | (a >> 6) << 4;
      out[128 + 16 * (j + 4) + r] = (c >> 4) | (b >> 6) << 4;
    }
#endif
}

// The group dots: zmm (avx512vnni), ymm row halves (avx2 / avxvnni), scalar. kSwPf: the software prefetch (x16.h
// gguf_sw_prefetch; q4_k_x16 builds false on avx512vnni only, q5_k_x16 never).
template <bool kFifth, bool kSwPf = true>
struct KMinsX16 {
  static constexpr int QK = 256, kMaxNT = ::cpumoe::CPUMOE_NS::kMaxNT;
  static constexpr int QH = 256, QS = kFifth ? 768 : 256, GB = QS + 2048;  // qh, qs offsets; bytes a group-block
  // q5_k_x16 keeps its software prefetch on avx512vnni: without it a step took twice as long (qwen3-30b batch 1
  // from DRAM, 2 Zen 4 threads: 823-826 us with it, 1389-1669 without)
  static constexpr int64_t kPf = x16::gguf_pf(kFifth || kSwPf, CPUMOE_KMINSX16_PF);

  // element l = 4v + i of run pair c's runs: low nibble (sub-block 2c), high (2c + 1)
  static CPUMOE_INLINE int code(const uint8_t* p, int c, int v, int r, int i, bool high) {
    const uint8_t byte = p[QS + 512 * c + 64 * v + 4 * r + i];
    const int n = high ? byte >> 4 : byte & 15;
    if constexpr (!kFifth) return n;
    return n | ((p[QH + 64 * v + 4 * r + i] >> (2 * c + high)) & 1) << 4;
  }

#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  // G groups x NT tokens, all 16 rows per zmm. Per group-block: its scales and mins unpacked once; per run pair c
  // the 8 code vectors split into 16 (low / high nibbles, with kFifth their fifth bits: one vpternlogd select each)
  // once for the NT tokens, whose two run sums (vpdpbusd against the token's 4 codes broadcast, 8 steps each) are
  // scaled by the runs' sc (vpmulld) into the token's block sum.
  template <int G, int NT>
  static CPUMOE_INLINE void zmm(const uint8_t* const* w, int nb, const void* const* act, float* out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    auto block = [&](int b, const uint8_t* p, __m512 (&acc)[1][NT]) CPUMOE_LAMBDA_INLINE {
      if constexpr (kPf > 0)
        for (int l = 0; l < QS / 64; ++l) __builtin_prefetch(p + kPf + 64 * l, 0, 3);
      alignas(64) uint8_t sm[256];
      unpack_scales(p + 64, sm);
      __m512i S[NT];
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) S[t] = _mm512_setzero_si512();
      CPUMOE_UNROLL
      for (int c = 0; c < 4; ++c) {
        const uint8_t* v = p + QS + 512 * c;
        if constexpr (kPf > 0)
          for (int l = 0; l < 8; ++l) __builtin_prefetch(v + kPf + 64 * l, 0, 3);
        __m512i lo[8], hi[8];
        CPUMOE_UNROLL
        for (int j = 0; j < 8; ++j) {
          const __m512i x = _mm512_loadu_si512(v + 64 * j);
          if constexpr (kFifth) {  // m4 ? nibble : fifth bit (bit 4 alone)
            const __m512i qh = _mm512_loadu_si512(p + QH + 64 * j);
            lo[j] = _mm512_ternarylogic_epi32(x, gguf::fifth_bits(qh, 2 * c), m4, 0xE4);
            hi[j] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(x, 4),
                                              gguf::fifth_bits(qh, 2 * c + 1), m4, 0xE4);
          } else {
            lo[j] = _mm512_and_si512(x, m4), hi[j] = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4);
          }
        }
        const __m512i sa = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(sm + 32 * c)));
        const __m512i sb = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)(sm + 32 * c + 16)));
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int32_t* qa = (const int32_t*)((const int8_t*)act[t] + (size_t)b * REC + 64 * c);
          __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
          CPUMOE_UNROLL
          for (int j = 0; j < 8; ++j)
            s0 = x16::dpbusd_bcast(s0, lo[j], qa + j), s1 = x16::dpbusd_bcast(s1, hi[j], qa + 8 + j);
          S[t] = _mm512_add_epi32(S[t], _mm512_add_epi32(_mm512_mullo_epi32(s0, sa), _mm512_mullo_epi32(s1, sb)));
        }
      }
      // mins: int16 pairs (m[2k], m[2k+1]) per row against the token's (bs32[2k], bs32[2k+1])
      __m512i mp[4];
      CPUMOE_UNROLL
      for (int k = 0; k < 4; ++k) {
        const __m128i a = _mm_load_si128((const __m128i*)(sm + 128 + 32 * k));
        const __m128i bq = _mm_load_si128((const __m128i*)(sm + 128 + 32 * k + 16));
        mp[k] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, bq))),
                                   _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(a, bq)), 1);
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + 32)));
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const int8_t* rec = (const int8_t*)act[t] + (size_t)b * REC;
        const int32_t* bs = (const int32_t*)(rec + QK + 4);
        __m512i M = _mm512_setzero_si512();
        CPUMOE_UNROLL
        for (int k = 0; k < 4; ++k) M = _mm512_dpwssd_epi32(M, mp[k], _mm512_set1_epi32(bs[k]));
        const __m512 da = _mm512_set1_ps(*(const float*)(rec + QK));
        acc[0][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[t]), _mm512_mul_ps(d, da), acc[0][t]);
        const __m512 nm = _mm512_castsi512_ps(
            _mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, da)), _mm512_set1_epi32((int)0x80000000u)));
        acc[0][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(M), nm, acc[0][t]);  // -(dmin d_a), as the scalar tier
      }
    };
    x16::group_blocks<x16::Zmm, G, NT, 0, 1>(w, nb, GB, out, block);
  }
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
  // G groups x NT tokens, rows 8h..8h+7 (h in [H0, H0 + NH)) of each group per ymm. A run's int16 pair sums stay
  // exact over kRun code steps (4-bit codes: 8 steps, <= 8 * 2 * 15 * 127 = 30480; 5-bit: 4 steps, <= 4 * 2 * 31 *
  // 127 = 31496); vpmaddwd with (sc, sc) per row gives sc times the partial sum in int32. A lone token takes both
  // halves of its groups block by block (G x 2 streams); several take one half per pass (the second pass reads the
  // group from L1 / L2), so only one half's accumulators are live.
  static constexpr int kRun = kFifth ? 4 : 8;
  template <int G, int NT, int H0, int NH>
  static CPUMOE_INLINE void ymm(const uint8_t* const* w, int nb, const void* const* act, float* out) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    auto block = [&](int b, const uint8_t* p, __m256 (&acc)[NH][NT]) CPUMOE_LAMBDA_INLINE {
      if (H0 == 0)
        for (int l = 0; l < QS / 64; ++l) __builtin_prefetch(p + kPf + 64 * l, 0, 3);
      alignas(64) uint8_t sm[256];
      unpack_scales(p + 64, sm);
      CPUMOE_UNROLL
      for (int hh = 0; hh < NH; ++hh) {
        const int h = H0 + hh;
        __m256i S[NT];
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) S[t] = _mm256_setzero_si256();
        CPUMOE_UNROLL
        for (int c = 0; c < 4; ++c) {
          const uint8_t* v = p + QS + 512 * c + 32 * h;
          if (h == 0)
            for (int l = 0; l < 8; ++l) __builtin_prefetch(v + kPf + 64 * l, 0, 3);
          auto pairs = [&](const uint8_t* s) CPUMOE_LAMBDA_INLINE {  // (sc, sc) int16 per row (dword lane)
            const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(s + 8 * h)));
            return _mm256_or_si256(x, _mm256_slli_epi32(x, 16));
          };
          const __m256i sa = pairs(sm + 32 * c), sb = pairs(sm + 32 * c + 16);
          __m256i P0[NT], P1[NT];
          CPUMOE_UNROLL
          for (int j = 0; j < 8; ++j) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(v + 64 * j));
            __m256i lo = _mm256_and_si256(x, m4), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4);
            if constexpr (kFifth) {
              const __m256i qh = _mm256_loadu_si256((const __m256i*)(p + QH + 64 * j + 32 * h));
              lo = _mm256_or_si256(lo, gguf::fifth_bits(qh, 2 * c));
              hi = _mm256_or_si256(hi, gguf::fifth_bits(qh, 2 * c + 1));
            }
            CPUMOE_UNROLL
            for (int t = 0; t < NT; ++t) {
              const int8_t* qa = (const int8_t*)act[t] + (size_t)b * REC + 64 * c;
              const __m256i a0 = _mm256_maddubs_epi16(lo, x16::bcast4(qa + 4 * j));
              const __m256i a1 = _mm256_maddubs_epi16(hi, x16::bcast4(qa + 32 + 4 * j));
              P0[t] = j % kRun ? _mm256_add_epi16(P0[t], a0) : a0;
              P1[t] = j % kRun ? _mm256_add_epi16(P1[t], a1) : a1;
            }
            if (j % kRun == kRun - 1)
              CPUMOE_UNROLL
              for (int t = 0; t < NT; ++t) {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
                S[t] = _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(S[t], P0[t], sa), P1[t], sb);
#else
                S[t] = _mm256_add_epi32(S[t],
                                        _mm256_add_epi32(_mm256_madd_epi16(P0[t], sa), _mm256_madd_epi16(P1[t], sb)));
#endif
              }
          }
        }
        __m256i mp[4];
        CPUMOE_UNROLL
        for (int k = 0; k < 4; ++k)
          mp[k] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i*)(sm + 128 + 32 * k + 8 * h)),
                                                         _mm_loadl_epi64((const __m128i*)(sm + 144 + 32 * k + 8 * h))));
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 32 + 16 * h)));
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int8_t* rec = (const int8_t*)act[t] + (size_t)b * REC;
          const int32_t* bs = (const int32_t*)(rec + QK + 4);
          __m256i M = _mm256_madd_epi16(mp[0], _mm256_set1_epi32(bs[0]));
          CPUMOE_UNROLL
          for (int k = 1; k < 4; ++k) M = _mm256_add_epi32(M, _mm256_madd_epi16(mp[k], _mm256_set1_epi32(bs[k])));
          const __m256 da = _mm256_set1_ps(*(const float*)(rec + QK));
          __m256& A = acc[hh][t];
          A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[t]), _mm256_mul_ps(d, da), A);
          A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_xor_ps(_mm256_mul_ps(dmin, da), _mm256_set1_ps(-0.0f)), A);
        }
      }
    };
    x16::group_blocks<x16::Ymm, G, NT, H0, NH>(w, nb, GB, out, block);
  }
#endif

#if CPUMOE_TIER == CPUMOE_T_SCALAR
  // scalar: the same integers and fp32 operations, row by row
  template <int G, int NT>
  static void scalar(const uint8_t* const* w, int nb, const void* const* act, float* out) {
    auto block = [&](const uint8_t* p, int t, int b, int r, float acc) CPUMOE_LAMBDA_INLINE {
      const int8_t* rec = (const int8_t*)act[t] + (size_t)b * REC;
      uint8_t sm[256];
      unpack_scales(p + 64, sm);
      int32_t S = 0, M = 0;
      for (int c = 0; c < 4; ++c) {
        int32_t s0 = 0, s1 = 0;
        for (int v = 0; v < 8; ++v)
          for (int i = 0; i < 4; ++i) {
            s0 += code(p, c, v, r, i, false) * rec[64 * c + 4 * v + i];
            s1 += code(p, c, v, r, i, true) * rec[64 * c + 32 + 4 * v + i];
          }
        S += s0 * sm[32 * c + r] + s1 * sm[32 * c + 16 + r];
      }
      for (int j = 0; j < 8; ++j) {
        int16_t bs;
        std::memcpy(&bs, rec + QK + 4 + 2 * j, 2);
        M += sm[128 + 16 * j + r] * bs;
      }
      uint16_t dh, mh;
      std::memcpy(&dh, p + 2 * r, 2);
      std::memcpy(&mh, p + 32 + 2 * r, 2);
      float da;
      std::memcpy(&da, rec + QK, 4);
      acc = std::fma((float)S, fp16_to_f32(dh) * da, acc);
      acc = std::fma((float)M, -(fp16_to_f32(mh) * da), acc);
      return acc;
    };
    x16::scalar_rows<G, NT>(w, nb, GB, out, block);
  }
#endif
};

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe
