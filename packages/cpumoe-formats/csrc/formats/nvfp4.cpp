// nvfp4 experts (ModelOpt native rows), format id 1.
// Banks (slots): 0 gate_up_packed [E,2I,H/2] u8, 1 gate_up_scale [E,2I,H/16] e4m3,
// 2 gate_up_global [E,2I] fp16, 3 down_packed [E,H,I/2], 4 down_scale [E,H,I/16],
// 5 down_global [E,H]. w[r,k] = E2M1[code] * e4m3(scale[r,k/16]) * fp16(global[r]).
//
// Modes and tiers:
//   native (W4A16): x/g as exact fp32 in the chunked even/odd layout of
//     fp4_common.h; per 16-block scale, per-row global at the end.
//     scalar, avx2 (64 elements per decode), avx512f (128 per decode).
//   w4a8: x/g quantized per 16-block to int8 (s = amax/127, q = rint(v * (1/s)));
//     weights exact int8 w = 2*E2M1; exact integer block sums sum(w * q), per-block float
//     scale e4m3(scale_b) * s_b, final * 0.5 * global.
//     scalar (signed products), avx2 (vpmaddubsw + vpmaddwd), avxvnni (256-bit vpdpbusd),
//     avx512vnni (512-bit vpdpbusd, two 128-groups per step, rows in pairs: DotW4A8::dotr).
//     The SIMD tiers feed u = w + 12 (0..24) as the unsigned operand and q as the signed one,
//     and subtract 12 * sum(q) (from prep): sum(w q) = sum((w + 12) q) - 12 sum(q). The same
//     integers as the |w| x sign(w)*q sign trick, with two instructions less per 32 codes;
//     every tier computes identical block sums.
#include "fp4_common.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
using namespace fp4;

// One row: packed codes, e4m3 block scales, its global (already decoded), K.
struct Row {
  const uint8_t* p;
  const uint8_t* s;
  float g;
  int32_t K;
};

// ============================== native (W4A16) ==============================
size_t act_bytes_native(const cpumoe_kernel*, int32_t K) { return (size_t)K * sizeof(float); }
void prep_native(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  float* d = (float*)dst;
  for (int32_t k = 0; k < K; ++k) d[f32_pos(k, K, kNL)] = bf16_to_f32(src[k]);
}

