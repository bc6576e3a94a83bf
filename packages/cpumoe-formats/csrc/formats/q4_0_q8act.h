// q4_0 mode w4a8: the activation prep (private to q4_0.cpp, included inside its tier namespace after QK,
// ld16 and the bf16 helpers). Kept apart from the row kernels: it is O(K) per vector and shared by every tier.
#pragma once

// ---------------------------------------------------------------------------------------------------------------
// w4a8 activation prep
// ---------------------------------------------------------------------------------------------------------------
// Layout of a prepared vector of length K (nb = K/32 blocks), see the file comment:
//   int8  q[K]        grouped by G (low halves of a full group's blocks, then their high halves)
//   float da[nb]      per-block activation scale
//   int32 corr[4*nb]  corr[4b+m] = -8 * sum_{i<4} (q_b[4m+i] + q_b[16+4m+i]): the "-8" of (nib - 8) for the
//                     int32 lane m of block b in the SIMD dots, which multiply the raw nibble (0..15)
//   int32 corr8[nb]   -8 * sum(q_b), the whole block's correction, in the lane order of the avx2 / avxvnni
//                     8-block step within each full group of 8 blocks (blocks 0 2 4 6 1 3 5 7), then of their
//                     4-block step (0 2 1 3) for a following group of 4; natural order after that
struct ActQ8 {
  const int8_t* q;
  const float* da;
  const int32_t* corr;
  const int32_t* corr8;
  CPUMOE_INLINE ActQ8(const void* act, int K)
      : q((const int8_t*)act), da((const float*)(q + K)), corr((const int32_t*)(da + K / QK)),
        corr8(corr + 4 * (K / QK)) {}
};
size_t act_bytes_q8(const cpumoe_kernel*, int32_t K) { return (size_t)K + (size_t)(K / QK) * 24; }

// Slot of block b in corr8 (see above).
CPUMOE_INLINE int corr8_slot(int b, int nb) {
  const int g = b & ~7, i = b & 7;
  if (g + 8 <= nb) return g + (i & 1) * 4 + i / 2;
  if (g + 4 <= nb && i < 4) return g + (i & 1) * 2 + i / 2;
  return b;
}

// Byte offsets of block b's low (elements 0..15) and high (16..31) halves in a layout grouped by G.
CPUMOE_INLINE void half_offsets(int b, int nb, int G, size_t* lo, size_t* hi) {
  const int g = b / G;
  if ((g + 1) * G <= nb) {
    *lo = (size_t)g * G * QK + (size_t)(b % G) * 16;
    *hi = *lo + (size_t)G * 16;
  } else {
    *lo = (size_t)b * QK;
    *hi = *lo + 16;
  }
}

// One block of bf16 x -> 32 int8 (lo = elements 0..15, hi = 16..31) and 4 lane corrections; returns d_a.
// Scalar and AVX2 versions give identical results: exact abs/max, one fp32 division each for d_a and 1/d_a,
// one fp32 multiply, round half to even, clamp.
CPUMOE_INLINE float quant_block_scalar(const uint16_t* src, int8_t* lo, int8_t* hi, int32_t* corr) {
  float x[QK];
  for (int j = 0; j < QK; ++j) x[j] = bf16_to_f32(src[j]);
  int8_t q[QK];
  const float d = q8_block(x, QK, q);  // the Q8_0 rule (common.h)
  for (int j = 0; j < 16; ++j) lo[j] = q[j], hi[j] = q[j + 16];
  for (int m = 0; m < 4; ++m) {
    int32_t s = 0;
    for (int i = 0; i < 4; ++i) s += q[4 * m + i] + q[16 + 4 * m + i];
    corr[m] = -8 * s;
  }
  return d;
}

#if defined(__AVX2__)
CPUMOE_INLINE float quant_block_avx2(const uint16_t* src, int8_t* lo, int8_t* hi, int32_t* corr) {
  const __m256 x[4] = {bf16x8_f32(src), bf16x8_f32(src + 8), bf16x8_f32(src + 16), bf16x8_f32(src + 24)};
  float d;
  const __m256i v = q8_block32(x, &d);  // common.h: the scalar path's q8_block, bit for bit
  _mm_storeu_si128((__m128i*)lo, _mm256_castsi256_si128(v));
  _mm_storeu_si128((__m128i*)hi, _mm256_extracti128_si256(v, 1));
  const __m256i s4 = sum4_i8(v);
  const __m128i c = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
  _mm_storeu_si128((__m128i*)corr, _mm_mullo_epi32(c, _mm_set1_epi32(-8)));
  return d;
}
#endif

template <int G>
void prep_act_q8(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  int8_t* q = (int8_t*)dst;
  float* da = (float*)(q + K);
  const int nb = K / QK;
  int32_t* corr = (int32_t*)(da + nb);
  int32_t* corr8 = corr + 4 * nb;
  for (int b = 0; b < nb; ++b) {
    size_t lo, hi;
    half_offsets(b, nb, G, &lo, &hi);
#if defined(__AVX2__)
    da[b] = quant_block_avx2(src + (size_t)b * QK, q + lo, q + hi, corr + 4 * b);
#else
    da[b] = quant_block_scalar(src + (size_t)b * QK, q + lo, q + hi, corr + 4 * b);
#endif
    const int32_t* c = corr + 4 * b;
    corr8[corr8_slot(b, nb)] = (c[0] + c[1]) + (c[2] + c[3]);
  }
}

// The prepared vectors of NT tokens, unpacked once per multi-token row call (every SIMD tier's RowsW4A8).
template <int NT>
struct ActsQ8 {
  const int8_t* q[NT];
  const float* da[NT];
  const int32_t* corr[NT];
  const int32_t* corr8[NT];
  CPUMOE_INLINE ActsQ8(const void* const* act, int K) {
    Q4_UNROLL
    for (int t = 0; t < NT; ++t) {
      const ActQ8 a(act[t], K);
      q[t] = a.q, da[t] = a.da, corr[t] = a.corr, corr8[t] = a.corr8;
    }
  }
};
