// q4_0 experts (native GGUF Q4_0, gemma-4 GGUF): gate_up [E, 2I, (H/32)*18], down [E, H, (I/32)*18], uint8.
// Block of 32 weights, 18 bytes: fp16 d (LE), then qs[16]: byte j = element j (low nibble) and element j+16
// (high nibble); w = (nibble - 8) * d. Banks (slots): 0 gate_up, 1 down. H, I multiples of 32. Blocks are 18
// bytes, so every weight load is unaligned (bank alignment 1).
//
// Modes (k->params.mode):
//  w4a8 (default, llama.cpp vec_dot_q4_0_q8_0): prep_act quantizes each 32-block of the activation to int8,
//    d_a = amax/127, id = 1/d_a (0 where not finite: amax == 0 or 1/d_a overflows), q = clamp(rint(x*id), +-127),
//    all in fp32. Per block: exact integer sum((nib-8)*q), times s = fp32(fp16(d) * d_a), summed in fp32.
//    Tiers: scalar; avx2 (vpmaddubsw + vpmaddwd); avxvnni (VEX vpdpbusd); avx512vnni (vpdpbusd, 4 blocks/zmm).
//    The SIMD tiers feed the raw nibble (0..15) as the unsigned operand and add a per-lane correction
//    -8*sum(q) from prep, so every int32 lane holds exactly sum((nib-8)*q) over its 8 elements: the same
//    integers in avx2, avxvnni and avx512vnni (this replaces llama.cpp's sign trick, |w| and sign(q, w), with
//    the same result and fewer instructions). avx2 and avxvnni agree bit for bit; avx512vnni regroups fp32 sums.
//    amx (opt-in): one AMX int8 tile product per block for up to 16 tokens (q4_0_amx.h).
//  native (W4A16): fp32 activations, per block d * sum((nib-8) * x) in fp32. Tiers: scalar, avx2, avx512f.
//
// The work-item loops are this file's own: gate_up computes a gate row and its up row together, down walks
// output rows in pairs (quads for the avx2 / avxvnni w4a8 rows), so several weight rows stream against one
// activation (shared activation loads, independent dependency chains). A row's arithmetic does not depend on how
// rows are grouped.
#include <cstring>
#include <type_traits>
#include <vector>

#include "../rowmajor.h"
#if CPUMOE_TIER == CPUMOE_T_AMX
#include "amx_common.h"  // tile configuration and route groups (q4_0_amx.h)
#endif

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 flags the AVX-512 intrinsics' internal _mm512_undefined_* operands as (maybe-)uninitialized (a known
// false positive of the headers, not of this code).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int QK = 32, QB = 18;
// Full unrolling of the small constant loops over rows (R) and pairs: without it GCC keeps the accumulator
// arrays in memory.
#if defined(__clang__)
#define Q4_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define Q4_UNROLL _Pragma("GCC unroll 8")
#else
#define Q4_UNROLL
#endif

// Software prefetch of the weight stream: prefetcht0 (locality 3) 3 KB ahead of each row's read position, 3 lines
// per 8-block step (144 bytes) so every line is covered. 3 KB t0: 95-101% of the read ceiling against ~58% without
// (one Sapphire Rapids core, gemma shape); prefetchnta stays <= 61%. The hardware streamers stop at 4 KB pages
// and the gate/up rows are two streams; far enough ahead, the prefetches hide the DRAM latency of both.
#ifndef CPUMOE_Q4_PF
#define CPUMOE_Q4_PF 3072  // build knob (bench/device/kernel_sweep.sh)
#endif
constexpr int kPrefetchBytes = CPUMOE_Q4_PF;
CPUMOE_INLINE void prefetch_ahead(const uint8_t* p, int lines = 3) {
  for (int i = 0; i < lines; ++i) __builtin_prefetch(p + kPrefetchBytes + 64 * i, 0, 3);
}
// Stream starts the in-stream distance cannot cover (as fp4_common.h's CPUMOE_FP4_AHEAD): bit 1 = a lone route's
// down prefetches the next expert group's rows while it runs this group's (an item's rows of one expert are 32
// x 396 bytes at gemma's I = 704, its streams shorter than kPrefetchBytes); bit 2 = a lone token's gate_up item
// starts by prefetching the first kPrefetchBytes of its gate and up streams. Build knob
// (bench/device/kernel_sweep.sh); 3: faster than 0 in 11 of 12 interleaved pairs on Zen 3 (2 threads, gemma batch 1).
#ifndef CPUMOE_Q4_AHEAD
#define CPUMOE_Q4_AHEAD 3
#endif

CPUMOE_INLINE uint16_t ld16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;  // x86 is little-endian, as the GGUF block is
}

#include "q4_0_q8act.h"