// Multi-token: each chunk is decoded once, half at a time (low nibbles V0..V3, then high W0..W3), and FMA'd
// into the chains of NT tokens (AVX2: NT <= 2, AVX-512: NT <= 4). Per token the chains are those of the
// single-token dot in the same order (ta: V0 V1 W0 W1, tb: V2 V3 W2 W3, then a0 += ta * scales, a1 += tb *
// scales; the 16-block tail into a0), so a token's result does not depend on NT.
struct DotNative {
  static constexpr int kBanks = 3;
  static constexpr bool kRoundGateUp = false, kRoundRouteTerm = false;
#if CPUMOE_TIER == CPUMOE_T_SCALAR
  static constexpr int kMaxNT = 1;
#elif defined(__AVX512F__)
  static constexpr int kMaxNT = 4;
#else
  static constexpr int kMaxNT = 2;
#endif
  template <int NT>
  static CPUMOE_INLINE void dotn(const uint8_t* P, const uint8_t* Sc, float gl, int32_t K, const void* const* acts,
                                 float* out) {
    const Row r{P, Sc, gl, K};
    const int32_t nb = r.K / 16;
    const float* x[NT];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) x[t] = (const float*)acts[t];
#if CPUMOE_TIER == CPUMOE_T_SCALAR
    for (int t = 0; t < NT; ++t) {
      float acc = 0.f;
      for (int32_t b = 0; b < nb; ++b) acc += e4m3_to_f32(r.s[b]) * block16_scalar(r.p + 8 * b, x[t] + 16 * b);
      out[t] = acc * r.g;
    }
#elif defined(__AVX512F__)
    // 128-element chunks: 64 packed bytes, 8 blocks; V0,V1,W0,W1 lanes L hold block 2L,
    // V2,V3,W2,W3 block 2L+1.
    const __m512i t2 = tbl512(tbl_byte2()), t3 = tbl512(tbl_byte3()), m = _mm512_set1_epi8(0x0F);
    __m512 a0[NT], a1[NT];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
    const int32_t nc = r.K / 128;
    for (int32_t c = 0; c < nc; ++c) {
      const uint8_t* p = r.p + 64 * c;
      prefetch_stream(p, 1, r.s + 8 * c, 8);
      const __m512i bytes = _mm512_loadu_si512((const void*)p);
      const __m256 S = e4m3x8(load8(r.s + 8 * c));
      const __m512 sa = bcast4x4(S, 0, 2, 4, 6), sb = bcast4x4(S, 1, 3, 5, 7);
      __m512 v0, v1, v2, v3, ta[NT], tb[NT];
      decode_e2m1_512(_mm512_and_si512(bytes, m), t2, t3, v0, v1, v2, v3);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const float* xc = x[t] + 128 * c;
        ta[t] = _mm512_mul_ps(v0, _mm512_loadu_ps(xc));
        tb[t] = _mm512_mul_ps(v2, _mm512_loadu_ps(xc + 32));
        ta[t] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(xc + 16), ta[t]);
        tb[t] = _mm512_fmadd_ps(v3, _mm512_loadu_ps(xc + 48), tb[t]);
      }
      decode_e2m1_512(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), m), t2, t3, v0, v1, v2, v3);  // W0..W3
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const float* xc = x[t] + 128 * c;
        ta[t] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(xc + 64), ta[t]);
        tb[t] = _mm512_fmadd_ps(v2, _mm512_loadu_ps(xc + 96), tb[t]);
        ta[t] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(xc + 80), ta[t]);
        tb[t] = _mm512_fmadd_ps(v3, _mm512_loadu_ps(xc + 112), tb[t]);
        a0[t] = _mm512_fmadd_ps(ta[t], sa, a0[t]);
        a1[t] = _mm512_fmadd_ps(tb[t], sb, a1[t]);
      }
    }
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) {
      __m256 at = _mm256_setzero_ps();
      for (int32_t b = nc * 8; b < nb; ++b)
        at = _mm256_fmadd_ps(block16_avx2(r.p + 8 * b, x[t] + 16 * b), _mm256_set1_ps(e4m3_to_f32(r.s[b])), at);
      out[t] = (hsum512(_mm512_add_ps(a0[t], a1[t])) + hsum256(at)) * r.g;
    }
