// One kernel skeleton for the row-major GGUF block formats (q8_0, q4_k, q5_k, q6_k): the row loops, block loops,
// prefetch, accumulators, reductions and tier dispatch of both modes; a format supplies only its block traits:
//
//   struct Block {
//     static constexpr int QK, QB;        // elements and bytes of a block
//     static constexpr int kActQB;        // w4a8 activation block: 256 (q8_K, with int16 sums of 16) or 32 (Q8_0)
//     static constexpr int kStep;         // w4a8 SIMD: blocks per step (q8_0: 4, their 4 fp16 d in one vcvtph2ps)
//     static constexpr int kPfLines;      // w4a8 SIMD: lines prefetched kPf ahead per step
//     static constexpr int kPfNativeEvery, kPfNativeLines;  // native SIMD: every this many blocks, this many lines
//     // scalar tier: acc (one float per row and token) takes the block at p, block index b of the vector
//     static void scalar_i8(const uint8_t* p, const ActI8<kActQB>& a, int b, float& acc);
//     static void scalar_native(const uint8_t* p, const float* x /* the block's activations */, float& acc);
//     // avx2 / avxvnni / avx512vnni (CPUMOE_GGUF_I8_SIMD): kStep blocks from p (block index b) for NT tokens
//     template <int NT> static void step_i8(const uint8_t* p, int b, const ActsI8<kActQB, NT>& a, __m256 (&acc)[NT]);
//     template <int NT> static void tail_i8(...same...);   // one block, only where kStep > 1
//     // avx2 / avx512f (CPUMOE_GGUF_NATIVE_SIMD): one block, x[t] its activations for token t
//     template <class V, int NT> static void block_native(const uint8_t* p, const float* const* x, typename V::F (&acc)[NT]);
//   };
//
// Every (row, token) has its own accumulator, filled block by block in K order and reduced the same way, whatever
// R and NT: gguf_rows.h's contract of dot.
#pragma once
#include <cmath>

#include "gguf_rows.h"

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
#define CPUMOE_GGUF_I8_SIMD 1
#else
#define CPUMOE_GGUF_I8_SIMD 0
#endif
#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F
#define CPUMOE_GGUF_NATIVE_SIMD 1
#else
#define CPUMOE_GGUF_NATIVE_SIMD 0
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace gguf {

// The prepared int8 activations of NT tokens (ActI8's three arrays per token).
template <int QB, int NT>
struct ActsI8 {
  const int8_t* q[NT];
  const float* d[NT];
  const int16_t* bs[NT];
  CPUMOE_INLINE ActsI8(const void* const* act, int K) {
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) {
      const ActI8<QB> a(act[t], K);
      q[t] = a.q, d[t] = a.d, bs[t] = a.bsum;
    }
  }
};

#if CPUMOE_TIER == CPUMOE_T_SCALAR
template <class B>
struct RowsW4A8 {
  static constexpr int kGrid = 4, kRowsDown = 2;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) {
        const ActI8<B::kActQB> a(act[t], K);
        float acc = 0.0f;
        for (int b = 0; b < K / B::QK; ++b) B::scalar_i8(w[r] + (size_t)b * B::QB, a, b, acc);
        out[r * NT + t] = acc;
      }
  }
};
template <class B>
struct RowsNative {
  static constexpr int kGrid = 4, kRowsDown = 2;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) {
        const float* x = (const float*)act[t];
        float acc = 0.0f;
        for (int b = 0; b < K / B::QK; ++b) B::scalar_native(w[r] + (size_t)b * B::QB, x + (size_t)b * B::QK, acc);
        out[r * NT + t] = acc;
      }
  }
};
#endif

#if CPUMOE_GGUF_I8_SIMD
// s + the int16 pairs p times the int16 scales sc: int32 lanes, exact where every pair and product fits (the
// formats' bounds: q4_k 2 * 15 * 127, q5_k 2 * 31 * 127, q6_k 2 * 32 * 127, scales <= 63 or 128)
CPUMOE_INLINE __m256i madd_acc(__m256i s, __m256i p, __m256i sc) {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
  return _mm256_dpwssd_avx_epi32(s, p, sc);
#elif CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  return _mm256_dpwssd_epi32(s, p, sc);
#else
  return _mm256_add_epi32(s, _mm256_madd_epi16(p, sc));
#endif
}

// R rows x NT tokens; per (row, token) one 8-lane fp32 accumulator that the block traits fill.
template <class B>
struct RowsW4A8 {
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  static constexpr int kGrid = 8;  // zmm / ymm16-31 hold the extra accumulators
#else
  static constexpr int kGrid = 4;
#endif
  static constexpr int kRowsDown = 4;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    constexpr int S = B::kStep;
    const int nb = K / B::QK;
    const ActsI8<B::kActQB, NT> a(act, K);
    __m256 acc[R][NT];
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r)
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    int b = 0;
    for (; b + S <= nb; b += S)
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * B::QB;
        prefetch_ahead(p, B::kPfLines);
        B::template step_i8<NT>(p, b, a, acc[r]);
      }
    if constexpr (S > 1)
      for (; b < nb; ++b)
        CPUMOE_UNROLL
        for (int r = 0; r < R; ++r) B::template tail_i8<NT>(w[r] + (size_t)b * B::QB, b, a, acc[r]);
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r)
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) out[r * NT + t] = hsum256(acc[r][t]);
  }
};
#endif