// ---------------------------------------------------------------------------------------------------------------
// Row kernels. Each tier defines
//   struct RowsW4A8 / RowsNative { template <int R> static void dot(const uint8_t* const* w, int K,
//                                                                   const void* act, float* out); };
// out[r] = dot(row w[r] (K/32 blocks), prepared activation act), for R = 1 or 2 rows at once.
// ---------------------------------------------------------------------------------------------------------------
#if CPUMOE_TIER == CPUMOE_T_SCALAR
CPUMOE_INLINE float dot_w4a8_scalar(const uint8_t* w, int K, const ActQ8& a) {
  float acc = 0.0f;
  for (int b = 0; b < K / QK; ++b) {
    const uint8_t* p = w + (size_t)b * QB;
    const int8_t* qb = a.q + (size_t)b * QK;  // G = 1: natural order
    int32_t s = 0;
    for (int j = 0; j < 16; ++j) s += ((p[2 + j] & 0xF) - 8) * qb[j] + ((p[2 + j] >> 4) - 8) * qb[j + 16];
    acc += (float)s * (fp16_to_f32(ld16(p)) * a.da[b]);
  }
  return acc;
}
struct RowsW4A8 {
  template <int R>
  static void dot(const uint8_t* const* w, int K, const void* act, float* out) {
    const ActQ8 a(act, K);
    Q4_UNROLL
    for (int r = 0; r < R; ++r) out[r] = dot_w4a8_scalar(w[r], K, a);
  }
};

CPUMOE_INLINE float dot_native_scalar(const uint8_t* w, int K, const float* x) {
  float acc = 0.0f;
  for (int b = 0; b < K / QK; ++b) {
    const uint8_t* p = w + (size_t)b * QB;
    const float* xb = x + (size_t)b * QK;
    float s = 0.0f;
    for (int j = 0; j < 16; ++j) s += (float)((p[2 + j] & 0xF) - 8) * xb[j];
    for (int j = 0; j < 16; ++j) s += (float)((p[2 + j] >> 4) - 8) * xb[j + 16];
    acc += fp16_to_f32(ld16(p)) * s;
  }
  return acc;
}
struct RowsNative {
  template <int R>
  static void dot(const uint8_t* const* w, int K, const void* act, float* out) {
    Q4_UNROLL
    for (int r = 0; r < R; ++r) out[r] = dot_native_scalar(w[r], K, (const float*)act);
  }
};
#endif

#if defined(__AVX2__)
// 4 fp16 d of consecutive blocks starting at p, packed into 64 bits (lowest block first). Built in
// general-purpose registers (the empty asm keeps GCC's SLP vectorizer from turning this into a dozen shuffles).
CPUMOE_INLINE uint64_t d4(const uint8_t* p) {
  uint64_t a = ld16(p), b = ld16(p + QB), c = ld16(p + 2 * QB), d = ld16(p + 3 * QB);
  __asm__("" : "+r"(a), "+r"(b), "+r"(c), "+r"(d));
  return a | b << 16 | c << 32 | d << 48;
}
// fp32 d of 8 / 4 / 1 consecutive blocks (F16C: exact, the same values as fp16_to_f32).
CPUMOE_INLINE __m256 d8_f32(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_set_epi64x((long long)d4(p + 4 * QB), (long long)d4(p)));
}
CPUMOE_INLINE __m128 d4_f32(const uint8_t* p) { return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)d4(p))); }
CPUMOE_INLINE float d1_f32(const uint8_t* p) { return _cvtsh_ss(ld16(p)); }
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
// The integer core: nibbles n = 0..15 as the unsigned operand, q as the signed one, plus the lane's correction
// -8 * sum(q): each int32 lane is exactly sum((n - 8) * q) over its 4 low-half and 4 high-half elements.
// vpmaddubsw: |n*q + n*q| <= 2*15*127 = 3810, low + high <= 7620: no int16 saturation.
CPUMOE_INLINE __m256i idot256(__m256i lo, __m256i hi, __m256i qlo, __m256i qhi, __m256i corr) {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(corr, lo, qlo), hi, qhi);
#elif CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(corr, lo, qlo), hi, qhi);
#else
  const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, qlo), _mm256_maddubs_epi16(hi, qhi));
  return _mm256_add_epi32(_mm256_madd_epi16(s, _mm256_set1_epi16(1)), corr);
#endif
}

