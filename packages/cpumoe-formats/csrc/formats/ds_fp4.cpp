// ds_fp4 experts (DeepSeek-V4-Flash), format id 3.
// Banks (slots): 0 gate_up_packed [E,2I,H/2] u8, 1 gate_up_scale [E,2I,H/32] e8m0,
// 2 down_packed [E,H,I/2] u8, 3 down_scale [E,H,I/32] e8m0. No global, no bias.
//   w[r,k] = E2M1[code] * 2^(min(s,254) - 127)   (s = 0 -> 2^-127, an fp32 subnormal)
//
// Activations (x before gate_up, g before down) go through DeepSeek-V4's FP8 round trip
// per 128-element block in prep_act: v' = q * s_a with q an e4m3 value and s_a a power
// of two per 128 block. Pass 1 rounds gate and up to bf16 (kRoundGateUp), pass 2 rounds
// each route's term to bf16 (kRoundRouteTerm). Modes: native and w4a8 (below).
//
// Tiers: scalar (fp32 v' in the per-16 even/odd layout, fp32 dots); avx2 and avx512f
// compute exact integer block dots: q' = q * 2^9 is an integer (|q'| <= 229376) stored as
// three int8 pieces q' = a2 2^14 + a1 2^7 + a0 (a0, a1 in [0, 127], a2 in [-14, 14]), the
// weights are u = 2 E2M1 + 12 (u8), and per 32-bit lane (8 elements)
//   sum(w q') = (sum(u a2) << 14) + (sum(u a1) << 7) + sum(u a0) - 12 sum(q')
// with vpmaddubsw (pair sums <= 2*24*127 = 6096, <= 12192 after adding the two nibble
// halves: no saturation) + vpmaddwd; |sum| < 2^26 per lane. The lane sums times
// s_a 2^-10 (fp32) times the block's e8m0 scale go into fp32 accumulators. This is the
// same value as the fp32 dot of the round-tripped activations, with exact products.
//
// Mode w4a8: the round-tripped activation is quantized per 32 elements (the weight scale block) to int8, the
// Q8_0 rule (s_b = amax / 127, q = clamp(rint(v / s_b), +-127), half to even; numerics.int8_blocks), so a dot
// needs one int8 product per element instead of the three pieces: per 8 elements (one 32-bit lane) the exact
// t = sum(u q) - 12 sum(q) = sum(2 E2M1 q), then acc = fma((float)t * (0.5 s_b), e8m0, acc) (the scalar tier: per
// 32-block, acc += ((float)S * (0.5 s_b)) * e8m0). The e8m0 factor comes last, as in native: (0.5 s_b) * 2^-127
// would be an fp32 subnormal whose rounding t then multiplies. About half the integer work of native per element.
// avx512vnni (w4a8 only) forms the same lane sums t with two vpdpbusd instead of vpmaddubsw x 2 + vpaddw +
// vpmaddwd: bit-identical to avx512f, four instructions fewer per 128 elements and token.
#include "ds_fp4_act.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
using namespace fp4;
using namespace dsfp4;

#if CPUMOE_TIER == CPUMOE_T_SCALAR
// ---- scalar: fp32 activations, per 16-block xe[8] xo[8] -------------------------------
size_t act_bytes(const cpumoe_kernel*, int32_t K) { return (size_t)K * sizeof(float); }
void prep(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  float* d = (float*)dst;
  float v[128];
  for (int32_t b0 = 0; b0 < K; b0 += 128) {
    for (int i = 0; i < 128; ++i) v[i] = bf16_to_f32(src[b0 + i]);
    const float s = act_quant_block(v);
    for (int i = 0; i < 128; ++i) d[f32_pos(b0 + i, K, 0)] = round_bf16(v[i] * s);
  }
}

struct Dot {
  static constexpr int kBanks = 2;
  static constexpr bool kRoundGateUp = true, kRoundRouteTerm = true;
  static CPUMOE_INLINE float dot(const uint8_t* P, const uint8_t* Sc, float, int32_t K, const void* act) {
    const float* x = (const float*)act;
    float acc = 0.f;
    for (int32_t j = 0; j < K / 32; ++j)
      acc += e8m0_to_f32(Sc[j]) * (block16_scalar(P + 16 * j, x + 32 * j) + block16_scalar(P + 16 * j + 8, x + 32 * j + 16));
    return acc;
  }
};

