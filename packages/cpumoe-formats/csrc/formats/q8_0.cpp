// q8_0 experts (native GGUF Q8_0): gate_up [E, 2I, (H/32)*34], down [E, H, (I/32)*34], uint8. Block of 32
// weights, 34 bytes: fp16 d (LE), then 32 int8 codes in element order; w = q * d. Banks (slots): 0 gate_up,
// 1 down. H, I multiples of 32. Blocks are 34 bytes, so every weight load is unaligned (bank alignment 1).
//
// Modes (k->params.mode):
//  w4a8 (default; ggml vec_dot_q8_0_q8_0, W8A8): prep quantizes each 32-block of the activation by the Q8_0 rule
//    (gguf_rows.h prep_act_i8<32>). Per block the exact integer sum(q_w * q_a), times fp32(fp16(d)) * d_a, summed
//    in fp32 lanes. avx2: ggml's sign trick, vpmaddubsw(|q_w|, sign(q_a, q_w)) (|q_w| <= 128 as an unsigned byte,
//    |q_a| <= 127: a pair sums to <= 2 * 128 * 127 = 32512, no int16 saturation) then vpmaddwd with ones;
//    avxvnni / avx512vnni: vpdpbusd on the same operands. Every int32 lane is the exact sum of 4 products in every
//    tier, so avx2, avxvnni and avx512vnni are bit-identical (tests/test_q8_0.py).
//  native (W8A16): fp32 activations, per block d * sum(q * x) in fp32. Tiers: scalar, avx2, avx512f.
#include "gguf_rows.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
using namespace gguf;

constexpr int QK = 32, QB = 34;
#if defined(__clang__)
#define Q8_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define Q8_UNROLL _Pragma("GCC unroll 8")
#else
#define Q8_UNROLL
#endif

#if CPUMOE_TIER == CPUMOE_T_SCALAR
struct RowsW4A8 {
  static constexpr int kGrid = 4, kRowsDown = 2;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) {
        const ActI8<QK> a(act[t], K);
        float acc = 0.0f;
        for (int b = 0; b < K / QK; ++b) {
          const uint8_t* p = w[r] + (size_t)b * QB;
          const int8_t* qw = (const int8_t*)(p + 2);
          const int8_t* qa = a.q + (size_t)b * QK;
          int32_t s = 0;
          for (int j = 0; j < QK; ++j) s += qw[j] * qa[j];
          acc += (float)s * (fp16_to_f32(ld16(p)) * a.d[b]);
        }
        out[r * NT + t] = acc;
      }
  }
};
struct RowsNative {
  static constexpr int kGrid = 4, kRowsDown = 2;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) {
        const float* x = (const float*)act[t];
        float acc = 0.0f;
        for (int b = 0; b < K / QK; ++b) {
          const uint8_t* p = w[r] + (size_t)b * QB;
          const int8_t* qw = (const int8_t*)(p + 2);
          float s = 0.0f;
          for (int j = 0; j < QK; ++j) s += (float)qw[j] * x[(size_t)b * QK + j];
          acc += fp16_to_f32(ld16(p)) * s;
        }
        out[r * NT + t] = acc;
      }
  }
};
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
// sum over each 4 bytes of |w| * sign(a, w) = w * a, as int32 lanes (exact)
CPUMOE_INLINE __m256i dot4(__m256i aw, __m256i sa) {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), aw, sa);
#elif CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sa);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), _mm256_set1_epi16(1));
#endif
}
// R rows x NT tokens; per (row, token) one 8-lane fp32 accumulator: acc += float(lanes of block b) * (d_w * d_a).
// The 4-block steps take the 4 fp16 d in one vcvtph2ps and the 4 d_a in one load.
struct RowsW4A8 {
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  static constexpr int kGrid = 8;  // ymm16-31 hold the extra accumulators
#else
  static constexpr int kGrid = 4;
#endif
  static constexpr int kRowsDown = 4;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    const int nb = K / QK;
    const int8_t* qa[NT];
    const float* da[NT];
    Q8_UNROLL
    for (int t = 0; t < NT; ++t) {
      const ActI8<QK> a(act[t], K);
      qa[t] = a.q, da[t] = a.d;
    }
    __m256 acc[R][NT];
    Q8_UNROLL
    for (int r = 0; r < R; ++r)
      Q8_UNROLL
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_ps();
    auto block = [&](const uint8_t* p, int r, int b, float dw) CPUMOE_LAMBDA_INLINE {
      const __m256i qw = _mm256_loadu_si256((const __m256i*)(p + 2));
      const __m256i aw = _mm256_sign_epi8(qw, qw);
      Q8_UNROLL
      for (int t = 0; t < NT; ++t) {
        const __m256i sa = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(qa[t] + (size_t)b * QK)), qw);
        acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot4(aw, sa)), _mm256_set1_ps(dw * da[t][b]), acc[r][t]);
      }
    };
    int b = 0;
    for (; b + 4 <= nb; b += 4)
      Q8_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        prefetch_ahead(p, 3);  // 136 bytes a step
        alignas(16) float dw[4];
        _mm_store_ps(dw, _mm_cvtph_ps(_mm_setr_epi16((short)ld16(p), (short)ld16(p + QB), (short)ld16(p + 2 * QB),
                                                     (short)ld16(p + 3 * QB), 0, 0, 0, 0)));
        Q8_UNROLL
        for (int j = 0; j < 4; ++j) block(p + j * QB, r, b + j, dw[j]);
      }
    for (; b < nb; ++b)
      Q8_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        block(p, r, b, _cvtsh_ss(ld16(p)));
      }
    Q8_UNROLL
    for (int r = 0; r < R; ++r)
      Q8_UNROLL
      for (int t = 0; t < NT; ++t) out[r * NT + t] = hsum256(acc[r][t]);
  }
};
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F
// native: per (row, token) one fp32 accumulator of the tier's width: acc += (sum over the block of q * x) * d.
struct RowsNative {
#if CPUMOE_TIER == CPUMOE_T_AVX512F
  using F = __m512;
  static constexpr int kW = 16, kGrid = 8;
  static CPUMOE_INLINE F cvt(const int8_t* q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))); }
  static CPUMOE_INLINE F ld(const float* x) { return _mm512_loadu_ps(x); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static CPUMOE_INLINE F set1(float v) { return _mm512_set1_ps(v); }
  static CPUMOE_INLINE F zero() { return _mm512_setzero_ps(); }
  static CPUMOE_INLINE float hsum(F v) { return hsum512(v); }
#else
  using F = __m256;
  static constexpr int kW = 8, kGrid = 4;
  static CPUMOE_INLINE F cvt(const int8_t* q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q))); }
  static CPUMOE_INLINE F ld(const float* x) { return _mm256_loadu_ps(x); }
  static CPUMOE_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static CPUMOE_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static CPUMOE_INLINE F set1(float v) { return _mm256_set1_ps(v); }
  static CPUMOE_INLINE F zero() { return _mm256_setzero_ps(); }
  static CPUMOE_INLINE float hsum(F v) { return hsum256(v); }