// Activation operands of one block pair in the G = 2 layout (blocks b, b+1; qa = q + 32*b, c = corr + 4*b).
struct PairAct {
  __m256i ql, qh, c;
  CPUMOE_INLINE PairAct(const int8_t* qa, const int32_t* corr)
      : ql(_mm256_loadu_si256((const __m256i*)qa)), qh(_mm256_loadu_si256((const __m256i*)(qa + 32))),
        c(_mm256_loadu_si256((const __m256i*)corr)) {}
};
// The weight side of pair_idot (the decode, shared by every token of a multi-token call).
struct PairNib {
  __m256i lo, hi;
  CPUMOE_INLINE explicit PairNib(const uint8_t* p) {
    const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(p + 2))),
                                                _mm_loadu_si128((const __m128i*)(p + QB + 2)), 1);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
  }
};
CPUMOE_INLINE __m256i pair_idot(const PairNib& W, const PairAct& A) { return idot256(W.lo, W.hi, A.ql, A.qh, A.c); }
// Two blocks at p (36 bytes): [qs_b | qs_b+1] split once into low and high nibbles. Lanes 0-3 block b, 4-7 b+1.
CPUMOE_INLINE __m256i pair_idot(const uint8_t* p, const PairAct& A) {
  const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(p + 2))),
                                              _mm_loadu_si128((const __m128i*)(p + QB + 2)), 1);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  return idot256(_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), A.ql, A.qh, A.c);
}
// One block, natural-order q: [low nibbles | high nibbles] . q[0..31]; lanes 0-3 take the block's correction,
// so the 8 lanes sum to the block's integer dot.
CPUMOE_INLINE __m256i single_idot(const uint8_t* p, const int8_t* qa, const int32_t* corr) {
  const __m128i raw = _mm_loadu_si128((const __m128i*)(p + 2));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
  const __m256i c = _mm256_set_m128i(_mm_setzero_si128(), _mm_loadu_si128((const __m128i*)corr));
  return idot256(nib, _mm256_setzero_si256(), _mm256_loadu_si256((const __m256i*)qa), _mm256_setzero_si256(), c);
}
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
// 8-block and 4-block steps: the pairs' integer dots are reduced to ONE exact int32 per block before anything
// is converted, so the fp32 work (correction add, convert, scale FMA) is done once per 8 blocks, not per pair.
// Lanes of an 8-block step: blocks [0 2 4 6 | 1 3 5 7] (what a horizontal-add tree of the pairs [0,1], [2,3],
// [4,5], [6,7] gives); the fp16 d are gathered in that order in general registers (free), d_a is permuted once
// per token, the per-block corrections are stored in that order by prep (ActQ8::corr8). 4-block step: lanes
// [0 2 1 3] (xmm). avx2: the pairs' int16 lanes are reduced by vpmaddwd with ones and vpackssdw (see oct_sums);
// avxvnni: vpdpbusd gives int32 lanes, reduced by vphaddd.
CPUMOE_INLINE uint64_t d4_at(const uint8_t* p, int i0, int i1, int i2, int i3) {
  uint64_t a = ld16(p + i0 * QB), b = ld16(p + i1 * QB), c = ld16(p + i2 * QB), d = ld16(p + i3 * QB);
  __asm__("" : "+r"(a), "+r"(b), "+r"(c), "+r"(d));
  return a | b << 16 | c << 32 | d << 48;
}
CPUMOE_INLINE __m256 d8_oct(const uint8_t* p) {  // blocks 0 2 4 6 1 3 5 7
  return _mm256_cvtph_ps(_mm_set_epi64x((long long)d4_at(p, 1, 3, 5, 7), (long long)d4_at(p, 0, 2, 4, 6)));
}
CPUMOE_INLINE __m128 d4_quad(const uint8_t* p) {  // blocks 0 2 1 3
  return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)d4_at(p, 0, 2, 1, 3)));
}
// A pair's dot without correction: avx2 16 int16 lanes (8 per block), avxvnni 8 int32 lanes (4 per block).
CPUMOE_INLINE __m256i pair_part(const PairNib& W, const int8_t* qa) {
  const __m256i ql = _mm256_loadu_si256((const __m256i*)qa), qh = _mm256_loadu_si256((const __m256i*)(qa + 32));
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), W.lo, ql), W.hi, qh);
#else
  return _mm256_add_epi16(_mm256_maddubs_epi16(W.lo, ql), _mm256_maddubs_epi16(W.hi, qh));