#else  // AVX2
    // 64-element chunks: 32 packed bytes, 4 blocks; V0,V1,W0,W1 lanes L hold block 2L,
    // V2,V3,W2,W3 block 2L+1. Two chunks (8 scales) per iteration.
    const __m256i t2 = tbl_byte2(), t3 = tbl_byte3();
    __m256 a0[NT], a1[NT];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
    const int32_t nc = r.K / 64;
    auto chunk = [&](const uint8_t* p, int32_t xo, __m256 sa, __m256 sb) {
      const __m256i m = _mm256_set1_epi8(0x0F), bytes = _mm256_loadu_si256((const __m256i*)p);
      __m256 v0, v1, v2, v3, ta[NT], tb[NT];
      decode_e2m1(_mm256_and_si256(bytes, m), t2, t3, v0, v1, v2, v3);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const float* xc = x[t] + xo;
        ta[t] = _mm256_mul_ps(v0, _mm256_loadu_ps(xc));
        tb[t] = _mm256_mul_ps(v2, _mm256_loadu_ps(xc + 16));
        ta[t] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xc + 8), ta[t]);
        tb[t] = _mm256_fmadd_ps(v3, _mm256_loadu_ps(xc + 24), tb[t]);
      }
      decode_e2m1(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), m), t2, t3, v0, v1, v2, v3);  // W0..W3
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const float* xc = x[t] + xo;
        ta[t] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(xc + 32), ta[t]);
        tb[t] = _mm256_fmadd_ps(v2, _mm256_loadu_ps(xc + 48), tb[t]);
        ta[t] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(xc + 40), ta[t]);
        tb[t] = _mm256_fmadd_ps(v3, _mm256_loadu_ps(xc + 56), tb[t]);
        a0[t] = _mm256_fmadd_ps(ta[t], sa, a0[t]);
        a1[t] = _mm256_fmadd_ps(tb[t], sb, a1[t]);
      }
    };
    int32_t c = 0;
    for (; c + 2 <= nc; c += 2) {
      const uint8_t* p = r.p + 32 * c;
      prefetch_stream(p, 1, r.s + 4 * c, 8);
      const __m256 S = e4m3x8(load8(r.s + 4 * c));
      chunk(p, 64 * c, bcast2x4(S, 0, 2), bcast2x4(S, 1, 3));
      chunk(p + 32, 64 * c + 64, bcast2x4(S, 4, 6), bcast2x4(S, 5, 7));
    }
    if (c < nc) {
      const __m256 S = e4m3x8(load4(r.s + 4 * c));
      chunk(r.p + 32 * c, 64 * c, bcast2x4(S, 0, 2), bcast2x4(S, 1, 3));
    }
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) {
      for (int32_t b = nc * 4; b < nb; ++b)
        a0[t] = _mm256_fmadd_ps(block16_avx2(r.p + 8 * b, x[t] + 16 * b), _mm256_set1_ps(e4m3_to_f32(r.s[b])), a0[t]);
      out[t] = hsum256(_mm256_add_ps(a0[t], a1[t])) * r.g;
    }
#endif
  }
};

// =================================== w4a8 ===================================
// Prepared vector: int8 codes [K]; then (at a 64-byte boundary) fp32 block scales [K/16]
// in natural block order; then int32 corrections 12 * sum(q) per block, for the full
// 128-groups in the avx2 lane order (blocks 0,1,4,5,2,3,6,7 of each group), natural for
// the tail; then the fp32 block scales again in that same order (the avx2 / avxvnni rows
// read them so, without a permute). Codes: groups of 128 elements as ae[64] ao[64]
// (ae[j] = q(x[2j]), group-local), then the K % 128 tail per 16-block as ae[8] ao[8].
CPUMOE_INLINE size_t w4a8_scale_off(int32_t K) { return ((size_t)K + 63) & ~(size_t)63; }
CPUMOE_INLINE size_t w4a8_corr_off(int32_t K) { return w4a8_scale_off(K) + (size_t)(K / 16) * sizeof(float); }
CPUMOE_INLINE size_t w4a8_hscale_off(int32_t K) { return w4a8_corr_off(K) + (size_t)(K / 16) * sizeof(int32_t); }
// Then (64-byte aligned) for the avx512vnni pair steps, per pair of 128-groups (the last group alone when their
// count is odd, its upper lanes 0): the 16 block scales in pair-lane order, then the 16 corrections negated in
// pair-lane order (pair_step's lane 4L + 2h + j), so a step loads them instead of permuting them per token.
CPUMOE_INLINE size_t w4a8_pair_off(int32_t K) {
  return (w4a8_hscale_off(K) + (size_t)(K / 16) * sizeof(float) + 63) & ~(size_t)63;
}
CPUMOE_INLINE size_t w4a8_pairs(int32_t K) { return (size_t)(K / 128 + 1) / 2; }
size_t act_bytes_w4a8(const cpumoe_kernel*, int32_t K) { return w4a8_pair_off(K) + w4a8_pairs(K) * 16 * 8; }
// The parts of one prepared w4a8 activation (prep_w4a8's layout) a dot reads.
struct W4A8Act {
  const int8_t* a;          // codes
  const float* as;          // per-16 scales
  const float* hs;          // per-16 scales in avx2's hadd order
  const int32_t* corr;      // per-16 corrections (12 * sum of codes)
  const float* pa;          // pair-lane scales, 8 per group (16 per pair)
  const int32_t* pc;        // pair-lane negated corrections, likewise
  CPUMOE_INLINE W4A8Act(const void* act, int32_t K)
      : a((const int8_t*)act), as((const float*)((const char*)act + w4a8_scale_off(K))),
        hs((const float*)((const char*)act + w4a8_hscale_off(K))),
        corr((const int32_t*)((const char*)act + w4a8_corr_off(K))),
        pa((const float*)((const char*)act + w4a8_pair_off(K))), pc((const int32_t*)(pa + 16 * w4a8_pairs(K))) {}
};
// avx2 lane order of a group's 8 block sums after vphaddd (blocks 0..3 from P, 4..7 from Q).
constexpr int kHaddOrder[8] = {0, 1, 4, 5, 2, 3, 6, 7};