#endif
  static constexpr int kRowsDown = 2;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    const int nb = K / QK;
    F acc[R][NT];
    Q8_UNROLL
    for (int r = 0; r < R; ++r)
      Q8_UNROLL
      for (int t = 0; t < NT; ++t) acc[r][t] = zero();
    for (int b = 0; b < nb; ++b)
      Q8_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        if (b % 2 == 0) prefetch_ahead(p, 2);
        const int8_t* q = (const int8_t*)(p + 2);
        F wv[QK / kW];
        Q8_UNROLL
        for (int i = 0; i < QK / kW; ++i) wv[i] = cvt(q + i * kW);
        const F d = set1(_cvtsh_ss(ld16(p)));
        Q8_UNROLL
        for (int t = 0; t < NT; ++t) {
          const float* x = (const float*)act[t] + (size_t)b * QK;
          F s = mul(wv[0], ld(x));
          Q8_UNROLL
          for (int i = 1; i < QK / kW; ++i) s = fma(wv[i], ld(x + i * kW), s);
          acc[r][t] = fma(s, d, acc[r][t]);
        }
      }
    Q8_UNROLL
    for (int r = 0; r < R; ++r)
      Q8_UNROLL
      for (int t = 0; t < NT; ++t) out[r * NT + t] = hsum(acc[r][t]);
  }
};
#endif

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(q8_0)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
  const bool w4a8 = k->params.mode == CPUMOE_MODE_W4A8;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2
  if (w4a8) {
    k->act_bytes = &gguf::act_bytes_i8<32>;
    k->prep_act = &gguf::prep_act_i8<32>;
    gguf::install<RowsW4A8>(k);
  } else {
    k->act_bytes = &act_bytes_f32;
    k->prep_act = &prep_act_f32;
    gguf::install<RowsNative>(k);
  }
  return true;
#elif CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  if (!w4a8) return false;  // native has no int8 work: the tier below runs (avx2 / avx512f)
  k->act_bytes = &gguf::act_bytes_i8<32>;
  k->prep_act = &gguf::prep_act_i8<32>;
  gguf::install<RowsW4A8>(k);
  return true;
#elif CPUMOE_TIER == CPUMOE_T_AVX512F
  if (w4a8) return false;  // w4a8 without VNNI: avxvnni (if the CPU has it) or avx2 runs
  k->act_bytes = &act_bytes_f32;
  k->prep_act = &prep_act_f32;
  gguf::install<RowsNative>(k);
  return true;
#else
  (void)k;
  (void)w4a8;
  return false;  // avx512bf16 / amx: nothing specific; avx512vnni (w4a8) / avx512f (native) run
#endif
}