#endif
}
// Two pairs (blocks 0-3) -> int32 [b0 b0 b2 b2 | b1 b1 b3 b3] (each lane a half of its block's sum).
CPUMOE_INLINE __m256i quad_halves(__m256i p0, __m256i p1) {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
  return _mm256_hadd_epi32(p0, p1);
#else
  const __m256i one = _mm256_set1_epi16(1);
  return _mm256_madd_epi16(_mm256_packs_epi32(_mm256_madd_epi16(p0, one), _mm256_madd_epi16(p1, one)), one);
#endif
}
// Four pairs (blocks 0-7) -> int32 block sums [b0 b2 b4 b6 | b1 b3 b5 b7].
CPUMOE_INLINE __m256i oct_sums(__m256i p0, __m256i p1, __m256i p2, __m256i p3) {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
  return _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
#else
  // vpmaddwd with ones then vpackssdw (the int32 sums fit int16: <= 2 * 7620 = 15240, then <= 30480), twice, and
  // a last vpmaddwd: cheaper than vphaddw on Zen3 (vphaddw is 2 cycles per instruction there, the others 1/2)
  const __m256i one = _mm256_set1_epi16(1);
  const __m256i m01 = _mm256_madd_epi16(_mm256_packs_epi32(_mm256_madd_epi16(p0, one), _mm256_madd_epi16(p1, one)), one);
  const __m256i m23 = _mm256_madd_epi16(_mm256_packs_epi32(_mm256_madd_epi16(p2, one), _mm256_madd_epi16(p3, one)), one);
  return _mm256_madd_epi16(_mm256_packs_epi32(m01, m23), one);
#endif
}

