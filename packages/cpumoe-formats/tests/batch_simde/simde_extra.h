// SIMDe 0.7 gaps for the bf16 / fp8_block AVX-512 tiers (after tests/fp4_simde/simde_pre.h): mask types and the
// masked loads, which must not touch masked-off bytes (they can lie past the end of a row).
#pragma once
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../fp4_simde/simde_pre.h"
typedef simde__mmask16 __mmask16;
typedef simde__mmask32 __mmask32;
typedef simde__mmask64 __mmask64;
static inline simde__m512i bk_maskz_loadu_epi16(uint32_t m, const void* p) {
  uint16_t v[32] = {0};
  for (int i = 0; i < 32; ++i)
    if (m >> i & 1) memcpy(&v[i], (const char*)p + 2 * i, 2);
  return simde_mm512_loadu_si512(v);
}
static inline simde__m512i bk_maskz_loadu_epi8(uint64_t m, const void* p) {
  uint8_t v[64] = {0};
  for (int i = 0; i < 64; ++i)
    if (m >> i & 1) v[i] = ((const uint8_t*)p)[i];
  return simde_mm512_loadu_si512(v);
}
static inline simde__m256i bk_maskz_loadu_epi8_256(uint32_t m, const void* p) {
  uint8_t v[32] = {0};
  for (int i = 0; i < 32; ++i)
    if (m >> i & 1) v[i] = ((const uint8_t*)p)[i];
  return simde_mm256_loadu_si256(v);
}
static inline simde__m512i bk_cvtepu8_epi16(simde__m256i a) { return lanes_cvt<uint8_t, uint16_t, 32, simde__m512i>(a); }
static inline uint32_t bk_testn_epi16_mask(simde__m512i a, simde__m512i b) {
  uint16_t x[32], y[32];
  simde_mm512_storeu_si512(x, a);
  simde_mm512_storeu_si512(y, b);
  uint32_t m = 0;
  for (int i = 0; i < 32; ++i) m |= (uint32_t)((x[i] & y[i]) == 0) << i;
  return m;
}
#undef _mm512_testn_epi16_mask
#define _mm512_testn_epi16_mask(a, b) bk_testn_epi16_mask((a), (b))
static inline simde__m512i bk_cvtepu8_epi32(simde__m128i a) { return lanes_cvt<uint8_t, uint32_t, 16, simde__m512i>(a); }
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32(a) bk_cvtepu8_epi32(a)
#undef _mm512_maskz_loadu_epi16
#undef _mm512_maskz_loadu_epi8
#undef _mm256_maskz_loadu_epi8
#undef _mm512_cvtepu8_epi16
#define _mm512_maskz_loadu_epi16(m, p) bk_maskz_loadu_epi16((m), (p))
#define _mm512_maskz_loadu_epi8(m, p) bk_maskz_loadu_epi8((m), (p))
#define _mm256_maskz_loadu_epi8(m, p) bk_maskz_loadu_epi8_256((m), (p))
#define _mm512_cvtepu8_epi16(a) bk_cvtepu8_epi16(a)
// bf16's small-I down rows (Dot::rows_acc): a masked fp32 load, a masked 16 x 16-bit load, the 128-bit-lane shuffle.
static inline simde__m512 bk_maskz_loadu_ps(uint32_t m, const void* p) {
  float v[16] = {0};
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) memcpy(&v[i], (const char*)p + 4 * i, 4);
  return simde_mm512_loadu_ps(v);
}
static inline simde__m256i bk_maskz_loadu_epi16_256(uint32_t m, const void* p) {
  uint16_t v[16] = {0};
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) memcpy(&v[i], (const char*)p + 2 * i, 2);
  return simde_mm256_loadu_si256(v);
}
static inline simde__m512 bk_shuffle_f32x4(simde__m512 a, simde__m512 b, int imm) {
  float x[16], y[16], r[16];
  simde_mm512_storeu_ps(x, a);
  simde_mm512_storeu_ps(y, b);
  for (int q = 0; q < 4; ++q) memcpy(&r[4 * q], (q < 2 ? x : y) + 4 * (imm >> (2 * q) & 3), 16);
  return simde_mm512_loadu_ps(r);
}
#undef _mm512_maskz_loadu_ps
#undef _mm256_maskz_loadu_epi16
#undef _mm512_shuffle_f32x4
#define _mm512_maskz_loadu_ps(m, p) bk_maskz_loadu_ps((m), (p))
#define _mm256_maskz_loadu_epi16(m, p) bk_maskz_loadu_epi16_256((m), (p))
#define _mm512_shuffle_f32x4(a, b, imm) bk_shuffle_f32x4((a), (b), (imm))
// q4_0's amx tier (gathered B rows): the 16-dword gather (scale 1 only) and the truncating dword -> word narrowing.
static inline simde__m512i bk_i32gather_epi32(simde__m512i idx, const void* base, int scale) {
  int32_t o[16], v[16];
  simde_mm512_storeu_si512(o, idx);
  for (int i = 0; i < 16; ++i) memcpy(&v[i], (const char*)base + (ptrdiff_t)o[i] * scale, 4);
  return simde_mm512_loadu_si512(v);
}
static inline simde__m256i bk_cvtepi32_epi16(simde__m512i a) { return lanes_cvt<uint32_t, uint16_t, 16, simde__m256i>(a); }
#undef _mm512_i32gather_epi32
#undef _mm512_cvtepi32_epi16
#define _mm512_i32gather_epi32(idx, base, scale) bk_i32gather_epi32((idx), (base), (scale))
#define _mm512_cvtepi32_epi16(a) bk_cvtepi32_epi16(a)
