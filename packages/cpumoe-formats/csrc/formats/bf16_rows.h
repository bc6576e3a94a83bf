// The row-major bf16 dot of every SIMD tier (Lanes: one tier's vector; dot_rt: R rows x NT tokens in one pass),
// shared by the bf16 expert kernels (bf16.cpp) and the dense bf16 linear (linear_bf16.cpp). A file includes it once
// per tier build, after rowmajor.h; CPUMOE_BF16_PF / CPUMOE_BF16_PF_LOC may be defined first (per file).
#pragma once
#include "../rowmajor.h"

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 flags the AVX-512 intrinsics' internal _mm512_undefined_* operands as (maybe-)uninitialized (a known
// false positive of the headers, as in fp8_block.cpp and fp4_common.h).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

// Software prefetch: CPUMOE_BF16_PF elements (2 bytes each) ahead of every row's read position, with
// locality CPUMOE_BF16_PF_LOC (0 = prefetchnta ... 3 = prefetcht0); 0 elements: none.
// avx2: 256 (it helps the avx2 rows on Zen 3). AVX-512 tiers: none (Zen 4, one thread: 80-81% of the read ceiling
// without, 63-69% at 256 ahead). Intel hosts with AVX-512 run bf16 on their amx tier.
#ifndef CPUMOE_BF16_PF
#if CPUMOE_TIER == CPUMOE_T_AVX2
#define CPUMOE_BF16_PF 256
#else
#define CPUMOE_BF16_PF 0
#endif
#endif
#ifndef CPUMOE_BF16_PF_LOC
#define CPUMOE_BF16_PF_LOC 0
#endif
#if CPUMOE_BF16_PF > 0
#define BF16_PREFETCH(p) __builtin_prefetch((const void*)((p) + CPUMOE_BF16_PF), 0, CPUMOE_BF16_PF_LOC)
#else
#define BF16_PREFETCH(p) ((void)0)
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace {  // internal linkage: each file's CPUMOE_BF16_PF is its own

#if CPUMOE_TIER != CPUMOE_T_SCALAR
// One tier's vector: L bf16 weights widened (or fed to vdpbf16ps as they are) against L activation values.
// XT: the prepared activation's element (fp32, or bf16 for vdpbf16ps). kMasked: the tail runs as masked
// vectors (zero lanes add nothing), else as whole vectors then scalars.
struct Lanes {
#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI  // (the int8 tiers have no bf16 kernel)
  using A = __m256; using W = __m256; using X = __m256; using XT = float;
  static constexpr int L = 8;
  static constexpr bool kMasked = false;
  static A zero() { return _mm256_setzero_ps(); }
  static W w(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  static X x(const float* p) { return _mm256_loadu_ps(p); }
  static A fma(A a, W w, X x) { return _mm256_fmadd_ps(w, x, a); }
  static A add(A a, A b) { return _mm256_add_ps(a, b); }
  static float hsum(A a) { return hsum256(a); }
#elif CPUMOE_TIER == CPUMOE_T_AVX512BF16 || CPUMOE_TIER == CPUMOE_T_AMX
  using A = __m512; using W = __m512bh; using X = __m512bh; using XT = uint16_t;
  static constexpr int L = 32;
  static constexpr bool kMasked = true;
  static A zero() { return _mm512_setzero_ps(); }
  static W w(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static X x(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static W wm(__mmask32 m, const uint16_t* p) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }
  static X xm(__mmask32 m, const uint16_t* p) { return (__m512bh)_mm512_maskz_loadu_epi16(m, p); }
  static A fma(A a, W w, X x) { return _mm512_dpbf16_ps(a, w, x); }
  static A add(A a, A b) { return _mm512_add_ps(a, b); }
  static float hsum(A a) { return hsum512(a); }
#else  // avx512f, avx512vnni
  using A = __m512; using W = __m512; using X = __m512; using XT = float;
  static constexpr int L = 16;
  static constexpr bool kMasked = false;
  static A zero() { return _mm512_setzero_ps(); }
  static W w(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  static X x(const float* p) { return _mm512_loadu_ps(p); }
  static A fma(A a, W w, X x) { return _mm512_fmadd_ps(w, x, a); }
  static A add(A a, A b) { return _mm512_add_ps(a, b); }
  static float hsum(A a) { return hsum512(a); }
#endif
};

// out[r * NT + t] = dot(row w[r], token x[t]) for R rows and NT tokens in one pass: R weight streams in flight, each
// vector decoded once for the NT tokens. Every (row, token) pair has 4 chains (chunk vector c -> chain c, the tail
// vectors -> chain 0), reduced as (a0 + a1) + (a2 + a3), then the scalar tail in order: a pair's arithmetic is the
// same whatever R, NT and its neighbours, so a token's output never depends on its batch or on how rows are grouped.
// Each row's cache lines are prefetched CPUMOE_BF16_PF elements ahead (locality CPUMOE_BF16_PF_LOC).
// Registers: R * NT * 4 accumulators; R * NT <= 3 (avx2, 16 ymm) or 4 (avx-512, 32 zmm), R = 4 with NT = 1 on avx2
// spills a little and was still the fastest lone-token gate_up on Zen 3.
template <int R, int NT, class V = Lanes>  // V a parameter so that `if constexpr` discards the other tail
CPUMOE_INLINE void dot_rt(const uint16_t* const* w, int K, const typename V::XT* const* x, float* out) {
  constexpr int L = V::L;
  typename V::A a[R][NT][4];
  CPUMOE_UNROLL
  for (int r = 0; r < R; ++r)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) a[r][t][0] = a[r][t][1] = a[r][t][2] = a[r][t][3] = V::zero();
  int i = 0;
  for (; i + 4 * L <= K; i += 4 * L) {
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r)
      CPUMOE_UNROLL
      for (int o = 0; o < 4 * L; o += 32) BF16_PREFETCH(w[r] + i + o);  // one per 64-byte line
    CPUMOE_UNROLL
    for (int c = 0; c < 4; ++c) {
      typename V::X xv[NT];
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) xv[t] = V::x(x[t] + i + L * c);
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) {
        const typename V::W wv = V::w(w[r] + i + L * c);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) a[r][t][c] = V::fma(a[r][t][c], wv, xv[t]);
      }
    }
  }
  if constexpr (V::kMasked) {
    for (; i < K; i += L) {
      const __mmask32 m = K - i >= L ? 0xFFFFFFFFu : ((1u << (K - i)) - 1u);
      typename V::X xv[NT];
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) xv[t] = V::xm(m, x[t] + i);
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) {
        const typename V::W wv = V::wm(m, w[r] + i);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) a[r][t][0] = V::fma(a[r][t][0], wv, xv[t]);
      }
    }
  } else {
    for (; i + L <= K; i += L) {
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) {
        const typename V::W wv = V::w(w[r] + i);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) a[r][t][0] = V::fma(a[r][t][0], wv, V::x(x[t] + i));
      }
    }
  }
  float s[R][NT];
  CPUMOE_UNROLL
  for (int r = 0; r < R; ++r)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      s[r][t] = V::hsum(V::add(V::add(a[r][t][0], a[r][t][1]), V::add(a[r][t][2], a[r][t][3])));
  if constexpr (!V::kMasked) {
    for (; i < K; ++i)
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) {
        const float wf = bf16_to_f32(w[r][i]);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) s[r][t] += wf * (float)x[t][i];
      }
  }
  CPUMOE_UNROLL
  for (int r = 0; r < R; ++r)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) out[r * NT + t] = s[r][t];
}
#endif


}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe
