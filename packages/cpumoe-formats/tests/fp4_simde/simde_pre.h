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