// One fp32 accumulator per (row, token): the 8-block steps (lanes = blocks in oct order), then the 4-block step
// (lanes 0-3, the upper lanes add exact zeros), the lone pair (4 lanes per block) and the odd last block; out =
// hsum256(acc). R rows x NT tokens at once (R <= 4 for one token, R * NT <= kGrid otherwise): a row's nibble
// split is done once for the NT tokens; each (row, token) pair's operations are the same whatever R and NT.
struct RowsW4A8 {
  static constexpr int kGrid = 2;
  static constexpr int kRowsDown = 4;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    const int nb = K / QK;
    const ActsQ8<NT> A(act, K);
    const auto &q = A.q, &corr = A.corr, &corr8 = A.corr8;
    const auto& da = A.da;
    __m256 acc[R][NT];
    Q4_UNROLL
    for (int r = 0; r < R; ++r)
      Q4_UNROLL
      for (int t = 0; t < NT; ++t)
        acc[r][t] = _mm256_setzero_ps();
    const __m256i oct = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    int b = 0;
    for (; b + 8 <= nb; b += 8) {  // 8 blocks (144 bytes per row): 4 pairs, one int32 per block
      __m256 dap[NT];
      __m256i c8[NT];
      Q4_UNROLL
      for (int t = 0; t < NT; ++t)
        dap[t] = _mm256_permutevar8x32_ps(_mm256_loadu_ps(da[t] + b), oct),
        c8[t] = _mm256_loadu_si256((const __m256i*)(corr8[t] + b));
      Q4_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        prefetch_ahead(p);
        const __m256 d8 = d8_oct(p);
        const PairNib W0(p), W1(p + 2 * QB), W2(p + 4 * QB), W3(p + 6 * QB);
        Q4_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int8_t* qa = q[t] + (size_t)b * QK;
          const __m256i s = _mm256_add_epi32(
              oct_sums(pair_part(W0, qa), pair_part(W1, qa + 64), pair_part(W2, qa + 128), pair_part(W3, qa + 192)),
              c8[t]);
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d8, dap[t]), acc[r][t]);  // fp16(d) * d_a
        }
      }
    }
    if (b + 4 <= nb) {  // 4 blocks: 2 pairs, one int32 per block in an xmm
      Q4_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        prefetch_ahead(p, 2);
        const __m128 d4 = d4_quad(p);
        const PairNib W0(p), W1(p + 2 * QB);
        Q4_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int8_t* qa = q[t] + (size_t)b * QK;
          const __m256i h = quad_halves(pair_part(W0, qa), pair_part(W1, qa + 64));
          const __m128i s = _mm_add_epi32(_mm_hadd_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)),
                                          _mm_loadu_si128((const __m128i*)(corr8[t] + b)));
          const __m128 dap = _mm_permute_ps(_mm_loadu_ps(da[t] + b), _MM_SHUFFLE(3, 1, 2, 0));
          const __m256 sc = _mm256_set_m128(_mm_setzero_ps(), _mm_mul_ps(d4, dap));  // upper lanes: 0 * 0
          acc[r][t] = _mm256_fmadd_ps(_mm256_set_m128(_mm_setzero_ps(), _mm_cvtepi32_ps(s)), sc, acc[r][t]);
        }
      }
      b += 4;
    }
    if (b + 2 <= nb) {  // a pair
      Q4_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        prefetch_ahead(p, 1);
        const PairNib W(p);
        const float d0 = d1_f32(p), d1 = d1_f32(p + QB);
        Q4_UNROLL
        for (int t = 0; t < NT; ++t) {
          const PairAct A(q[t] + (size_t)b * QK, corr[t] + 4 * b);
          const __m256 sc = _mm256_set_m128(_mm_set1_ps(d1 * da[t][b + 1]), _mm_set1_ps(d0 * da[t][b]));
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pair_idot(W, A)), sc, acc[r][t]);
        }
      }
      b += 2;
    }
    if (b < nb) {  // the last odd block, natural order
      Q4_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        const float d = d1_f32(p);
        Q4_UNROLL
        for (int t = 0; t < NT; ++t)
          acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(single_idot(p, q[t] + (size_t)b * QK, corr[t] + 4 * b)),
                                      _mm256_set1_ps(d * da[t][b]), acc[r][t]);
      }
    }
    Q4_UNROLL
    for (int r = 0; r < R; ++r)
      Q4_UNROLL
      for (int t = 0; t < NT; ++t) out[r * NT + t] = hsum256(acc[r][t]);
  }
};
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
// Four blocks at p (72 bytes) in one zmm, q in the G = 4 layout at qa (64 low-half bytes, 64 high-half bytes);
// int32 lanes 4j..4j+3 belong to block j and equal the avx2 path's lanes for that block.
struct QuadAct {
  __m512i ql, qh, c;
  CPUMOE_INLINE QuadAct(const int8_t* qa, const int32_t* corr)
      : ql(_mm512_loadu_si512(qa)), qh(_mm512_loadu_si512(qa + 64)), c(_mm512_loadu_si512(corr)) {}
};
// The weight side of quad_idot (shared by every token of a multi-token call): the 4 blocks' 16 qs bytes, one per
// 128-bit lane, split into low and high nibbles.
struct QuadNib {
  __m512i lo, hi;
  CPUMOE_INLINE explicit QuadNib(__m512i raw) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
  }
  CPUMOE_INLINE explicit QuadNib(const uint8_t* p) : QuadNib(load(p)) {}
  static CPUMOE_INLINE __m512i load(const uint8_t* p) {  // blocks at p (72 bytes): 4 loads, 3 inserts
    __m512i raw = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(p + 2)));
    raw = _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i*)(p + QB + 2)), 1);
    raw = _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i*)(p + 2 * QB + 2)), 2);
    return _mm512_inserti32x4(raw, _mm_loadu_si128((const __m128i*)(p + 3 * QB + 2)), 3);
  }
};
// Eight blocks at p (144 bytes) by word permutes of four in-row 64-byte windows (AVX512BW vpermt2w; every qs and d
// starts at an even byte): W0 holds blocks 0-3, W1 blocks 4-7 (from [p + 72, p + 136) and [p + 80, p + 144): never
// past the 8 blocks), d8 the 8 fp16 d (words 0, 9, 18, 27 of [p, p + 64) and of [p + 72, p + 136)). The same
// nibbles and d as two QuadNib and d8_f32, from 4 loads and 3 permutes instead of 8 loads, 6 inserts and ~20 scalar
// ops for the d: +1-3% on one Zen 4 thread, neutral on the H200 host.
struct OctNib {
  QuadNib W0, W1;
  __m256 d8;
};
CPUMOE_INLINE OctNib oct_nib(const uint8_t* p) {
  // qs word j of block k (k < 4) relative to its window pair's base: 1 + 9k + j (<= 35)
  const __m512i iq0 = _mm512_setr_epi32(0x00020001, 0x00040003, 0x00060005, 0x00080007, 0x000B000A, 0x000D000C,
                                        0x000F000E, 0x00110010, 0x00140013, 0x00160015, 0x00180017, 0x001A0019,
                                        0x001D001C, 0x001F001E, 0x00210020, 0x00230022);
  // the second block quad: its words w >= 32 (relative to p + 72) are word w - 4 of [p + 80, ...), index w + 28
  const __m512i iq1 = _mm512_mask_add_epi16(iq0, _mm512_cmpge_epu16_mask(iq0, _mm512_set1_epi16(32)), iq0,
                                            _mm512_set1_epi16(28));
  const __m512i id = _mm512_setr_epi32(0x00090000, 0x001B0012, 0x00290020, 0x003B0032, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                       0, 0, 0);
  const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64);
  const __m512i c = _mm512_loadu_si512(p + 72), d = _mm512_loadu_si512(p + 80);
  return {QuadNib(_mm512_permutex2var_epi16(a, iq0, b)), QuadNib(_mm512_permutex2var_epi16(c, iq1, d)),
          _mm256_cvtph_ps(_mm512_castsi512_si128(_mm512_permutex2var_epi16(a, id, c)))};
}
CPUMOE_INLINE __m512i quad_idot(const QuadNib& W, const QuadAct& A) {
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(A.c, W.lo, A.ql), W.hi, A.qh);
}