// ---- w4a8 (scalar): int8 q[K], then fp32 0.5 s_b per 32-block ----
size_t act_bytes_w8(const cpumoe_kernel*, int32_t K) { return (size_t)K + (size_t)(K / 32) * sizeof(float); }
void prep_w8(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  int8_t* q = (int8_t*)dst;
  float* hs = (float*)(q + K);
  for (int32_t b0 = 0; b0 < K; b0 += 128) quant_w8_128(src + b0, q + b0, hs + b0 / 32);
}
struct DotW8 {
  static constexpr int kBanks = 2;
  static constexpr bool kRoundGateUp = true, kRoundRouteTerm = true;
  static CPUMOE_INLINE float dot(const uint8_t* P, const uint8_t* Sc, float, int32_t K, const void* act) {
    const int8_t* q = (const int8_t*)act;
    const float* hs = (const float*)(q + K);
    float acc = 0.f;
    for (int32_t j = 0; j < K / 32; ++j) {
      int32_t S = 0;
      for (int i = 0; i < 16; ++i) {
        const uint8_t b = P[16 * j + i];
        S += kW2[b & 15] * q[32 * j + 2 * i] + kW2[b >> 4] * q[32 * j + 2 * i + 1];
      }
      acc += ((float)S * hs[j]) * e8m0_to_f32(Sc[j]);
    }
    return acc;
  }
};
#else
// ---- SIMD: int8 pieces ----------------------------------------------------------------
// Prepared vector: K / C records of C = 32 * kNL elements (one SIMD chunk: C / 2 packed
// bytes, lane L = scale block L), each a0e a0o a1e a1o a2e a2o (C / 2 bytes each; e[j] =
// piece of q'(2j), o[j] = of q'(2j+1), chunk-local) then C / 8 int32 corrections
// 12 * sum(q') over the 8 elements of each 32-bit lane (packed bytes 4i..4i+3); then,
// 64-byte aligned, fp32 s_a * 2^-10 per 128-element block.
constexpr int32_t kC = 32 * kNL;                   // elements per chunk
constexpr int32_t kRec = 3 * kC + kC / 8 * 4;      // bytes per chunk record (3.5 per element)
CPUMOE_INLINE size_t sact_off(int32_t K) { return ((size_t)(K / kC) * kRec + 63) & ~(size_t)63; }
size_t act_bytes(const cpumoe_kernel*, int32_t K) { return sact_off(K) + (size_t)(K / 128) * sizeof(float); }

void prep(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  float* sact = (float*)((char*)dst + sact_off(K));
  float v[128];
  for (int32_t b0 = 0; b0 < K; b0 += 128) {
    for (int i = 0; i < 128; ++i) v[i] = bf16_to_f32(src[b0 + i]);
    sact[b0 / 128] = act_quant_block(v) * 0.0009765625f;  // s_a * 2^-10 (exact)
    for (int32_t c0 = 0; c0 < 128; c0 += kC) {
      int8_t* rec = (int8_t*)dst + (size_t)((b0 + c0) / kC) * kRec;
      int32_t* corr = (int32_t*)(rec + 3 * kC);
      for (int i = 0; i < kC / 8; ++i) corr[i] = 0;
      for (int32_t k = 0; k < kC; ++k) {
        const int32_t q = (int32_t)(v[c0 + k] * 512.f);  // exact: q = m 2^-9 .. 448
        const int32_t j = k >> 1, half = k & 1;
        rec[(0 * 2 + half) * (kC / 2) + j] = (int8_t)(q & 127);
        rec[(1 * 2 + half) * (kC / 2) + j] = (int8_t)((q >> 7) & 127);
        rec[(2 * 2 + half) * (kC / 2) + j] = (int8_t)(q >> 14);  // arithmetic shift: -14..14
        corr[k >> 3] += kW2Offset * q;
      }
    }
  }
}