void prep_w4a8(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  int8_t* q = (int8_t*)dst;
  float* sc = (float*)((char*)dst + w4a8_scale_off(K));
  int32_t* corr = (int32_t*)((char*)dst + w4a8_corr_off(K));
  float* hsc = (float*)((char*)dst + w4a8_hscale_off(K));
  const int32_t nmain = K / 128 * 8;
  for (int32_t b = 0; b < K / 16; ++b) {
    // codes: a 128-group's even elements at 8 (b & 7), odd at 64 + 8 (b & 7); tail blocks as ae[8] ao[8]
    int8_t* qe = b < nmain ? q + (b >> 3) * 128 + (b & 7) * 8 : q + nmain * 16 + (b - nmain) * 16;
    int8_t* qo = qe + (b < nmain ? 64 : 8);
    float s;
    const int32_t qsum = quant16(src + 16 * b, qe, qo, &s);
    sc[b] = s;
    int32_t slot = b;
    if (b < nmain)
      for (int j = 0; j < 8; ++j)
        if (kHaddOrder[j] == (b & 7)) slot = (b & ~7) + j;
    corr[slot] = kW2Offset * qsum;
    hsc[slot] = s;
  }
  // pair-lane copies: lane 4L + 2h + j <- natural block 2L + j of group g + h (scales) / its hadd slot (corrections)
  constexpr int kIn[16] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};
  constexpr int kIh[16] = {0, 1, 8, 9, 4, 5, 12, 13, 2, 3, 10, 11, 6, 7, 14, 15};
  float* pa = (float*)((char*)dst + w4a8_pair_off(K));
  int32_t* pc = (int32_t*)(pa + 16 * w4a8_pairs(K));
  for (int32_t g = 0; g < K / 128; g += 2)
    for (int l = 0; l < 16; ++l) {
      const bool in = g + 1 < K / 128 || kIn[l] < 8;  // a lone last group: lanes of group g + 1 are 0
      pa[8 * g + l] = in ? sc[8 * g + kIn[l]] : 0.f;
      pc[8 * g + l] = g + 1 < K / 128 || kIh[l] < 8 ? -corr[8 * g + kIh[l]] : 0;
    }
}


