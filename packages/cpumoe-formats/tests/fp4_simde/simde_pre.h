// Emulates AVX2/AVX-512 intrinsics with SIMDe (portable code) so the fp4 AVX-512 / VNNI tiers run on any
// x86-64 CPU. Force-included (-include) when compiling a format file for such a tier; see run.sh.
#pragma once
#define SIMDE_NO_NATIVE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>
#define _IMMINTRIN_H_INCLUDED
#define _X86INTRIN_H_INCLUDED
static inline float _mm512_reduce_add_ps(simde__m512 v) {
  float t[16];
  simde_mm512_storeu_ps(t, v);
  float s = 0;
  for (int i = 0; i < 16; ++i) s += t[i];
  return s;
}
#define _mm256_dpbusd_avx_epi32(a, b, c) simde_mm256_dpbusd_epi32(a, b, c)
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#if SIMD_AVX512
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512DQ__ 1
#define __AVX512VL__ 1
#endif
static inline float _cvtsh_ss(unsigned short h) { return simde_mm_cvtss_f32(simde_mm_cvtph_ps(simde_mm_cvtsi32_si128(h))); }
// Lane-wise conversion of the first N From lanes of v to To (C conversion: zero / sign extension, truncation,
// int -> float), through plain arrays: every SIMDe conversion gap the checks fill has this shape.
#include <math.h>
#include <stdlib.h>
#include <string.h>
template <class From, class To, int N, class Out, class In>
static inline Out lanes_cvt(In v) {
  static_assert(sizeof(In) >= N * sizeof(From) && sizeof(Out) == N * sizeof(To), "lane counts");
  From a[N];
  To b[N];
  Out o;
  memcpy(a, &v, sizeof a);
  for (int i = 0; i < N; ++i) b[i] = (To)a[i];
  memcpy(&o, b, sizeof o);
  return o;
}
// SIMDe 0.7.4 gaps: its _mm512_madd_epi16 alias takes 4 arguments, and it has no _mm512_cvtepi32_ps.
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
static inline simde__m512 _mm512_cvtepi32_ps(simde__m512i a) { return lanes_cvt<int32_t, float, 16, simde__m512>(a); }
// ... nor _mm512_cvtph_ps (nvfp4 avx512vnni w4a8 decodes 16 e4m3 scales at once): exact, through the 128-bit F16C
// emulation (batch_simde/simde_extra.h, which includes this file, uses it too).
static inline simde__m512 fp4_cvtph_ps(simde__m256i a) {
  return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(simde_mm256_cvtph_ps(simde_mm256_castsi256_si128(a))),
                                 simde_mm256_cvtph_ps(simde_mm256_extracti128_si256(a, 1)), 1);
}
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps(a) fp4_cvtph_ps(a)
// ... nor _mm512_cvtepu16_epi32 and the _MM_FROUND_ names (common.h, fp4_common.h)
static inline simde__m512i fp4_cvtepu16_epi32(simde__m256i a) { return lanes_cvt<uint16_t, uint32_t, 16, simde__m512i>(a); }
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(a) fp4_cvtepu16_epi32(a)
#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#define _MM_FROUND_TO_NEAREST_INT SIMDE_MM_FROUND_TO_NEAREST_INT
#endif
// SIMDe 0.7's round-to-nearest rounds halves away from zero; the hardware (and the Q8_0 quantizers: q4_0, mxfp4's w4a8) rounds to even.
static inline simde__m256 fp4_round_ps(simde__m256 a, int mode) {
  if ((mode & 3) != 0) abort();  // only round-to-nearest is used by the kernels
  float v[8];
  simde_mm256_storeu_ps(v, a);
  for (int i = 0; i < 8; ++i) v[i] = nearbyintf(v[i]);
  return simde_mm256_loadu_ps(v);
}
#undef _mm256_round_ps
#define _mm256_round_ps(a, mode) fp4_round_ps((a), (mode))
// ... nor these four (nvfp4's AVX-512 quant16, fp4_common.h): lane by lane. quant16 passes reduce_max no NaN lanes
// (any order gives the same max) and cvtps_epi32 integers in [-127, 127] (any rounding mode gives the same int).
static inline float _mm512_reduce_max_ps(simde__m512 v) {
  float t[16];
  simde_mm512_storeu_ps(t, v);
  float m = t[0];
  for (int i = 1; i < 16; ++i) m = t[i] > m ? t[i] : m;
  return m;
}
static inline simde__m512i _mm512_cvtps_epi32(simde__m512 v) {
  float t[16];
  int32_t o[16];
  simde_mm512_storeu_ps(t, v);
  for (int i = 0; i < 16; ++i) o[i] = (int32_t)nearbyintf(t[i]);
  return simde_mm512_loadu_si512(o);
}
static inline simde__m128i _mm512_cvtepi32_epi8(simde__m512i v) {  // vpmovdb: the low byte of each lane
  uint32_t t[16];
  uint8_t o[16];
  simde_mm512_storeu_si512(t, v);
  for (int i = 0; i < 16; ++i) o[i] = (uint8_t)t[i];
  return simde_mm_loadu_si128(o);
}
static inline int32_t _mm512_reduce_add_epi32(simde__m512i v) {  // wrapping, as the instruction sequence
  uint32_t t[16], s = 0;
  simde_mm512_storeu_si512(t, v);
  for (int i = 0; i < 16; ++i) s += t[i];
  return (int32_t)s;
}
