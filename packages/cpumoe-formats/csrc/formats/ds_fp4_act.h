// ds_fp4's activation prep, shared by ds_fp4.cpp and ds_fp4_x16.cpp (private header): DeepSeek-V4's FP8 round
// trip per 128-element block and, for mode w4a8, the Q8_0 int8 codes per 32-element block (moved here unchanged
// from ds_fp4.cpp, so both formats quantize activations bit for bit alike).
#pragma once
#include "fp4_common.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace dsfp4 {

// ---- activation FP8 round trip (DeepSeek-V4 act_quant, block 128) ----
// e4m3 round to nearest even of |q| <= 448: 3 mantissa bits, subnormal step 2^-9.
CPUMOE_INLINE float e4m3_rne(float q) {
  const float a = std::fabs(q);
  float r;
  if (a < 0.015625f) {  // below 2^-6: the subnormal grid m * 2^-9 (exact scalings)
    r = std::nearbyint(a * 512.f) * 0.001953125f;
  } else {
    uint32_t u = f32_bits(a);
    u = (u + 0x7FFFFu + ((u >> 20) & 1u)) & ~0xFFFFFu;
    r = bits_f32(u);
  }
  return std::copysign(r, q);
}

// v[0..127] (bf16 values as fp32) -> q = e4m3(clamp(v / s, +-448)) in v, returns
// s = 2^ceil(log2(max(1e-4, amax) / 448)); the round-tripped activation is bf16(q * s) = q * s. A block holding a
// NaN or an inf: q = 0 and s = NaN, so every round-tripped value is NaN (the reference's block is NaN; the
// int8 pieces of native's SIMD tiers and w4a8's codes would have lost it).
CPUMOE_INLINE float act_scale(float amax) {  // 2^ceil(log2(amax / 448)), amax >= 1e-4 (a normal quotient)
  const uint32_t u = f32_bits(amax / 448.f);
  const int32_t ce = (int32_t)((u >> 23) & 0xFFu) - 127 + ((u & 0x7FFFFFu) != 0);
  return bits_f32((uint32_t)(ce + 127) << 23);
}
CPUMOE_INLINE float act_quant_block(float* v) {
  float amax = 1e-4f;
  bool finite = true;
  for (int i = 0; i < 128; ++i) {
    const float a = std::fabs(v[i]);
    finite &= a <= std::numeric_limits<float>::max();  // false for inf and NaN
    amax = std::fmax(amax, a);
  }
  if (!finite) {
    for (int i = 0; i < 128; ++i) v[i] = 0.f;
    return nonfinite_scale();
  }
  const float s = act_scale(amax), inv = 1.f / s;
  for (int i = 0; i < 128; ++i) {
    float q = v[i] * inv;
    q = q > 448.f ? 448.f : (q < -448.f ? -448.f : q);
    v[i] = e4m3_rne(q);
  }
  return s;
}

// w4a8: one 128-element block of bf16 -> the FP8 round trip, then each 32-block to int8 by the Q8_0 rule
// (common.h q8_block): q[0..128) and hs[0..4) = 0.5 s_b. Both the scalar and the SIMD prep start here.
CPUMOE_INLINE void quant_w8_128(const uint16_t* src, int8_t* q, float* hs) {
  float v[128];
  for (int i = 0; i < 128; ++i) v[i] = bf16_to_f32(src[i]);
  const float s = act_quant_block(v);
  for (int i = 0; i < 128; ++i) v[i] *= s;  // the round-tripped value (exact in fp32)
  for (int j = 0; j < 4; ++j) hs[j] = 0.5f * q8_block(v + 32 * j, 32, q + 32 * j);
}

#if defined(__AVX2__)
// quant_w8_128 in 8-lane vectors, bit for bit: the same fp32 operations, e4m3_rne's two cases as a blend (the
// scalar prep, ~4 ns per element, was 30-40 us of the H200 host's 16-thread batch-1 step: x is prepared by one
// thread while the others wait, and the last expert group's g likewise). Returns the 4 blocks' codes.
CPUMOE_INLINE void quant_w8_128_simd(const uint16_t* src, __m256i* q, float* hs) {
  __m256 v[16];
  __m256i m = _mm256_castps_si256(_mm256_set1_ps(1e-4f));
  for (int i = 0; i < 16; ++i) v[i] = bf16x8_f32(src + 8 * i), m = absmax8(v[i], m);
  const uint32_t amax = hmax8(m);
  if (amax >= kInfBits) {  // quant_w8_128: q8_block of NaN round-tripped values
    for (int j = 0; j < 4; ++j) q[j] = _mm256_setzero_si256(), hs[j] = 0.5f * nonfinite_scale();
    return;
  }
  const float s = act_scale(bits_f32(amax));
  const __m256 inv = _mm256_set1_ps(1.f / s), vs = _mm256_set1_ps(s), sgn = _mm256_set1_ps(-0.0f);
  const __m256 hi = _mm256_set1_ps(448.f), lo = _mm256_set1_ps(-448.f), sub = _mm256_set1_ps(0.015625f);
  const __m256i bias = _mm256_set1_epi32(0x7FFFF), keep = _mm256_set1_epi32(~0xFFFFF), one = _mm256_set1_epi32(1);
  for (int i = 0; i < 16; ++i) {
    __m256 t = _mm256_mul_ps(v[i], inv);
    t = _mm256_blendv_ps(t, hi, _mm256_cmp_ps(t, hi, _CMP_GT_OQ));  // NaN stays NaN, as the scalar ?:
    t = _mm256_blendv_ps(t, lo, _mm256_cmp_ps(t, lo, _CMP_LT_OQ));
    const __m256 a = _mm256_andnot_ps(sgn, t);
    const __m256 rs = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.f)),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                    _mm256_set1_ps(0.001953125f));
    const __m256i u = _mm256_castps_si256(a);
    const __m256i rn = _mm256_and_si256(
        _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(_mm256_srli_epi32(u, 20), one)), keep);
    const __m256 r = _mm256_blendv_ps(_mm256_castsi256_ps(rn), rs, _mm256_cmp_ps(a, sub, _CMP_LT_OQ));
    v[i] = _mm256_mul_ps(_mm256_or_ps(r, _mm256_and_ps(t, sgn)), vs);  // copysign (r >= 0), then the scale
  }
  for (int j = 0; j < 4; ++j) {
    const __m256 x[4] = {v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]};
    float d;
    q[j] = q8_block32(x, &d);
    hs[j] = 0.5f * d;
  }
}
#endif  // __AVX2__

}  // namespace dsfp4
}  // namespace CPUMOE_NS
}  // namespace cpumoe