// Integer dot of one 16-block: 8 packed bytes against ae[8], ao[8].
CPUMOE_INLINE int32_t block16_i8(const uint8_t* p, const int8_t* ae, const int8_t* ao) {
#if defined(__SSSE3__)
  // The SIMD tiers' K % 128 tail (e.g. gemma4's I = 704: 4 blocks per down row): one 16-byte vector per block, the
  // same exact integer as the loop below, |w| * (a with w's sign) by vpmaddubsw (pairs <= 2 * 12 * 127). The
  // scalar loop made a row with a tail ~2x slower per byte than one without (Zen 4, one thread, I = 704 vs 640).
  const __m128i m = _mm_set1_epi8(0x0F), b = _mm_loadl_epi64((const __m128i*)p);
  const __m128i idx = _mm_unpacklo_epi64(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
  const __m128i w = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i*)kW2), idx);  // low nibbles, then high ones
  const __m128i a = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)ae), _mm_loadl_epi64((const __m128i*)ao));
  __m128i s = _mm_madd_epi16(_mm_maddubs_epi16(_mm_abs_epi8(w), _mm_sign_epi8(a, w)), _mm_set1_epi16(1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
#else
  int32_t s = 0;
  for (int m = 0; m < 8; ++m) s += kW2[p[m] & 15] * ae[m] + kW2[p[m] >> 4] * ao[m];
  return s;
#endif
}

// Scalar tail (and the whole scalar tier): blocks [b0, nb) of the row.
CPUMOE_INLINE float w4a8_blocks_scalar(const Row& r, const int8_t* a, const float* as, int32_t b0) {
  const int32_t nb = r.K / 16, ng = r.K / 128;
  float acc = 0.f;
  for (int32_t b = b0; b < nb; ++b) {
    const int8_t* ae = b < ng * 8 ? a + (b >> 3) * 128 + (b & 7) * 8 : a + ng * 128 + (b - ng * 8) * 16;
    const int8_t* ao = b < ng * 8 ? ae + 64 : ae + 8;
    acc += (float)block16_i8(r.p + 8 * b, ae, ao) * (e4m3_to_f32(r.s[b]) * as[b]);
  }
  return acc;
}

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
// 32 packed bytes (4 blocks) decoded once (u = w + 12 of the low and the high nibbles), and their products with one
// token's codes ae[32], ao[32]: avx2 16 int16 lanes (4 per block; |pair sums| <= 2 * 24 * 127 = 6096 per
// vpmaddubsw, <= 12192 after the add: no saturation), avxvnni 8 int32 lanes (2 per block).
struct WQuad {
  __m256i ul, uh;
  CPUMOE_INLINE WQuad(const uint8_t* p, __m256i tu) {
    const __m256i m = _mm256_set1_epi8(0x0F), b = _mm256_loadu_si256((const __m256i*)p);
    ul = _mm256_shuffle_epi8(tu, _mm256_and_si256(b, m));
    uh = _mm256_shuffle_epi8(tu, _mm256_and_si256(_mm256_srli_epi16(b, 4), m));
  }
  CPUMOE_INLINE __m256i prod(const int8_t* ae, const int8_t* ao) const {
    const __m256i ql = _mm256_loadu_si256((const __m256i*)ae), qh = _mm256_loadu_si256((const __m256i*)ao);
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ul, ql), uh, qh);
#else
    return _mm256_add_epi16(_mm256_maddubs_epi16(ul, ql), _mm256_maddubs_epi16(uh, qh));
#endif
  }
};
// Block sums of a 128-group from its two quads, in the order 0,1,4,5,2,3,6,7: the integers of vphaddd(P, Q), by
// vpackssdw + vpmaddwd (the 2-lane partial sums are <= 8 * 24 * 127 = 24384: exact in int16), which Zen3 runs
// in half the time of vphaddd.
CPUMOE_INLINE __m256i oct_sums(__m256i P, __m256i Q) {
  const __m256i one = _mm256_set1_epi16(1);
#if CPUMOE_TIER == CPUMOE_T_AVX2
  P = _mm256_madd_epi16(P, one), Q = _mm256_madd_epi16(Q, one);
#endif
  return _mm256_madd_epi16(_mm256_packs_epi32(P, Q), one);
}
// e4m3x8 with the 8 scales in the order 0,1,4,5,2,3,6,7 (the zero-extending byte shuffle also reorders).
CPUMOE_INLINE __m256 e4m3x8_hadd(__m128i codes) {
  __m128i h = _mm_shuffle_epi8(codes, _mm_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 2, -1, 3, -1, 6, -1, 7, -1));
  h = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(h, 8), 1), _mm_set1_epi16((short)0xBFFF));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
#endif

