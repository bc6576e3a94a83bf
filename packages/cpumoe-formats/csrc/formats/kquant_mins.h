// Block traits (gguf_block_kernels.h) of the K-quants with scales and mins, q4_k and q5_k: 256 weights as eight
// runs of 32, fp16 d and dmin, 12 bytes of 6-bit scales sc[j] and mins m[j] at byte 4, the low nibbles at byte QS
// (run pair p in qs[32p ..]: element 64p + l in the low nibble of byte l, 64p + 32 + l in its high nibble) and,
// with kFifth (q5_k), a fifth bit per code in qh[32] at byte 16 (element 32j + l: bit j of qh[l]).
// w = d sc[j] q - dmin m[j].
//
// w4a8 (ggml vec_dot_q4_K_q8_K / q5_K_q8_K): per block two exact integers, S = sum_j sc[j] sum(q q_a) and
// M = sum_j m[j] (bsum[2j] + bsum[2j+1]), folded as acc += S (d d_a), acc += M (-(dmin d_a)). avx2: vpmaddubsw(codes,
// q_a) (a pair <= 2 * 31 * 127 = 7874, no int16 saturation), vpmaddwd with sc[j] broadcast in int16; avxvnni /
// avx512vnni vpdpwssd for the second step. 8 int32 lanes of S, lane l: sum_j sc[j] (products of elements 4l ..
// 4l+3 of run j), <= 8 * 63 * 4 * 31 * 127 = 7.9e6 < 2^24: converted exactly. The same integers in the three tiers,
// folded the same way, so they are bit-identical.
// native: fma(q, d sc[j], -(dmin m[j])) per element (gguf's weight, one rounding), then FMAs with x.
#pragma once
#include "gguf_block_kernels.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace gguf {

// The eight 6-bit scales (bytes 0..7 of *sc) and mins (*m) of the 12 packed bytes at s.
CPUMOE_INLINE void scales_mins(const uint8_t* s, uint64_t* sc, uint64_t* m) {
  const uint32_t a = ld32(s), b = ld32(s + 4), c = ld32(s + 8);
  const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);  // (a >> 6) << 4 per byte
  const uint32_t m_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
  *sc = (uint64_t)(a & 0x3F3F3F3Fu) | (uint64_t)sc_hi << 32;
  *m = (uint64_t)(b & 0x3F3F3F3Fu) | (uint64_t)m_hi << 32;
}

#if defined(__AVX2__)
// The 12 packed bytes at s -> bytes 0..7 sc[0..7], bytes 8..15 m[0..7] of an xmm (scales_mins in 7 SSE/AVX2 ops:
// dwords a, b, c of the 12 bytes; sc/m[0..3] = a/b & 63, sc/m[4..7] = (c & 15 | (a >> 6) << 4) / (c >> 4 & 15 |
// (b >> 6) << 4)). Reads 16 bytes from s (the 12, then 4 of the block's qs / qh).
CPUMOE_INLINE __m128i scales_mins_x(const uint8_t* s) {
  const __m128i x = _mm_loadu_si128((const __m128i*)s);               // a b c .
  const __m128i t = _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 2, 2));    // c c a b
  const __m128i v = _mm_and_si128(_mm_srlv_epi32(t, _mm_setr_epi32(0, 4, 2, 2)),
                                  _mm_setr_epi32(0x0F0F0F0F, 0x0F0F0F0F, 0x30303030, 0x30303030));
  const __m128i hi = _mm_or_si128(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(3, 2, 3, 2)));  // sc[4..7], m[4..7]
  const __m128i lo = _mm_and_si128(x, _mm_set1_epi8(0x3F));                          // sc[0..3], m[0..3]
  return _mm_unpacklo_epi32(lo, hi);  // sc[0..3] sc[4..7] m[0..3] m[4..7]
}
// Bit j of every byte of qh moved to bit 4, the other bits 0 (16-bit shifts by |4 - j| < 8: bit 4 of each byte
// comes from bit j of the same byte). j is a constant once inlined (an unrolled loop's index).
CPUMOE_INLINE __m256i fifth_bits(__m256i qh, int j) {
  const __m256i sh = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
  return _mm256_and_si256(sh, _mm256_set1_epi8(0x10));
}
template <int J>
CPUMOE_INLINE __m256i fifth_bits(__m256i qh) {
  return fifth_bits(qh, J);
}
#if defined(__AVX512BW__)
CPUMOE_INLINE __m512i fifth_bits(__m512i qh, int j) {  // the same on a zmm (q5_k_x16)
  const __m512i sh = j <= 4 ? _mm512_slli_epi16(qh, 4 - j) : _mm512_srli_epi16(qh, j - 4);
  return _mm512_and_si512(sh, _mm512_set1_epi8(0x10));
}
#endif
// int16 lanes 2j, 2j+1 (bytes 4j .. 4j+3) of every 128-bit lane: shuffle indices that broadcast int16 element j
CPUMOE_INLINE __m256i bcast16(__m256i v, int j) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16((short)(0x0100 + 0x0202 * j)));
}
#endif

