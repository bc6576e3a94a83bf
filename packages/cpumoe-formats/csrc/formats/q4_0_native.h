// q4_0 mode native (W4A16): the avx2 and avx512f rows (private to q4_0.cpp, included inside its tier namespace
// after QK, ld16 and the bf16 helpers). Per block d * sum((nib - 8) * x) in fp32, x prepared as fp32.
#pragma once

#if CPUMOE_TIER == CPUMOE_T_AVX2
// native: one block's sum((nib - 8) * x) as 8 fp32 lanes. Bytes 0..7 of qs give elements 0..7 (low nibbles) and
// 16..23 (high), bytes 8..15 give 8..15 and 24..31. x[0..31] is the block's activation, already in registers.
CPUMOE_INLINE __m256 native_block(const uint8_t* p, const __m256* x) {
  const __m256i m = _mm256_set1_epi32(0xF), k8 = _mm256_set1_epi32(8);
  const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 2)));
  const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 10)));
  auto f = [&](__m256i v) { return _mm256_cvtepi32_ps(_mm256_sub_epi32(v, k8)); };
  __m256 s = _mm256_mul_ps(f(_mm256_and_si256(v0, m)), x[0]);
  __m256 t = _mm256_mul_ps(f(_mm256_srli_epi32(v0, 4)), x[2]);
  s = _mm256_fmadd_ps(f(_mm256_and_si256(v1, m)), x[1], s);
  t = _mm256_fmadd_ps(f(_mm256_srli_epi32(v1, 4)), x[3], t);
  return _mm256_add_ps(s, t);
}
// Per row two accumulators: even blocks of an 8-block step (and the tail blocks) to acc[r][0], odd to acc[r][1].
struct RowsNative {
  template <int R>
  static void dot(const uint8_t* const* w, int K, const void* act, float* out) {
    const float* x = (const float*)act;
    const int nb = K / QK;
    __m256 acc[R][2];
    Q4_UNROLL
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int b = 0;
    for (; b + 8 <= nb; b += 8) {
      __m256 d8[R];
      Q4_UNROLL
      for (int r = 0; r < R; ++r) prefetch_ahead(w[r] + (size_t)b * QB), d8[r] = d8_f32(w[r] + (size_t)b * QB);
      Q4_UNROLL
      for (int j = 0; j < 8; ++j) {
        const float* xb = x + (size_t)(b + j) * QK;
        const __m256 xv[4] = {_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16),
                              _mm256_loadu_ps(xb + 24)};
        const __m256i idx = _mm256_set1_epi32(j);
        Q4_UNROLL
        for (int r = 0; r < R; ++r)
          acc[r][j & 1] = _mm256_fmadd_ps(native_block(w[r] + (size_t)(b + j) * QB, xv),
                                          _mm256_permutevar8x32_ps(d8[r], idx), acc[r][j & 1]);
      }
    }
    for (; b < nb; ++b) {
      const float* xb = x + (size_t)b * QK;
      const __m256 xv[4] = {_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16),
                            _mm256_loadu_ps(xb + 24)};
      Q4_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        prefetch_ahead(p, 1);
        acc[r][0] = _mm256_fmadd_ps(native_block(p, xv), _mm256_set1_ps(d1_f32(p)), acc[r][0]);
      }
    }
    Q4_UNROLL
    for (int r = 0; r < R; ++r) out[r] = hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
  }
};
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX512F
// native: the 16 qs bytes as int32 lanes; low nibbles are elements 0..15, high nibbles 16..31. vpermps reads the
// low 4 bits of each index, so a 16-entry table of (n - 8) as fp32 turns a nibble into its exact weight factor in
// one instruction (no mask for the low nibble, one shift for the high one).
CPUMOE_INLINE __m512 native_block(const uint8_t* p, __m512 xlo, __m512 xhi, __m512 tbl) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 2)));
  const __m512 lo = _mm512_permutexvar_ps(v, tbl);
  const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl);
  return _mm512_fmadd_ps(hi, xhi, _mm512_mul_ps(lo, xlo));
}
struct RowsNative {
  template <int R>
  static void dot(const uint8_t* const* w, int K, const void* act, float* out) {
    const float* x = (const float*)act;
    const int nb = K / QK;
    __m512 acc[R][2];
    Q4_UNROLL
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m512 tbl = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    int b = 0;
    for (; b + 8 <= nb; b += 8) {
      __m512 d8[R];
      Q4_UNROLL
      for (int r = 0; r < R; ++r)  // permutes read lanes 0..7
        prefetch_ahead(w[r] + (size_t)b * QB), d8[r] = _mm512_castps256_ps512(d8_f32(w[r] + (size_t)b * QB));
      Q4_UNROLL
      for (int j = 0; j < 8; ++j) {
        const float* xb = x + (size_t)(b + j) * QK;
        const __m512 xlo = _mm512_loadu_ps(xb), xhi = _mm512_loadu_ps(xb + 16);
        const __m512i idx = _mm512_set1_epi32(j);
        Q4_UNROLL
        for (int r = 0; r < R; ++r)
          acc[r][j & 1] = _mm512_fmadd_ps(native_block(w[r] + (size_t)(b + j) * QB, xlo, xhi, tbl),
                                          _mm512_permutexvar_ps(idx, d8[r]), acc[r][j & 1]);
      }
    }
    for (; b < nb; ++b) {
      const float* xb = x + (size_t)b * QK;
      const __m512 xlo = _mm512_loadu_ps(xb), xhi = _mm512_loadu_ps(xb + 16);
      Q4_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        prefetch_ahead(p, 1);
        acc[r][0] = _mm512_fmadd_ps(native_block(p, xlo, xhi, tbl), _mm512_set1_ps(d1_f32(p)), acc[r][0]);
      }
    }
    Q4_UNROLL
    for (int r = 0; r < R; ++r) out[r] = hsum512(_mm512_add_ps(acc[r][0], acc[r][1]));
  }
};
#endif
