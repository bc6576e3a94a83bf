// ds_fp4 experts (DeepSeek-V4-Flash), format id 3.
// Banks (slots): 0 gate_up_packed [E,2I,H/2] u8, 1 gate_up_scale [E,2I,H/32] e8m0,
// 2 down_packed [E,H,I/2] u8, 3 down_scale [E,H,I/32] e8m0. No global, no bias.
//   w[r,k] = E2M1[code] * 2^(min(s,254) - 127)   (s = 0 -> 2^-127, an fp32 subnormal)
//
// Activations (x before gate_up, g before down) go through DeepSeek-V4's FP8
// round trip per 128-element block in prep_act, then are stored as exact fp32 in
// the chunked even/odd layout of fp4_common.h. Pass 1 rounds gate and up to bf16
// (kRoundGateUp), pass 2 rounds each route's term to bf16 (kRoundRouteTerm).
// Mode: native only. Tiers: scalar, avx2 (64-element chunks = 2 scale blocks),
// avx512f (128-element chunks = 4 scale blocks).
#include "fp4_common.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
using namespace fp4;

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

// v[0..127] (bf16 values as fp32) -> bf16(e4m3(v / s) * s), s = 2^ceil(log2(max(1e-4, amax) / 448)).
CPUMOE_INLINE void act_quant_block(float* v) {
  float amax = 1e-4f;
  for (int i = 0; i < 128; ++i) amax = std::fmax(amax, std::fabs(v[i]));
  const uint32_t u = f32_bits(amax / 448.f);
  const int32_t ce = (int32_t)((u >> 23) & 0xFFu) - 127 + ((u & 0x7FFFFFu) != 0);
  const float s = bits_f32((uint32_t)(ce + 127) << 23), inv = 1.f / s;
  for (int i = 0; i < 128; ++i) {
    float q = v[i] * inv;
    q = q > 448.f ? 448.f : (q < -448.f ? -448.f : q);
    v[i] = round_bf16(e4m3_rne(q) * s);
  }
}

size_t act_bytes(const cpumoe_kernel*, int32_t K) { return (size_t)K * sizeof(float); }
void prep(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  float* d = (float*)dst;
  float v[128];
  for (int32_t b0 = 0; b0 < K; b0 += 128) {
    for (int i = 0; i < 128; ++i) v[i] = bf16_to_f32(src[b0 + i]);
    act_quant_block(v);
    for (int i = 0; i < 128; ++i) d[f32_pos(b0 + i, K, kNL)] = v[i];
  }
}