template <int kQB, bool kFifth>
struct KMinsBlock {
  static constexpr int QK = 256, QB = kQB, kActQB = 256, kStep = 1;
  static constexpr int QH = 16, QS = kFifth ? 48 : 16;  // byte offsets of qh (kFifth only) and qs
  static constexpr int kPfLines = 3, kPfNativeEvery = 1, kPfNativeLines = 3;  // 144 / 176 bytes a block

  // code of element 32j + l, 0..15 or 0..31
  static CPUMOE_INLINE int code(const uint8_t* p, int j, int l) {
    const int n = (p[QS + 32 * (j / 2) + l] >> 4 * (j & 1)) & 15;
    return kFifth ? n | ((p[QH + l] >> j) & 1) << 4 : n;
  }

#if CPUMOE_TIER == CPUMOE_T_SCALAR
  static void scalar_i8(const uint8_t* p, const ActI8<256>& a, int b, float& acc) {
    uint64_t sc, m;
    scales_mins(p + 4, &sc, &m);
    const int8_t* qa = a.q + (size_t)b * QK;
    const int16_t* bs = a.bsum + (size_t)b * 16;
    int32_t S = 0, M = 0;
    for (int j = 0; j < 8; ++j) {
      int32_t s = 0;
      for (int l = 0; l < 32; ++l) s += code(p, j, l) * qa[32 * j + l];
      S += (int32_t)(sc >> 8 * j & 63) * s;
      M += (int32_t)(m >> 8 * j & 63) * (bs[2 * j] + bs[2 * j + 1]);
    }
    const float da = a.d[(size_t)b];
    acc += (float)S * (fp16_to_f32(ld16(p)) * da);
    acc += (float)M * -(fp16_to_f32(ld16(p + 2)) * da);
  }
  static void scalar_native(const uint8_t* p, const float* x, float& acc) {
    uint64_t sc, m;
    scales_mins(p + 4, &sc, &m);
    const float d = fp16_to_f32(ld16(p)), dmin = fp16_to_f32(ld16(p + 2));
    for (int j = 0; j < 8; ++j) {
      const float ds = d * (float)(sc >> 8 * j & 63), dm = dmin * (float)(m >> 8 * j & 63);
      for (int l = 0; l < 32; ++l) acc = std::fma(std::fma((float)code(p, j, l), ds, -dm), x[32 * j + l], acc);
    }
  }
#endif

#if CPUMOE_GGUF_I8_SIMD
  // runs 2C, 2C + 1 (qs[32C ..]) against NT tokens, into S (low nibbles) and S2 (high): the row's codes split once
  // for all NT tokens; two chains of vpdpwssd a block, not one of 8 (exact integers: the same sum either way)
  template <int C, int NT>
  static CPUMOE_INLINE void pair(const uint8_t* p, __m256i qh, __m256i scv, int b, const ActsI8<256, NT>& a,
                                 __m256i (&S)[NT], __m256i (&S2)[NT]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i raw = _mm256_loadu_si256((const __m256i*)(p + QS + 32 * C));
    __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    if constexpr (kFifth) lo = _mm256_or_si256(lo, fifth_bits<2 * C>(qh)), hi = _mm256_or_si256(hi, fifth_bits<2 * C + 1>(qh));
    const __m256i sa = bcast16(scv, 2 * C), sb = bcast16(scv, 2 * C + 1);
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) {
      const int8_t* q = a.q[t] + (size_t)b * QK + 64 * C;
      S[t] = madd_acc(S[t], _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)q)), sa);
      S2[t] = madd_acc(S2[t], _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(q + 32))), sb);
    }
  }
  template <int NT>
  static CPUMOE_INLINE void step_i8(const uint8_t* p, int b, const ActsI8<256, NT>& a, __m256 (&acc)[NT]) {
    const __m256i s16 = _mm256_cvtepu8_epi16(scales_mins_x(p + 4));                 // int16 sc[0..7], m[0..7]
    const __m256i scv = _mm256_permute2x128_si256(s16, s16, 0x00);                 // sc[0..7] in both lanes
    const __m256i mw = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(s16, 1));   // m[j] in int32 lane j
    const __m256i mins = _mm256_or_si256(mw, _mm256_slli_epi32(mw, 16));          // int16 lanes 2j, 2j+1
    const __m256i qh = kFifth ? _mm256_loadu_si256((const __m256i*)(p + QH)) : _mm256_setzero_si256();
    __m256i S[NT], S2[NT];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) S[t] = S2[t] = _mm256_setzero_si256();
    pair<0, NT>(p, qh, scv, b, a, S, S2);
    pair<1, NT>(p, qh, scv, b, a, S, S2);
    pair<2, NT>(p, qh, scv, b, a, S, S2);
    pair<3, NT>(p, qh, scv, b, a, S, S2);
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) S[t] = _mm256_add_epi32(S[t], S2[t]);
    const float d = _cvtsh_ss(ld16(p)), dmin = _cvtsh_ss(ld16(p + 2));
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) {
      const __m256i M = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(a.bs[t] + (size_t)b * 16)), mins);
      const float dd = a.d[t][b];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[t]), _mm256_set1_ps(d * dd), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(M), _mm256_set1_ps(-(dmin * dd)), acc[t]);
    }
  }