#if defined(__AVX512F__)
using VI = __m512i;
using VF = __m512;
CPUMOE_INLINE VI ld(const void* p) { return _mm512_loadu_si512(p); }
CPUMOE_INLINE VI and_(VI a, VI b) { return _mm512_and_si512(a, b); }
CPUMOE_INLINE VI srl4(VI a) { return _mm512_srli_epi16(a, 4); }
CPUMOE_INLINE VI shuf(VI t, VI i) { return _mm512_shuffle_epi8(t, i); }
CPUMOE_INLINE VI maddubs(VI a, VI b) { return _mm512_maddubs_epi16(a, b); }
template <short M = 1> CPUMOE_INLINE VI madd1(VI a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(M)); }
CPUMOE_INLINE VI add16(VI a, VI b) { return _mm512_add_epi16(a, b); }
CPUMOE_INLINE VI add32(VI a, VI b) { return _mm512_add_epi32(a, b); }
CPUMOE_INLINE VI sub32(VI a, VI b) { return _mm512_sub_epi32(a, b); }
CPUMOE_INLINE VF cvt(VI a) { return _mm512_cvtepi32_ps(a); }
CPUMOE_INLINE VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
CPUMOE_INLINE VF fma_(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
CPUMOE_INLINE VF bcast(const float* p) { return _mm512_set1_ps(*p); }
CPUMOE_INLINE VF ldf(const float* p) { return _mm512_loadu_ps(p); }
CPUMOE_INLINE VI set1b(char v) { return _mm512_set1_epi8(v); }
CPUMOE_INLINE VI utable() { return tbl512(w2_offset()); }
CPUMOE_INLINE float hsum(VF a) { return hsum512(a); }
CPUMOE_INLINE VF zero() { return _mm512_setzero_ps(); }
#else
using VI = __m256i;
using VF = __m256;
CPUMOE_INLINE VI ld(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
CPUMOE_INLINE VI and_(VI a, VI b) { return _mm256_and_si256(a, b); }
CPUMOE_INLINE VI srl4(VI a) { return _mm256_srli_epi16(a, 4); }
CPUMOE_INLINE VI shuf(VI t, VI i) { return _mm256_shuffle_epi8(t, i); }
CPUMOE_INLINE VI maddubs(VI a, VI b) { return _mm256_maddubs_epi16(a, b); }
template <short M = 1> CPUMOE_INLINE VI madd1(VI a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(M)); }
CPUMOE_INLINE VI add16(VI a, VI b) { return _mm256_add_epi16(a, b); }
CPUMOE_INLINE VI add32(VI a, VI b) { return _mm256_add_epi32(a, b); }
CPUMOE_INLINE VI sub32(VI a, VI b) { return _mm256_sub_epi32(a, b); }
CPUMOE_INLINE VF cvt(VI a) { return _mm256_cvtepi32_ps(a); }
CPUMOE_INLINE VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
CPUMOE_INLINE VF fma_(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
CPUMOE_INLINE VF bcast(const float* p) { return _mm256_set1_ps(*p); }
CPUMOE_INLINE VF ldf(const float* p) { return _mm256_loadu_ps(p); }
CPUMOE_INLINE VI set1b(char v) { return _mm256_set1_epi8(v); }
CPUMOE_INLINE VI utable() { return w2_offset(); }
CPUMOE_INLINE float hsum(VF a) { return hsum256(a); }
CPUMOE_INLINE VF zero() { return _mm256_setzero_ps(); }
#endif
constexpr int32_t kV = kC / 2;  // bytes per vector (32 or 64)

// The weight side of a chunk: u = 2 E2M1 + 12 of the low and the high nibbles (decoded once per NT tokens).
struct WChunk {
  VI ul, uh;
  CPUMOE_INLINE WChunk(const uint8_t* p, VI tu) {
    const VI m = set1b(0x0F), b = ld(p);
    ul = shuf(tu, and_(b, m)), uh = shuf(tu, and_(srl4(b), m));
  }
};
// One chunk of one token: exact integer lane sums of w * q', converted and scaled into acc.
CPUMOE_INLINE void chunk(const WChunk& W, const int8_t* rec, const float* sa, VF S, VF& acc) {
  // the piece weights 2^7 and 2^14 ride on the vpmaddwd (int16 multipliers 128 and 16384: the pair sums are
  // <= 12192, so 16384 * 2 * 12192 < 2^31), no shifts: the same integers as (p2 << 14) + (p1 << 7) + p0
  const VI p0 = madd1(add16(maddubs(W.ul, ld(rec)), maddubs(W.uh, ld(rec + kV))));
  const VI p1 = madd1<128>(add16(maddubs(W.ul, ld(rec + 2 * kV)), maddubs(W.uh, ld(rec + 3 * kV))));
  const VI p2 = madd1<16384>(add16(maddubs(W.ul, ld(rec + 4 * kV)), maddubs(W.uh, ld(rec + 5 * kV))));
  const VI t = sub32(add32(add32(p2, p1), p0), ld(rec + 6 * kV));
  acc = fma_(mul(cvt(t), bcast(sa)), S, acc);
}

// ---- w4a8 (SIMD): per chunk record q_e[C/2] q_o[C/2] (int8, chunk-local even / odd elements, as piece a0 of
// native), C/8 int32 negated corrections -12 sum(q) per 8 elements (negated so that avx512vnni starts its vpdpbusd
// chain from them: one subtraction per chunk and token fewer, the same integers), C/8 fp32 0.5 s_b of each 32-bit
// lane's 32-block.
constexpr int32_t kRec8 = kC + kC / 8 * 8;
size_t act_bytes_w8(const cpumoe_kernel*, int32_t K) { return (size_t)(K / kC) * kRec8; }
void prep_w8(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  float hs[4];
  __m256i q[4];
  // per 128-bit lane: its 8 even bytes, then its 8 odd ones; then qwords (0, 2, 1, 3): 16 even, then 16 odd codes
  const __m256i eo = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
  for (int32_t b0 = 0; b0 < K; b0 += 128) {
    quant_w8_128_simd(src + b0, q, hs);
    for (int j = 0; j < 4; ++j) {  // block j: elements k0 .. k0 + 31 of chunk record rec
      const int32_t k0 = (b0 + 32 * j) % kC;
      int8_t* rec = (int8_t*)dst + (size_t)((b0 + 32 * j) / kC) * kRec8;
      const __m256i e = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(q[j], eo), 0xD8);
      _mm_storeu_si128((__m128i*)(rec + k0 / 2), _mm256_castsi256_si128(e));
      _mm_storeu_si128((__m128i*)(rec + kC / 2 + k0 / 2), _mm256_extracti128_si256(e, 1));
      // -12 x the sums of the 4 runs of 8 codes: the 4-byte lane sums added in pairs
      const __m256i s4 = sum4_i8(q[j]), s8 = _mm256_hadd_epi32(s4, s4);  // lane l of 128-bit half h: 8 codes
      const __m128i c = _mm_unpacklo_epi64(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      _mm_storeu_si128((__m128i*)(rec + kC + 4 * (k0 / 8)), _mm_mullo_epi32(c, _mm_set1_epi32(-kW2Offset)));
      _mm_storeu_ps((float*)(rec + kC + kC / 2) + k0 / 8, _mm_set1_ps(hs[j]));
    }
  }
}
CPUMOE_INLINE void chunk8(const WChunk& W, const int8_t* rec, VF S, VF& acc) {
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI  // the same lane sums in two vpdpbusd on -corr (no int16 step, nothing saturates)
  const VI t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ld(rec + kC), W.ul, ld(rec)), W.uh, ld(rec + kV));
#else
  const VI t = add32(madd1(add16(maddubs(W.ul, ld(rec)), maddubs(W.uh, ld(rec + kV)))), ld(rec + kC));
#endif
  acc = fma_(mul(cvt(t), ldf((const float*)(rec + kC + kC / 2))), S, acc);  // as native: the e8m0 factor last
}