struct DotW4A8 {
  static constexpr int kBanks = 3;
  static constexpr bool kRoundGateUp = false, kRoundRouteTerm = false;
  // Returns sum_b isum_b * (e4m3(scale_b) * s_b) * (0.5 * global).
  static CPUMOE_INLINE float dot(const uint8_t* P, const uint8_t* Sc, float gl, int32_t K, const void* act) {
#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
    float out;  // one cell of the tier's grid below
    grid<1, 1>(&P, &Sc, &gl, K, &act, &out);
    return out;
#else  // scalar (the other tiers have no w4a8 kernel of their own: CPUMOE_INIT_FN)
    const W4A8Act A(act, K);
    return w4a8_blocks_scalar(Row{P, Sc, gl, K}, A.a, A.as, 0) * (0.5f * gl);
#endif
  }

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  // A token's gate and up rows, or down rows h and h + half, per call (fp4_common.h MultiRow), and up to kMaxNT
  // tokens of one expert per row (a batch: each weight step decoded once), both through the tier's grid<R, NT>.
  static constexpr int kRowsGateUp = 2, kRowsDown = 2;
  static constexpr int kMaxNT = CPUMOE_TIER == CPUMOE_T_AVX512VNNI ? 8 : 2;  // avx2: 16 ymm for R * NT * 2 accumulators
  template <int R>
  static CPUMOE_INLINE void dotr(const uint8_t* const* P, const uint8_t* const* Sc, const float* gl, int32_t K,
                                 const void* act, float* out) {
    grid<R, 1>(P, Sc, gl, K, &act, out);
  }
  template <int NT>
  static CPUMOE_INLINE void dotn(const uint8_t* P, const uint8_t* Sc, float gl, int32_t K, const void* const* acts,
                                 float* out) {
    grid<1, NT>(&P, &Sc, &gl, K, acts, out);
  }
  // The parts of NT tokens' prepared activations (W4A8Act's) a grid reads, as arrays: a W4A8Act per token was
  // ~5% slower for 8 tokens on the Zen 4 VM (one thread, experts in L3, 3 interleaved rounds).
  template <int NT>
  struct Tokens {
    const int8_t* a[NT];
    const float *as[NT], *hs[NT], *pa[NT];
    const int32_t *corr[NT], *pc[NT];
    CPUMOE_INLINE Tokens(const void* const* acts, int32_t K) {
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const W4A8Act A(acts[t], K);
        a[t] = A.a, as[t] = A.as, hs[t] = A.hs, pa[t] = A.pa, corr[t] = A.corr, pc[t] = A.pc;
      }
    }
  };
#endif
#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
  // R rows x NT tokens per call (a token's gate and up rows, or down rows h and h + half; or a row's tokens of one
  // expert in a batch): per group each row's nibbles and e4m3 scales are decoded once for the NT tokens. Every
  // (row, token) pair's integers and fp32 operations, in their order, are the same whatever R and NT (block sums
  // by vpackssdw + vpmaddwd in the order 0,1,4,5,2,3,6,7 with the scales' hadd-ordered copy; even and odd groups
  // in two accumulators), so neither R nor NT changes a result, and avx512vnni's pair kernel reproduces them.
  template <int R, int NT>
  static CPUMOE_INLINE void grid(const uint8_t* const* P, const uint8_t* const* Sc, const float* gl, int32_t K,
                                 const void* const* acts, float* out) {
    const Tokens<NT> q(acts, K);
    const int32_t ng = K / 128;
    const __m256i tu = w2_offset();
    __m256 acc[R][NT][2];
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r)
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    for (int32_t g0 = 0; g0 < ng; g0 += 2) {  // even groups into acc[.][.][0], odd into acc[.][.][1]
      CPUMOE_UNROLL
      for (int j = 0; j < 2; ++j) {
        const int32_t g = g0 + j;
        if (g >= ng) break;
        CPUMOE_UNROLL
        for (int r = 0; r < R; ++r) {
          const uint8_t* p = P[r] + 64 * g;
          prefetch_stream(p, 1, Sc[r] + 8 * g, 8);
          const WQuad W0(p, tu), W1(p + 32, tu);
          const __m256 esc = e4m3x8_hadd(load8(Sc[r] + 8 * g));
          CPUMOE_UNROLL
          for (int t = 0; t < NT; ++t) {
            const int8_t* ag = q.a[t] + 128 * g;
            const __m256i S = _mm256_sub_epi32(oct_sums(W0.prod(ag, ag + 64), W1.prod(ag + 32, ag + 96)),
                                               _mm256_loadu_si256((const __m256i*)(q.corr[t] + 8 * g)));
            const __m256 comb = _mm256_mul_ps(esc, _mm256_loadu_ps(q.hs[t] + 8 * g));
            acc[r][t][j] = _mm256_add_ps(acc[r][t][j], _mm256_mul_ps(_mm256_cvtepi32_ps(S), comb));
          }
        }
      }
    }
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      const Row row{P[r], Sc[r], gl[r], K};
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t)
        out[r * NT + t] = (hsum256(_mm256_add_ps(acc[r][t][0], acc[r][t][1])) +
                           w4a8_blocks_scalar(row, q.a[t], q.as[t], ng * 8)) * (0.5f * gl[r]);
    }
  }