// R rows x NT tokens at once (R * NT <= kGrid), as the avx2 RowsW4A8: per (row, token) acc[0] (blocks 0-3 of
// each 8-block step, the 4-block step), acc[1] (blocks 4-7) and the < 4 block tail, whatever R and NT.
struct RowsW4A8 {
  static constexpr int kGrid = 4;
  template <int R, int NT>
  static void dot(const uint8_t* const* w, int K, const void* const* act, float* out) {
    const int nb = K / QK;
    const ActsQ8<NT> A(act, K);
    const auto &q = A.q, &corr = A.corr;
    const auto& da = A.da;
    __m512 acc[R][NT][2];
    __m256 tail[R][NT];
    Q4_UNROLL
    for (int r = 0; r < R; ++r)
      Q4_UNROLL
      for (int t = 0; t < NT; ++t)
        acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps(), tail[r][t] = _mm256_setzero_ps();
    const __m512i i0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i i4 = _mm512_add_epi32(i0, _mm512_set1_epi32(4));
    int b = 0;
    for (; b + 8 <= nb; b += 8) {  // 8 blocks (144 bytes per row) in two zmm
      Q4_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        prefetch_ahead(p);
        const OctNib O = oct_nib(p);
        const __m256 d8 = O.d8;
        const QuadNib &W0 = O.W0, &W1 = O.W1;
        Q4_UNROLL
        for (int t = 0; t < NT; ++t) {
          const QuadAct A0(q[t] + (size_t)b * QK, corr[t] + 4 * b), A1(q[t] + (size_t)(b + 4) * QK, corr[t] + 4 * (b + 4));
          const __m512 s8 = _mm512_castps256_ps512(_mm256_mul_ps(d8, _mm256_loadu_ps(da[t] + b)));  // lanes 0..7 read
          acc[r][t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(quad_idot(W0, A0)), _mm512_permutexvar_ps(i0, s8), acc[r][t][0]);
          acc[r][t][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(quad_idot(W1, A1)), _mm512_permutexvar_ps(i4, s8), acc[r][t][1]);
        }
      }
    }
    if (b + 4 <= nb) {
      Q4_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        prefetch_ahead(p, 2);
        const __m128 d4 = d4_f32(p);
        const QuadNib W(p);
        Q4_UNROLL
        for (int t = 0; t < NT; ++t) {
          const QuadAct A(q[t] + (size_t)b * QK, corr[t] + 4 * b);
          const __m512 s4 = _mm512_castps128_ps512(_mm_mul_ps(d4, _mm_loadu_ps(da[t] + b)));  // lanes 0..3 read
          acc[r][t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(quad_idot(W, A)), _mm512_permutexvar_ps(i0, s4), acc[r][t][0]);
        }
      }
      b += 4;
    }
    for (; b < nb; ++b)  // < 4 blocks, natural order
      Q4_UNROLL
      for (int r = 0; r < R; ++r) {
        const uint8_t* p = w[r] + (size_t)b * QB;
        const float d = d1_f32(p);
        Q4_UNROLL
        for (int t = 0; t < NT; ++t)
          tail[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(single_idot(p, q[t] + (size_t)b * QK, corr[t] + 4 * b)),
                                       _mm256_set1_ps(d * da[t][b]), tail[r][t]);
      }
    Q4_UNROLL
    for (int r = 0; r < R; ++r)
      Q4_UNROLL
      for (int t = 0; t < NT; ++t)
        out[r * NT + t] = hsum512(_mm512_add_ps(acc[r][t][0], acc[r][t][1])) + hsum256(tail[r][t]);
  }
};
#endif

#include "q4_0_native.h"  // RowsNative for avx2 / avx512f

#if CPUMOE_TIER == CPUMOE_T_AMX
#include "q4_0_amx.h"  // w4a8 on AMX int8 tiles (opt-in)
#endif

// ---------------------------------------------------------------------------------------------------------------
// Work items (abi.h semantics; the same arithmetic as rowmajor.h's loops with kRound* = false).
// ---------------------------------------------------------------------------------------------------------------
// Rows::kGrid (R * NT budget of its multi-token dot<R, NT>), or 1 for a Rows with only the per-token dot<R>.
template <class Rows, class = void>
struct GridOf : std::integral_constant<int, 1> {};
template <class Rows>
struct GridOf<Rows, std::void_t<decltype(Rows::kGrid)>> : std::integral_constant<int, Rows::kGrid> {};

// Rows::kRowsDown (how many rows its single-token dot<R, 1> takes at once in the down pass, 2 or 4), or 2.
template <class Rows, class = void>
struct RowsDownOf : std::integral_constant<int, 2> {};
template <class Rows>
struct RowsDownOf<Rows, std::void_t<decltype(Rows::kRowsDown)>> : std::integral_constant<int, Rows::kRowsDown> {};