// Multi-token: each chunk's nibbles are decoded once for NT tokens (AVX2: NT <= 2, AVX-512: NT <= 4); each
// token keeps the single-token chains (a0, a1 alternating by chunk) and order, so NT never changes a result.
// W8: mode w4a8 (chunk8 on kRec8 records) instead of native's three pieces.
template <bool W8>
struct DotT {
  static constexpr int kBanks = 2;
  static constexpr bool kRoundGateUp = true, kRoundRouteTerm = true;
#if defined(__AVX512F__)
  static constexpr int kMaxNT = 4;
#else
  static constexpr int kMaxNT = 2;
#endif
  // w4a8, one token: gate + up rows, and down rows h / h + half, per call (two weight streams; fp4_common.h
  // MultiRow). Native keeps one row: it is compute-bound, and two rows were no faster there (branch fp4z).
  static constexpr int kRowsGateUp = W8 ? 2 : 1, kRowsDown = W8 ? 2 : 1;

  // out[r * NT + t] = dot(row r, token t) for R rows (P[r], Sc[r]) and NT tokens: each chunk of a row is decoded
  // once for the NT tokens; every (row, token) pair keeps the single-pair chains (a0, a1 alternating by chunk)
  // and order, so neither R nor NT ever changes a result.
  template <int R, int NT>
  static CPUMOE_INLINE void grid(const uint8_t* const* P, const uint8_t* const* Sc, int32_t K, const void* const* acts,
                                 float* out) {
    const int8_t* A[NT];
    const float* sa[NT];
    VF a0[R][NT], a1[R][NT];
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) {
      A[t] = (const int8_t*)acts[t];
      sa[t] = W8 ? nullptr : (const float*)((const char*)acts[t] + sact_off(K));
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) a0[r][t] = a1[r][t] = zero();
    }
    const VI tu = utable();
    const int32_t nc = K / kC;
    // chunk c of row r (record c of every token) with scale vector S into each token's acc
    auto run = [&](int r, int32_t off, int32_t c, int32_t sblk, VF S, VF* acc) {
      const WChunk W(P[r] + off, tu);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        if constexpr (W8)
          chunk8(W, A[t] + (size_t)c * kRec8, S, acc[t]);
        else
          chunk(W, A[t] + (size_t)c * kRec, sa[t] + sblk, S, acc[t]);
      }
    };