struct Dot {
  static constexpr int kBanks = 2;
  static constexpr bool kRoundGateUp = true, kRoundRouteTerm = true;
  static CPUMOE_INLINE float dot(const uint8_t* P, const uint8_t* Sc, float, int32_t K, const void* act) {
    const float* x = (const float*)act;
#if CPUMOE_TIER == CPUMOE_T_SCALAR
    float acc = 0.f;
    for (int32_t j = 0; j < K / 32; ++j)
      acc += e8m0_to_f32(Sc[j]) * (block16_scalar(P + 16 * j, x + 32 * j) + block16_scalar(P + 16 * j + 8, x + 32 * j + 16));
    return acc;
#elif defined(__AVX512F__)
    // 128-element chunks (64 packed bytes): lane L of every vector belongs to scale block L.
    const __m512i t2 = tbl512(tbl_byte2()), t3 = tbl512(tbl_byte3());
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    auto chunk = [&](const uint8_t* p, const float* xc, __m512 S, __m512& acc) {
      const Chunk16 w = decode_chunk_512(p, t2, t3);
      __m512 ta = _mm512_mul_ps(w.v0, _mm512_loadu_ps(xc));
      __m512 tb = _mm512_mul_ps(w.v2, _mm512_loadu_ps(xc + 32));
      ta = _mm512_fmadd_ps(w.v1, _mm512_loadu_ps(xc + 16), ta);
      tb = _mm512_fmadd_ps(w.v3, _mm512_loadu_ps(xc + 48), tb);
      ta = _mm512_fmadd_ps(w.w0, _mm512_loadu_ps(xc + 64), ta);
      tb = _mm512_fmadd_ps(w.w2, _mm512_loadu_ps(xc + 96), tb);
      ta = _mm512_fmadd_ps(w.w1, _mm512_loadu_ps(xc + 80), ta);
      tb = _mm512_fmadd_ps(w.w3, _mm512_loadu_ps(xc + 112), tb);
      acc = _mm512_fmadd_ps(_mm512_add_ps(ta, tb), S, acc);
    };
    const int32_t nc = K / 128;  // K % 128 == 0
    int32_t c = 0;
    for (; c + 2 <= nc; c += 2) {
      const uint8_t* p = P + 64 * c;
      prefetch_stream(p, 2, Sc + 4 * c, 16);
      const __m256 S = e8m0x8(load8(Sc + 4 * c));
      chunk(p, x + 128 * c, bcast4x4(S, 0, 1, 2, 3), a0);
      chunk(p + 64, x + 128 * c + 128, bcast4x4(S, 4, 5, 6, 7), a1);
    }
    if (c < nc) chunk(P + 64 * c, x + 128 * c, bcast4x4(e8m0x8(load4(Sc + 4 * c)), 0, 1, 2, 3), a0);
    return hsum512(_mm512_add_ps(a0, a1));
#else  // AVX2
    // 64-element chunks (32 packed bytes): lane L of every vector belongs to scale block L.
    const __m256i t2 = tbl_byte2(), t3 = tbl_byte3();
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    auto chunk = [&](const uint8_t* p, const float* xc, __m256 S, __m256& acc) {
      const Chunk8 w = decode_chunk(p, t2, t3);
      __m256 ta = _mm256_mul_ps(w.v0, _mm256_loadu_ps(xc));
      __m256 tb = _mm256_mul_ps(w.v2, _mm256_loadu_ps(xc + 16));
      ta = _mm256_fmadd_ps(w.v1, _mm256_loadu_ps(xc + 8), ta);
      tb = _mm256_fmadd_ps(w.v3, _mm256_loadu_ps(xc + 24), tb);
      ta = _mm256_fmadd_ps(w.w0, _mm256_loadu_ps(xc + 32), ta);
      tb = _mm256_fmadd_ps(w.w2, _mm256_loadu_ps(xc + 48), tb);
      ta = _mm256_fmadd_ps(w.w1, _mm256_loadu_ps(xc + 40), ta);
      tb = _mm256_fmadd_ps(w.w3, _mm256_loadu_ps(xc + 56), tb);
      acc = _mm256_fmadd_ps(_mm256_add_ps(ta, tb), S, acc);
    };
    const int32_t nc = K / 64;  // even: K % 128 == 0
    int32_t c = 0;
    for (; c + 4 <= nc; c += 4) {
      const uint8_t* p = P + 32 * c;
      prefetch_stream(p, 2, Sc + 2 * c, 16);
      const __m256 S = e8m0x8(load8(Sc + 2 * c));
      chunk(p, x + 64 * c, bcast2x4(S, 0, 1), a0);
      chunk(p + 32, x + 64 * c + 64, bcast2x4(S, 2, 3), a1);
      chunk(p + 64, x + 64 * c + 128, bcast2x4(S, 4, 5), a0);
      chunk(p + 96, x + 64 * c + 192, bcast2x4(S, 6, 7), a1);
    }
    if (c < nc) {  // one 128-element remainder: 2 chunks, 4 scales
      const __m256 S = e8m0x8(load4(Sc + 2 * c));
      chunk(P + 32 * c, x + 64 * c, bcast2x4(S, 0, 1), a0);
      chunk(P + 32 * c + 32, x + 64 * c + 64, bcast2x4(S, 2, 3), a1);
    }
    return hsum256(_mm256_add_ps(a0, a1));
#endif
  }
};

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(ds_fp4)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F
  if (k->params.mode != CPUMOE_MODE_NATIVE) return false;
  k->act_bytes = &act_bytes;
  k->prep_act = &prep;
  install_fp4<Dot>(k);
  return true;
#else
  (void)k;
  return false;  // avxvnni / avx512vnni / avx512bf16: nothing specific (the tier below runs)
#endif
}