#if CPUMOE_GGUF_NATIVE_SIMD
// fp32 vectors of the native tier: zmm on avx512f, ymm on avx2; kW codes at a time.
struct VecF {
#if CPUMOE_TIER == CPUMOE_T_AVX512F
  using F = __m512;
  static constexpr int kW = 16, kGrid = 8;
  static CPUMOE_INLINE __m128i ld_bytes(const void* p) { return _mm_loadu_si128((const __m128i*)p); }
  static CPUMOE_INLINE F u8_to_f(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
  static CPUMOE_INLINE F i8_to_f(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
  static CPUMOE_INLINE F ld(const float* x) { return _mm512_loadu_ps(x); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static CPUMOE_INLINE F set1(float v) { return _mm512_set1_ps(v); }
  static CPUMOE_INLINE F zero() { return _mm512_setzero_ps(); }
  static CPUMOE_INLINE float hsum(F v) { return hsum512(v); }
#else
  using F = __m256;
  static constexpr int kW = 8, kGrid = 4;
  static CPUMOE_INLINE __m128i ld_bytes(const void* p) { return _mm_loadl_epi64((const __m128i*)p); }
  static CPUMOE_INLINE F u8_to_f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
  static CPUMOE_INLINE F i8_to_f(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
  static CPUMOE_INLINE F ld(const float* x) { return _mm256_loadu_ps(x); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static CPUMOE_INLINE F set1(float v) { return _mm256_set1_ps(v); }
  static CPUMOE_INLINE F zero() { return _mm256_setzero_ps(); }
  static CPUMOE_INLINE float hsum(F v) { return hsum256(v); }
#endif
};

// A run of N signed codes q (int8) against NT tokens' activations x[t] + off: acc[t] = fma(sum(q x), scale, acc[t]),
// the sum one chain of kW lanes (q6_k's 16-element sub-blocks, q8_0's blocks).
template <class V, int N, int NT>
CPUMOE_INLINE void signed_run(const int8_t* q, const float* const* x, int off, typename V::F scale,
                              typename V::F (&acc)[NT]) {
  typename V::F wv[N / V::kW];
  CPUMOE_UNROLL
  for (int i = 0; i < N / V::kW; ++i) wv[i] = V::i8_to_f(V::ld_bytes(q + i * V::kW));
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) {
    const float* xt = x[t] + off;
    typename V::F s = V::mul(wv[0], V::ld(xt));
    CPUMOE_UNROLL
    for (int i = 1; i < N / V::kW; ++i) s = V::fma(wv[i], V::ld(xt + i * V::kW), s);
    acc[t] = V::fma(s, scale, acc[t]);
  }
}

// native: per (row, token) one fp32 accumulator of the tier's width that the block traits fill.
template <class B>
struct RowsNative {
  using V = VecF;
  static constexpr int kGrid = V::kGrid, kRowsDown = 2;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    const int nb = K / B::QK;
    typename V::F acc[R][NT];
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r)
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) acc[r][t] = V::zero();
    for (int b = 0; b < nb; ++b)
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * B::QB;
        if (b % B::kPfNativeEvery == 0) prefetch_ahead(p, B::kPfNativeLines);
        const float* x[NT];
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) x[t] = (const float*)act[t] + (size_t)b * B::QK;
        B::template block_native<V, NT>(p, x, acc[r]);
      }
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r)
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) out[r * NT + t] = V::hsum(acc[r][t]);
  }
};
#endif

// The tier dispatch of a block format: w4a8 runs scalar, avx2, avxvnni, avx512vnni; native scalar, avx2, avx512f;
// a tier without its own kernel declines and the tier below runs.
template <class B>
bool init(cpumoe_kernel* k) {
  const bool w4a8 = k->params.mode == CPUMOE_MODE_W4A8;
  (void)w4a8;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2
  if (w4a8) {
    k->act_bytes = &act_bytes_i8<B::kActQB>;
    k->prep_act = &prep_act_i8<B::kActQB>;
    install<RowsW4A8<B>>(k);
  } else {
    k->act_bytes = &act_bytes_f32;
    k->prep_act = &prep_act_f32;
    install<RowsNative<B>>(k);
  }
  return true;
#elif CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  if (!w4a8) return false;  // native has no int8 work: the tier below runs (avx2 / avx512f)
  k->act_bytes = &act_bytes_i8<B::kActQB>;
  k->prep_act = &prep_act_i8<B::kActQB>;
  install<RowsW4A8<B>>(k);
  return true;
#elif CPUMOE_TIER == CPUMOE_T_AVX512F
  if (w4a8) return false;  // w4a8 without VNNI: avxvnni (if the CPU has it) or avx2 runs
  k->act_bytes = &act_bytes_f32;
  k->prep_act = &prep_act_f32;
  install<RowsNative<B>>(k);
  return true;
#else
  (void)k;
  return false;  // avx512bf16 / amx: nothing specific; avx512vnni (w4a8) / avx512f (native) run
#endif
}

}  // namespace gguf
}  // namespace CPUMOE_NS
}  // namespace cpumoe
