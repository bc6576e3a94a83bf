// The vector of the GGUF "_x16" native kernels (q6_k_x16_native.h, q5_k_x16_native.h): avx512f a zmm of the 16 rows
// of a group, avx2 a ymm of rows 8 hr .. 8 hr + 7 (their bytes at +32 hr of a 64-byte vector, their fp16 d at
// +16 hr, their bytes of a 16-byte plane at +8 hr). Other tiers: empty (scalar code).
#pragma once
#include "../x16.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace x16 {

struct NativeVec {
#if CPUMOE_TIER == CPUMOE_T_AVX512F
  using VI = __m512i;
  using VF = __m512;
  static constexpr int kRows = 16;
  static CPUMOE_INLINE VI ld(const uint8_t* p, int) { return _mm512_loadu_si512(p); }
  static CPUMOE_INLINE VI b8(int v) { return _mm512_set1_epi8((char)v); }
  static CPUMOE_INLINE VI b32(int v) { return _mm512_set1_epi32(v); }
  static CPUMOE_INLINE VI and_(VI a, VI b) { return _mm512_and_si512(a, b); }
  static CPUMOE_INLINE VI or_(VI a, VI b) { return _mm512_or_si512(a, b); }
  template <int N> static CPUMOE_INLINE VI sll16(VI a) { return _mm512_slli_epi16(a, N); }
  template <int N> static CPUMOE_INLINE VI srl16(VI a) { return _mm512_srli_epi16(a, N); }
  template <int N> static CPUMOE_INLINE VI sll32(VI a) { return _mm512_slli_epi32(a, N); }
  template <int N> static CPUMOE_INLINE VI srl32(VI a) { return _mm512_srli_epi32(a, N); }
  template <int N> static CPUMOE_INLINE VI sra32(VI a) { return _mm512_srai_epi32(a, N); }
  static CPUMOE_INLINE VI sub8(VI a, VI b) { return _mm512_sub_epi8(a, b); }
  static CPUMOE_INLINE VF cvt(VI a) { return _mm512_cvtepi32_ps(a); }
  static CPUMOE_INLINE VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
  static CPUMOE_INLINE VF neg(VF a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a),
                                                                                  _mm512_set1_epi32((int)0x80000000u))); }
  static CPUMOE_INLINE VF set1(float v) { return _mm512_set1_ps(v); }
  static CPUMOE_INLINE VF zero() { return _mm512_setzero_ps(); }
  static CPUMOE_INLINE VF d_of(const uint8_t* p, int) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static CPUMOE_INLINE VF sc_of(const uint8_t* plane, int) {  // int8 bytes
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)plane)));
  }
  static CPUMOE_INLINE VF uc_of(const uint8_t* plane, int) {  // uint8 bytes
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)plane)));
  }
  static CPUMOE_INLINE void st(float* o, VF v) { _mm512_storeu_ps(o, v); }
#elif CPUMOE_TIER == CPUMOE_T_AVX2
  using VI = __m256i;
  using VF = __m256;
  static constexpr int kRows = 8;
  static CPUMOE_INLINE VI ld(const uint8_t* p, int hr) { return _mm256_loadu_si256((const __m256i*)(p + 32 * hr)); }
  static CPUMOE_INLINE VI b8(int v) { return _mm256_set1_epi8((char)v); }
  static CPUMOE_INLINE VI b32(int v) { return _mm256_set1_epi32(v); }
  static CPUMOE_INLINE VI and_(VI a, VI b) { return _mm256_and_si256(a, b); }
  static CPUMOE_INLINE VI or_(VI a, VI b) { return _mm256_or_si256(a, b); }
  template <int N> static CPUMOE_INLINE VI sll16(VI a) { return _mm256_slli_epi16(a, N); }
  template <int N> static CPUMOE_INLINE VI srl16(VI a) { return _mm256_srli_epi16(a, N); }
  template <int N> static CPUMOE_INLINE VI sll32(VI a) { return _mm256_slli_epi32(a, N); }
  template <int N> static CPUMOE_INLINE VI srl32(VI a) { return _mm256_srli_epi32(a, N); }
  template <int N> static CPUMOE_INLINE VI sra32(VI a) { return _mm256_srai_epi32(a, N); }
  static CPUMOE_INLINE VI sub8(VI a, VI b) { return _mm256_sub_epi8(a, b); }
  static CPUMOE_INLINE VF cvt(VI a) { return _mm256_cvtepi32_ps(a); }
  static CPUMOE_INLINE VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
  static CPUMOE_INLINE VF neg(VF a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static CPUMOE_INLINE VF set1(float v) { return _mm256_set1_ps(v); }
  static CPUMOE_INLINE VF zero() { return _mm256_setzero_ps(); }
  static CPUMOE_INLINE VF d_of(const uint8_t* p, int hr) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * hr)));
  }
  static CPUMOE_INLINE VF sc_of(const uint8_t* plane, int hr) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(plane + 8 * hr))));
  }
  static CPUMOE_INLINE VF uc_of(const uint8_t* plane, int hr) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(plane + 8 * hr))));
  }
  static CPUMOE_INLINE void st(float* o, VF v) { _mm256_storeu_ps(o, v); }
#endif
};

}  // namespace x16
}  // namespace CPUMOE_NS
}  // namespace cpumoe