// out[r * NT + t] = dot(w[r], act[t]).
template <class Rows, int R, int NT>
CPUMOE_INLINE void dot_rt(const uint8_t* const* w, int K, const void* const* act, float* out) {
  if constexpr (GridOf<Rows>::value > 1) {
    Rows::template dot<R, NT>(w, K, act, out);
  } else {
    for (int t = 0; t < NT; ++t) {
      float o[R];
      Rows::template dot<R>(w, K, act[t], o);
      for (int r = 0; r < R; ++r) out[r * NT + t] = o[r];
    }
  }
}
// One row against nt <= NT tokens.
template <class Rows, int NT = GridOf<Rows>::value>
CPUMOE_INLINE void row_tokens(const uint8_t* w, int K, int nt, const void* const* act, float* out) {
  if constexpr (NT > 1) {
    if (nt < NT) return row_tokens<Rows, NT - 1>(w, K, nt, act, out);
  }
  dot_rt<Rows, 1, NT>(&w, K, act, out);
}

// A lone token runs its gate and up rows together (two streams); a block of tokens runs each row against up to
// kGrid tokens, decoding each weight chunk once for all of them.
template <class Rows>
void q4_gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
                const void* const* xs, const float* w_in, uint16_t* const* g) {
  constexpr int G = GridOf<Rows>::value;
  const cpumoe_params& p = k->params;
  ActSink sink(p);  // g in SIMD lanes (common.h)
  if (CPUMOE_Q4_AHEAD & 2 && n == 1) {  // the first kPrefetchBytes of the item's gate and up streams
    const int64_t w = std::min<int64_t>(kPrefetchBytes, (int64_t)(i1 - i0) * banks[0].row_stride);
    prefetch_span(bank_row<uint8_t>(banks[0], e, i0), w), prefetch_span(bank_row<uint8_t>(banks[0], e, p.inter + i0), w);
  }
  if (n > G) {  // several token blocks: row chunks (rowmajor.h)
    gate_up_row_chunks<G>(
        i0, i1, p.inter, n,
        [&](int32_t row, int32_t j0, int nt, float* out) {
          row_tokens<Rows>(bank_row<uint8_t>(banks[0], e, row), p.hidden, nt, xs + j0, out);
        },
        gate_up_put<false>(sink, g, w_in));
    return;
  }
  for (int32_t i = i0; i < i1; ++i) {
    const uint8_t* rows[2] = {bank_row<uint8_t>(banks[0], e, i), bank_row<uint8_t>(banks[0], e, p.inter + i)};
    for (int32_t j0 = 0; j0 < n;) {
      const int nt = n - j0 < G ? n - j0 : G;
      float gate[G], up[G];
      if (nt == 1) {
        float gu[2];
        dot_rt<Rows, 2, 1>(rows, p.hidden, xs + j0, gu);
        gate[0] = gu[0], up[0] = gu[1];
      } else {
        row_tokens<Rows>(rows[0], p.hidden, nt, xs + j0, gate);
        row_tokens<Rows>(rows[1], p.hidden, nt, xs + j0, up);
      }
      for (int t = 0; t < nt; ++t, ++j0) sink.put(&g[j0][i], gate[t] * w_in[j0], up[t] * w_in[j0]);
    }
  }
}