#if defined(__AVX512F__)
    // 128-element chunks (64 packed bytes, 4 scale blocks = lanes), two per 8 scale bytes
    int32_t c = 0;
    for (; c + 2 <= nc; c += 2)
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) {
        prefetch_stream(P[r] + 64 * c, 2, Sc[r] + 4 * c, 16);
        const __m256 S = e8m0x8(load8(Sc[r] + 4 * c));
        run(r, 64 * c, c, c, bcast4x4(S, 0, 1, 2, 3), a0[r]);
        run(r, 64 * c + 64, c + 1, c + 1, bcast4x4(S, 4, 5, 6, 7), a1[r]);
      }
    if (c < nc)
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) run(r, 64 * c, c, c, bcast4x4(e8m0x8(load4(Sc[r] + 4 * c)), 0, 1, 2, 3), a0[r]);
#else
    // 64-element chunks (32 packed bytes, 2 scale blocks = lanes), four per 8 scale bytes
    int32_t c = 0;
    for (; c + 4 <= nc; c += 4)
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) {
        prefetch_stream(P[r] + 32 * c, 2, Sc[r] + 2 * c, 16);
        const __m256 S = e8m0x8(load8(Sc[r] + 2 * c));
        run(r, 32 * c, c, c / 2, bcast2x4(S, 0, 1), a0[r]);
        run(r, 32 * c + 32, c + 1, c / 2, bcast2x4(S, 2, 3), a1[r]);
        run(r, 32 * c + 64, c + 2, c / 2 + 1, bcast2x4(S, 4, 5), a0[r]);
        run(r, 32 * c + 96, c + 3, c / 2 + 1, bcast2x4(S, 6, 7), a1[r]);
      }
    if (c < nc)  // one 128-element remainder: 2 chunks, 4 scales
      CPUMOE_UNROLL
      for (int r = 0; r < R; ++r) {
        const __m256 S = e8m0x8(load4(Sc[r] + 2 * c));
        run(r, 32 * c, c, c / 2, bcast2x4(S, 0, 1), a0[r]);
        run(r, 32 * c + 32, c + 1, c / 2, bcast2x4(S, 2, 3), a1[r]);
      }
#endif
    CPUMOE_UNROLL
    for (int r = 0; r < R; ++r)
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) out[r * NT + t] = hsum(a0[r][t]) + hsum(a1[r][t]);
  }
  template <int NT>
  static CPUMOE_INLINE void dotn(const uint8_t* P, const uint8_t* Sc, float, int32_t K, const void* const* acts,
                                 float* out) {
    grid<1, NT>(&P, &Sc, K, acts, out);
  }
  template <int R>
  static CPUMOE_INLINE void dotr(const uint8_t* const* P, const uint8_t* const* Sc, const float*, int32_t K,
                                 const void* act, float* out) {
    grid<R, 1>(P, Sc, K, &act, out);
  }
};
using Dot = DotT<false>;
using DotW8 = DotT<true>;
#endif

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(ds_fp4)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVX512F
  if (k->params.mode == CPUMOE_MODE_W4A8) {
    k->act_bytes = &act_bytes_w8;
    k->prep_act = &prep_w8;
    install_fp4<DotW8>(k);
    return true;
  }
  if (k->params.mode != CPUMOE_MODE_NATIVE) return false;
  k->act_bytes = &act_bytes;
  k->prep_act = &prep;
  install_fp4<Dot>(k);
  return true;
#elif CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  if (k->params.mode != CPUMOE_MODE_W4A8) return false;  // native has no int8 x uint8 products: avx512f runs
  k->act_bytes = &act_bytes_w8;
  k->prep_act = &prep_w8;
  install_fp4<DotW8>(k);
  return true;
#else
  (void)k;
  return false;  // avxvnni / avx512bf16: nothing specific (the tier below runs)
#endif
}