#elif CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  // Two 128-groups per step in one 512-bit pair vector: lane 4L + 2h + j holds block 2L + j of group g + h. The
  // block sums come from vpackssdw(P_g, P_g+1) + vpdpwssd(-corr, ., 1) (the 2-lane partial sums are <= 8 * 24 *
  // 127 = 24384: exact in int16; the same integers as avx2's vphaddd), with the corrections,
  // activation scales and (per row) the e4m3 scale codes permuted into the pair order instead of the sums. Lanes
  // h = 0 are the avx2 path's even-group accumulator (natural block order), h = 1 its odd one, with each block's
  // fp32 ops (e4m3 * s, then int * that, then the add in group order) as avx2's; the epilogue permutes them
  // into avx2's hadd order and sums as it does, so all tiers stay bit-identical. out[r * NT + t] = dot(row r,
  // token t) for R rows x NT tokens (R * NT <= 8 accumulators): a token's gate and up rows (or down rows h and
  // h + half), or a row's tokens of one expert (the weight side of a step done once for them); each (row, token)
  // pair's operations are the same whatever R and NT (tests/test_batch_identity.py). The activation scales and
  // corrections come in pair-lane order from prep_w4a8.
  template <int R, int NT>
  static CPUMOE_INLINE void grid(const uint8_t* const* P, const uint8_t* const* Sc, const float* gl, int32_t K,
                                 const void* const* acts, float* out) {
    const Tokens<NT> q(acts, K);
    const int32_t ng = K / 128;
    __m512 acc[R * NT];
    CPUMOE_UNROLL
    for (int i = 0; i < R * NT; ++i) acc[i] = _mm512_setzero_ps();
    int32_t g = 0;
    for (; g + 2 <= ng; g += 2) pair_step<R, NT, true>(P, Sc, q, g, acc);
    if (g < ng) pair_step<R, NT, false>(P, Sc, q, g, acc);  // odd ng: the last group alone (lanes h = 0)
    // pair lanes -> avx2's accumulators in hadd order (blocks 0,1,4,5,2,3,6,7): even groups (h = 0), odd (h = 1)
    const __m512i i0 = _mm512_setr_epi32(0, 1, 8, 9, 4, 5, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(2));
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      const Row row{P[r], Sc[r], gl[r], K};
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const __m256 a0 = _mm512_castps512_ps256(_mm512_permutexvar_ps(i0, acc[r * NT + t]));
        const __m256 a1 = _mm512_castps512_ps256(_mm512_permutexvar_ps(i1, acc[r * NT + t]));
        out[r * NT + t] =
            (hsum256(_mm256_add_ps(a0, a1)) + w4a8_blocks_scalar(row, q.a[t], q.as[t], ng * 8)) * (0.5f * gl[r]);
      }
    }
  }
  // Groups g and g + 1 (TWO) or g alone: per row the weight side (nibble lookups, e4m3 scale codes -> fp32) once,
  // then per token its block sums and fp32 multiply-add into the pair-order accumulator.
  template <int R, int NT, bool TWO>
  static CPUMOE_INLINE void pair_step(const uint8_t* const* P, const uint8_t* const* Sc, const Tokens<NT>& q,
                                      int32_t g, __m512* acc) {
    const __m512i tu = tbl512(w2_offset()), m = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi16(1);
    // e4m3 code bytes (8h + 2L + j) into the high byte of fp16 lane 4L + 2h + j; shifted right by one (arithmetic)
    // and masked that is e4m3x8_div256's fp16
    const __m256i sx = _mm256_setr_epi8(-1, 0, -1, 1, -1, 8, -1, 9, -1, 2, -1, 3, -1, 10, -1, 11,  //
                                        -1, 4, -1, 5, -1, 12, -1, 13, -1, 6, -1, 7, -1, 14, -1, 15);
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = P[r] + 64 * g;
      const uint8_t* s = Sc[r] + 8 * g;
      prefetch_stream(p, TWO ? 2 : 1, s, 8);
      const __m512i b0 = _mm512_loadu_si512((const void*)p);
      const __m512i l0 = _mm512_shuffle_epi8(tu, _mm512_and_si512(b0, m));
      const __m512i h0 = _mm512_shuffle_epi8(tu, _mm512_and_si512(_mm512_srli_epi16(b0, 4), m));
      __m512i l1 = l0, h1 = h0;
      if (TWO) {  // else lanes h = 1 are never added (masked below)
        const __m512i b1 = _mm512_loadu_si512((const void*)(p + 64));
        l1 = _mm512_shuffle_epi8(tu, _mm512_and_si512(b1, m));
        h1 = _mm512_shuffle_epi8(tu, _mm512_and_si512(_mm512_srli_epi16(b1, 4), m));
      }
      const __m128i codes = TWO ? _mm_loadu_si128((const __m128i*)s) : load8(s);
      __m256i hc = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(codes), sx);
      hc = _mm256_and_si256(_mm256_srai_epi16(hc, 1), _mm256_set1_epi16((short)0xBFFF));
      const __m512 esc = _mm512_mul_ps(_mm512_cvtph_ps(hc), _mm512_set1_ps(256.f));
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const int8_t* ag = q.a[t] + 128 * g;
        auto sums = [&](__m512i ul, __m512i uh, const int8_t* q) {  // int32 lane i: bytes 4i..4i+3, both nibbles
          const __m512i lo = _mm512_loadu_si512((const void*)q), hi = _mm512_loadu_si512((const void*)(q + 64));
          return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ul, lo), uh, hi);
        };
        const __m512i P0 = sums(l0, h0, ag), P1 = TWO ? sums(l1, h1, ag + 128) : _mm512_setzero_si512();
        // the activation scales and negated corrections in pair-lane order (prep_w4a8)
        const __m512i C = _mm512_loadu_si512((const void*)(q.pc[t] + 8 * g));
        const __m512i S = _mm512_dpwssd_epi32(C, _mm512_packs_epi32(P0, P1), one);
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(esc, _mm512_loadu_ps(q.pa[t] + 8 * g)));
        __m512& a = acc[r * NT + t];
        a = TWO ? _mm512_add_ps(a, f) : _mm512_mask_add_ps(a, 0x3333, a, f);
      }
    }
  }
#endif
};

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(nvfp4)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
  const bool w4a8 = k->params.mode == CPUMOE_MODE_W4A8;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2
  const bool has = true;
#elif CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  const bool has = w4a8;
#elif CPUMOE_TIER == CPUMOE_T_AVX512F
  const bool has = !w4a8;
#else
  const bool has = false;  // avx512bf16: nothing bf16-specific (the tiers below run)
#endif
  if (!has) return false;
  if (w4a8) {
    k->act_bytes = &act_bytes_w4a8;
    k->prep_act = &prep_w4a8;
    install_fp4<DotW4A8>(k);
  } else {
    k->act_bytes = &act_bytes_native;
    k->prep_act = &prep_native;
    install_fp4<DotNative>(k);
  }
  return true;
}