#endif

#if CPUMOE_GGUF_NATIVE_SIMD
  // the codes (bytes) of run j from its qs bytes and qh bytes (the same elements, byte for byte)
  static CPUMOE_INLINE __m128i codes_x(__m128i qs, const uint8_t* qhp, int j) {
    const __m128i n = _mm_and_si128(_mm_srli_epi16(qs, 4 * (j & 1)), _mm_set1_epi8(15));
    if constexpr (!kFifth) return n;
    const __m128i h = _mm_and_si128(_mm_srli_epi16(VecF::ld_bytes(qhp), j), _mm_set1_epi8(1));
    return _mm_or_si128(n, _mm_slli_epi16(h, 4));  // h is 0 / 1 per byte: the shift stays in its byte
  }
  template <class V, int NT>
  static CPUMOE_INLINE void block_native(const uint8_t* p, const float* const* x, typename V::F (&acc)[NT]) {
    uint64_t sc, m;
    scales_mins(p + 4, &sc, &m);
    const float d = _cvtsh_ss(ld16(p)), dmin = _cvtsh_ss(ld16(p + 2));
    for (int j = 0; j < 8; ++j) {
      const typename V::F ds = V::set1(d * (float)(sc >> 8 * j & 63)), ndm = V::set1(-(dmin * (float)(m >> 8 * j & 63)));
      const uint8_t* qs = p + QS + 32 * (j / 2);
      CPUMOE_UNROLL
      for (int i = 0; i < 32 / V::kW; ++i) {
        const typename V::F wv = V::fma(V::u8_to_f(codes_x(V::ld_bytes(qs + i * V::kW), p + QH + i * V::kW, j)), ds, ndm);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) acc[t] = V::fma(wv, V::ld(x[t] + 32 * j + i * V::kW), acc[t]);
      }
    }
  }
#endif
};

}  // namespace gguf
}  // namespace CPUMOE_NS
}  // namespace cpumoe
