// q4_0 mode native (W4A16): the avx2 and avx512f rows (private to q4_0.cpp, included inside its tier namespace
// after QK, ld16 and the bf16 helpers). Per block d * sum((nib - 8) * x) in fp32, x prepared as fp32. One loop
// (RowsNative) over the tier's vector ops (Nat): blocks in 8-block steps whose scales are widened once, even
// blocks of a step (and the tail blocks) into acc[r][0], odd ones into acc[r][1].
#pragma once

#if CPUMOE_TIER == CPUMOE_T_AVX2
struct Nat {
  using F = __m256;
  struct X { __m256 v[4]; };  // a block's 32 activations
  static CPUMOE_INLINE X load_x(const float* xb) {
    return {{_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8), _mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)}};
  }
  // One block's sum((nib - 8) * x) as 8 fp32 lanes. Bytes 0..7 of qs give elements 0..7 (low nibbles) and
  // 16..23 (high), bytes 8..15 give 8..15 and 24..31.
  static CPUMOE_INLINE F block(const uint8_t* p, const X& x) {
    const __m256i m = _mm256_set1_epi32(0xF), k8 = _mm256_set1_epi32(8);
    const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 2)));
    const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 10)));
    auto f = [&](__m256i v) { return _mm256_cvtepi32_ps(_mm256_sub_epi32(v, k8)); };
    __m256 s = _mm256_mul_ps(f(_mm256_and_si256(v0, m)), x.v[0]);
    __m256 t = _mm256_mul_ps(f(_mm256_srli_epi32(v0, 4)), x.v[2]);
    s = _mm256_fmadd_ps(f(_mm256_and_si256(v1, m)), x.v[1], s);
    t = _mm256_fmadd_ps(f(_mm256_srli_epi32(v1, 4)), x.v[3], t);
    return _mm256_add_ps(s, t);
  }
  static CPUMOE_INLINE F d8(const uint8_t* p) { return d8_f32(p); }  // the 8 block scales of a step
  static CPUMOE_INLINE F pick(F d8, int j) { return _mm256_permutevar8x32_ps(d8, _mm256_set1_epi32(j)); }
  static CPUMOE_INLINE F set1(float v) { return _mm256_set1_ps(v); }
  static CPUMOE_INLINE F zero() { return _mm256_setzero_ps(); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE float hsum2(F a, F b) { return hsum256(_mm256_add_ps(a, b)); }
};
#elif CPUMOE_TIER == CPUMOE_T_AVX512F
struct Nat {
  using F = __m512;
  struct X { __m512 lo, hi; };
  static CPUMOE_INLINE X load_x(const float* xb) { return {_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)}; }
  // The 16 qs bytes as int32 lanes; low nibbles are elements 0..15, high nibbles 16..31. vpermps reads the low
  // 4 bits of each index, so a 16-entry table of (n - 8) as fp32 turns a nibble into its exact weight factor in
  // one instruction (no mask for the low nibble, one shift for the high one).
  static CPUMOE_INLINE F block(const uint8_t* p, const X& x) {
    const __m512 tbl = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 2)));
    const __m512 lo = _mm512_permutexvar_ps(v, tbl);
    const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl);
    return _mm512_fmadd_ps(hi, x.hi, _mm512_mul_ps(lo, x.lo));
  }
  static CPUMOE_INLINE F d8(const uint8_t* p) { return _mm512_castps256_ps512(d8_f32(p)); }  // pick reads 0..7
  static CPUMOE_INLINE F pick(F d8, int j) { return _mm512_permutexvar_ps(_mm512_set1_epi32(j), d8); }
  static CPUMOE_INLINE F set1(float v) { return _mm512_set1_ps(v); }
  static CPUMOE_INLINE F zero() { return _mm512_setzero_ps(); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE float hsum2(F a, F b) { return hsum512(_mm512_add_ps(a, b)); }
};
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F
struct RowsNative {
  template <int R>
  static void dot(const uint8_t* const* w, int K, const void* act, float* out) {
    using F = Nat::F;
    const float* x = (const float*)act;
    const int nb = K / QK;
    F acc[R][2];
    Q4_UNROLL
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Nat::zero();
    int b = 0;
    for (; b + 8 <= nb; b += 8) {
      F d8[R];
      Q4_UNROLL
      for (int r = 0; r < R; ++r) prefetch_ahead(w[r] + (size_t)b * QB), d8[r] = Nat::d8(w[r] + (size_t)b * QB);
      Q4_UNROLL
      for (int j = 0; j < 8; ++j) {
        const Nat::X xv = Nat::load_x(x + (size_t)(b + j) * QK);
        Q4_UNROLL
        for (int r = 0; r < R; ++r)
          acc[r][j & 1] = Nat::fma(Nat::block(w[r] + (size_t)(b + j) * QB, xv), Nat::pick(d8[r], j), acc[r][j & 1]);
      }
    }
    for (; b < nb; ++b) {
      const Nat::X xv = Nat::load_x(x + (size_t)b * QK);
      Q4_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        prefetch_ahead(p, 1);
        acc[r][0] = Nat::fma(Nat::block(p, xv), Nat::set1(d1_f32(p)), acc[r][0]);
      }
    }
    Q4_UNROLL
    for (int r = 0; r < R; ++r) out[r] = Nat::hsum2(acc[r][0], acc[r][1]);
  }
};
#endif