template <class Rows>
void q4_down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
             int32_t n, float* acc, int64_t acc_stride) {
  constexpr int G = GridOf<Rows>::value;
  const int K = k->params.inter;
  for (int32_t a = 0; a < n;) {
    int32_t b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    const int32_t e = routes[a].expert;
    if (G > 1 && b - a > 1) {  // several routes: each row against blocks of up to G routes
      for (int32_t h = h0; h < h1; ++h) {
        const uint8_t* w = bank_row<uint8_t>(banks[1], e, h);
        for (int32_t r0 = a; r0 < b; r0 += G) {
          const int nt = b - r0 < G ? b - r0 : G;
          const void* acts[G];
          float y[G];
          for (int t = 0; t < nt; ++t) acts[t] = routes[r0 + t].act;
          row_tokens<Rows>(w, K, nt, acts, y);
          for (int t = 0; t < nt; ++t) acc[routes[r0 + t].token * acc_stride + (h - h0)] += y[t] * routes[r0 + t].weight;
        }
      }
      a = b;
      continue;
    }
    int32_t h = h0;  // one route (or a Rows without multi-token dots): rows in split quads (kRowsDown = 4) / pairs
    // CPUMOE_Q4_AHEAD bit 1: rows [h0, h1) of an expert are one contiguous span; the call's first group fetches
    // its own (no predecessor did), every group fetches the next group's rows as it reaches the same rows
    const int64_t rs = banks[1].row_stride;
    const uint8_t* next = CPUMOE_Q4_AHEAD & 1 && b < n ? bank_row<uint8_t>(banks[1], routes[b].expert, 0) : nullptr;
    if (CPUMOE_Q4_AHEAD & 1 && a == 0) prefetch_span(bank_row<uint8_t>(banks[1], e, h0), (h1 - h0) * rs);
    if constexpr (RowsDownOf<Rows>::value == 4) {
      // quads of two far-apart row pairs (h, h+1, h+half, h+half+1): two weight streams in flight. On the Zen 3
      // dev VM this beat adjacent quads in 4 of 4 A/B rounds (~64-71 % -> ~65-79 % of the read ceiling).
      const int32_t half = (h1 - h0) / 2 & ~1;
      for (; h < h0 + half; h += 2) {
        if (next) prefetch_span(next + h * rs, 2 * rs), prefetch_span(next + (h + half) * rs, 2 * rs);
        const uint8_t* rows[4] = {bank_row<uint8_t>(banks[1], e, h), bank_row<uint8_t>(banks[1], e, h + 1),
                                  bank_row<uint8_t>(banks[1], e, h + half),
                                  bank_row<uint8_t>(banks[1], e, h + half + 1)};
        for (int32_t r = a; r < b; ++r) {
          float y[4];
          dot_rt<Rows, 4, 1>(rows, K, &routes[r].act, y);
          float* o = acc + routes[r].token * acc_stride + (h - h0);
          o[0] += y[0] * routes[r].weight, o[1] += y[1] * routes[r].weight;
          o[half] += y[2] * routes[r].weight, o[half + 1] += y[3] * routes[r].weight;
        }
      }
      h = h0 + 2 * half;  // < 4 rows left: the pair / single loops below
    }
    for (; h + 2 <= h1; h += 2) {
      if (next) prefetch_span(next + h * rs, 2 * rs);
      const uint8_t* rows[2] = {bank_row<uint8_t>(banks[1], e, h), bank_row<uint8_t>(banks[1], e, h + 1)};
      for (int32_t r = a; r < b; ++r) {
        float y[2];
        dot_rt<Rows, 2, 1>(rows, K, &routes[r].act, y);
        float* o = acc + routes[r].token * acc_stride + (h - h0);
        o[0] += y[0] * routes[r].weight;
        o[1] += y[1] * routes[r].weight;
      }
    }
    if (h < h1) {
      if (next) prefetch_span(next + h * rs, rs);
      const uint8_t* rows[1] = {bank_row<uint8_t>(banks[1], e, h)};
      for (int32_t r = a; r < b; ++r) {
        float y;
        dot_rt<Rows, 1, 1>(rows, K, &routes[r].act, &y);
        acc[routes[r].token * acc_stride + (h - h0)] += y * routes[r].weight;
      }
    }
    a = b;
  }
}

template <class Rows>
void install(cpumoe_kernel* k) {
  k->gate_up = &q4_gate_up<Rows>;
  k->down = &q4_down<Rows>;
}

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(q4_0)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
  const bool w4a8 = k->params.mode == CPUMOE_MODE_W4A8;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2
  if (w4a8) {
    k->act_bytes = &act_bytes_q8;
    k->prep_act = &prep_act_q8<CPUMOE_TIER == CPUMOE_T_AVX2 ? 2 : 1>;
    install<RowsW4A8>(k);
  } else {
    k->act_bytes = &act_bytes_f32;
    k->prep_act = &prep_act_f32;
    install<RowsNative>(k);
  }
  return true;
#elif CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  if (!w4a8) return false;  // native has no int8 work: the tier below runs (avx2 / avx512f)
  k->act_bytes = &act_bytes_q8;
  k->prep_act = &prep_act_q8<CPUMOE_TIER == CPUMOE_T_AVX512VNNI ? 4 : 2>;
  install<RowsW4A8>(k);
  return true;
#elif CPUMOE_TIER == CPUMOE_T_AVX512F
  if (w4a8) return false;  // w4a8 without VNNI: avxvnni (if the CPU has it) or avx2 runs
  k->act_bytes = &act_bytes_f32;
  k->prep_act = &prep_act_f32;
  install<RowsNative>(k);
  return true;
#elif CPUMOE_TIER == CPUMOE_T_AMX
  if (!w4a8) return false;  // native: avx512f runs
  k->act_bytes = &act_bytes_q8;
  k->prep_act = &prep_act_q8<1>;  // natural order: a token's block is one 32-byte A row
  k->gate_up = &amx4::gate_up;
  k->down = &amx4::down;
  return true;
#else
  (void)k;
  (void)w4a8;
  return false;  // avx512bf16: nothing bf16-specific; avx512vnni (w4a8) / avx512f (native) run
#endif
}
