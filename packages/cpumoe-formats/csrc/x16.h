// Work-item loops shared by the "_x16" CPU layouts (q4_0_x16, ds_fp4_x16, fp8_block_x16): a bank row is a group
// of 16 weight rows interleaved so that the 16 lanes of one vector are 16 rows. A layout supplies only its group
// dot:
//
//   struct G16 {
//     static constexpr int kMaxNT;       // tokens per group call (1..8)
//     static constexpr int64_t kPf;      // bytes of a stream's start fetched first for a lone token / route
//     static constexpr int kSlot[2];     // the code bank of gate_up (mat 0) and of down (mat 1)
//     struct Ref { const uint8_t* w; ... };  // one group of one expert: its code stream and what else it reads
//     static Ref ref(const cpumoe_kernel* k, const cpumoe_bank* banks, int mat, int32_t e, int32_t group);
//     // out[(g * NT + t) * 16 + r] = dot(row r of group gp[g], token t), for G groups and NT tokens
//     template <int G, int NT> static void groups(const Ref* gp, int K, const void* const* act, float* out);
//     struct Scope;  // optional: constructed at a work item's start, destroyed at its end (AMX: tile release)
//     // optional, default false (rowmajor.h's names; ds_fp4_x16 sets both):
//     static constexpr bool kRoundGateUp;    // gate and up (times w_in) rounded to bf16 before the activation
//     static constexpr bool kRoundRouteTerm; // each route's down term (dot times weight) rounded to bf16 before
//   };                                       // the sum over routes
// Ref may carry `const uint16_t* bias`, the group's 16 bf16 biases (mxfp4_x16): then gate/up are (dot + bias) *
// w_in and a route's down term (dot + bias) * weight, mxfp4's order.
//
// Contract of groups: each (row, token) result depends only on its row, its token and K, never on G, NT or the
// other rows and tokens of the call, so a token's output does not depend on its batch (test_batch_identity).
// Ragged row ranges compute whole groups and write only their own rows.
#pragma once
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>

#include "rowmajor.h"
#include "tiers.h"  // x16_prefetch

// The tiers whose group dots use 32 zmm registers (8 tokens per call): avx512vnni, and avx512bf16 where a layout
// installs it for that tier's VBMI (fp4_common.h nib_lo512: nvfp4_x16, ds_fp4_x16, mxfp4_x16).
#define CPUMOE_X16_ZMM (CPUMOE_TIER == CPUMOE_T_AVX512VNNI || CPUMOE_TIER == CPUMOE_T_AVX512BF16)

namespace cpumoe {
namespace CPUMOE_NS {
namespace x16 {
constexpr int GR = 16;  // rows per group

// L::kRoundGateUp / L::kRoundRouteTerm, false where the layout does not declare them (q4_0_x16: the same code as
// before the traits, bit for bit).
template <class L, class = void>
struct RoundGateUp : std::false_type {};
template <class L>
struct RoundGateUp<L, std::void_t<decltype(L::kRoundGateUp)>> : std::bool_constant<L::kRoundGateUp> {};
template <class L, class = void>
struct RoundRouteTerm : std::false_type {};
template <class L>
struct RoundRouteTerm<L, std::void_t<decltype(L::kRoundRouteTerm)>> : std::bool_constant<L::kRoundRouteTerm> {};

// L::Ref::bias present (mxfp4_x16)
template <class L, class = void>
struct HasBias : std::false_type {};
template <class L>
struct HasBias<L, std::void_t<decltype(std::declval<typename L::Ref>().bias)>> : std::true_type {};

// A row's dot plus its bias where the layout has biases (else the dot unchanged, bit for bit).
template <class L>
CPUMOE_INLINE float with_bias(float v, const typename L::Ref& gp, int r) {
  if constexpr (HasBias<L>::value) v += bf16_to_f32(gp.bias[r]);
  return v;
}

// L::Scope, or an empty scope where the layout needs no per-work-item state (all but fp8_block_x16's amx tier).
struct NoScope {};
template <class L, class = void>
struct ScopeOf {
  using type = NoScope;
};
template <class L>
struct ScopeOf<L, std::void_t<typename L::Scope>> {
  using type = typename L::Scope;
};

// NT tokens' int8 activation records (q4_0_x16, nvfp4_x16, ds_fp4_x16, mxfp4_x16): per QB-element block its QB
// int8 codes, then its float scale and its int32 correction, kStride bytes, so one pointer per token reaches all
// three at fixed displacements. The group loops advance() the pointers by the blocks of a step (one block, or
// nvfp4_x16's chunk of 4) and address the step's blocks by displacement. At 8 tokens a three-array record
// (Int8Toks) needs 24 bases: GCC 12 kept 8 in registers, the others on the stack or in xmm registers (7 vmovq to a
// GPR, vector ALU uops, per 16-block) and addressed the scales as base + index (un-laminated at rename). H200 host,
// nvfp4 shared batch 8, 4 interleaved rounds: 218-257 -> 212-230 us.
template <int NT, int QB>
struct BlockToks {
  static constexpr int kStride = QB + 8;
  const int8_t* p[NT];
  CPUMOE_INLINE explicit BlockToks(const void* const* act) {
    for (int t = 0; t < NT; ++t) p[t] = (const int8_t*)act[t];
  }
  CPUMOE_INLINE const int8_t* q(int t, int b) const { return p[t] + (size_t)b * kStride; }
  CPUMOE_INLINE const float* s(int t, int b) const { return (const float*)(q(t, b) + QB); }
  CPUMOE_INLINE const int32_t* corr(int t, int b) const { return (const int32_t*)(q(t, b) + QB + 4); }
  // On by n blocks; the empty asm keeps each pointer its own register (no shared index for IVopts to build)
  CPUMOE_INLINE void advance(int n) {
    for (int t = 0; t < NT; ++t) {
      p[t] += (size_t)n * kStride;
      __asm__("" : "+r"(p[t]));
    }
  }
};

// A block record's scale and correction, after its QB codes at tail (the layouts' prep_act).
CPUMOE_INLINE void put_block_tail(int8_t* tail, float s, int32_t corr) {
  std::memcpy(tail, &s, 4);
  std::memcpy(tail + 4, &corr, 4);
}

// The size of one token's record (the layouts' act_bytes): K / QB block records.
template <int QB>
size_t int8_record_bytes(const cpumoe_kernel*, int32_t K) {
  return (size_t)(K / QB) * BlockToks<1, QB>::kStride;
}

// One token's records by the Q8_0 rule per 32 (common.h q8_block32 / q8_block: q4_0's and mxfp4's w4a8 codes and
// scale, bit for bit) with corr = kCorr * sum(q_b): q4_0_x16 (-8, its raw nibbles' offset) and mxfp4_x16 (-12,
// u's offset). ds_fp4_x16 and nvfp4_x16 quantize by their own formats' rules.
template <int kCorr>
void q8_records(const uint16_t* src, int32_t K, void* dst) {
  constexpr int QK = 32;
  for (int32_t b = 0; b < K / QK; ++b) {
    const uint16_t* s = src + (size_t)b * QK;
    int8_t* qb = (int8_t*)dst + (size_t)b * BlockToks<1, QK>::kStride;
    float d;
    int32_t sum = 0;
#if defined(__AVX2__)
    const __m256 x[4] = {bf16x8_f32(s), bf16x8_f32(s + 8), bf16x8_f32(s + 16), bf16x8_f32(s + 24)};
    const __m256i v = q8_block32(x, &d);  // q8_block's codes and d, bit for bit
    _mm256_storeu_si256((__m256i*)qb, v);
    sum = hsum8_i32(sum4_i8(v));
#else
    float x[QK];
    for (int j = 0; j < QK; ++j) x[j] = bf16_to_f32(s[j]);
    d = q8_block(x, QK, qb);
    for (int j = 0; j < QK; ++j) sum += qb[j];
#endif
    put_block_tail(qb + QK, d, kCorr * sum);
  }
}

// The 16-register tiers' group passes (one half of the rows at a time): n lines of a block step at p. The first
// half's pass prefetches `ahead` bytes on into L1; the second half's, whose lines are in L1/L2 already, the same
// lines of the next group (`next` bytes on: the bank's next row) into L2, so DRAM is not idle during it.
#ifndef CPUMOE_X16_PF_LOC
#define CPUMOE_X16_PF_LOC 3
#endif
// The 16-register tiers' one-token passes (both halves, G groups side by side): n lines of a block step at p,
// CPUMOE_X16_PF_ONE bytes ahead. 1536: q4_0_x16 batch 1 672-689 us against 882-972 with none (Zen 3 VM, 2 threads).
#ifndef CPUMOE_X16_PF_ONE
#define CPUMOE_X16_PF_ONE 1536
#endif
// The GGUF layouts' software prefetch on avx512vnni (q4_0_x16, q4_k_x16, q6_k_x16, q8_0_x16): the group dots take
// kSwPf, and the tier's init installs the kSwPf = true or false kernels by CPUMOE_X16_PREFETCH (tiers.h
// x16_prefetch(): auto is off on AMD, on elsewhere), so the choice is made once per kernel and the block loops hold
// no branch for it. Off, the streams run on the hardware prefetchers alone: prefetcht0 3 KB ahead held Zen 4 cores
// below them (q4_0_x16 qwen3-30b batch 1 from DRAM, 2 threads: 70% of the read ceiling with it, 80-82% without),
// where a Xeon's read less (q4_k_x16, 15 threads: 195 us a step with it, 218 without). The other tiers always
// prefetch (kSwPf = true).
constexpr int64_t gguf_pf(bool sw_pf, int64_t d) { return sw_pf ? d : 0; }
// True where this tier's GGUF x16 kernels are to prefetch: always below avx512vnni, CPUMOE_X16_PREFETCH's choice on it.
CPUMOE_INLINE bool gguf_sw_prefetch() { return CPUMOE_TIER != CPUMOE_T_AVX512VNNI || ::cpumoe::x16_prefetch() != 0; }
CPUMOE_INLINE void prefetch_one_token(const uint8_t* p, int n) {
  for (int l = 0; l < n; ++l) __builtin_prefetch(p + CPUMOE_X16_PF_ONE + 64 * l, 0, 3);
}
CPUMOE_INLINE void prefetch_half_pass(const uint8_t* p, int n, bool first_half, int64_t ahead, size_t next) {
  for (int l = 0; l < n; ++l) {
    if (first_half)
      __builtin_prefetch(p + ahead + 64 * l, 0, CPUMOE_X16_PF_LOC);
    else
      __builtin_prefetch(p + next + 64 * l, 0, 2);
  }
}

#if defined(__AVX2__)
// The 4 bytes at p in every dword lane, by a broadcast load (vpbroadcastd m32: a load uop, no vector ALU uop).
// _mm256_set1_epi32 of the value copied out of a token's record compiled (GCC 12) to a 64-bit GPR load, shifts,
// vmovd and a register vpbroadcastd: two vector ALU uops per broadcast, 8 broadcasts per block and token.
// CPUMOE_X16_NO_ASM (only the SIMDe checks, tests/batch_simde, define it): this and the {1to16} helpers below as
// plain intrinsics, the same results, so the AVX-512 tiers can run emulated on a CPU without AVX-512.
CPUMOE_INLINE __m256i bcast4(const void* p) {
#ifdef CPUMOE_X16_NO_ASM
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
#else
  __m256i r;
  __asm__("vpbroadcastd %1, %0" : "=x"(r) : "m"(*(const int32_t*)p));
  return r;
#endif
}

// The layouts' one-token asm blocks (AVX2, q4_0_x16 and nvfp4_x16). NIBBLES: the 32 code bytes at A (rows 0-7) and
// at B (rows 8-15), masked by %[m] (0x0F): ymm0 / ymm2 their low nibbles, ymm1 / ymm3 their high ones.
#define CPUMOE_X16_ASM_NIBBLES(A, B) \
  "vpand " A ", %[m], %%ymm0\n\t"     \
  "vpandn " A ", %[m], %%ymm1\n\t"    \
  "vpand " B ", %[m], %%ymm2\n\t"     \
  "vpandn " B ", %[m], %%ymm3\n\t"    \
  "vpsrlw $4, %%ymm1, %%ymm1\n\t"     \
  "vpsrlw $4, %%ymm3, %%ymm3\n\t"
// MADD4: ymm0 / ymm1 rows 0-7's unsigned codes that meet the token's dword in ymm4 / ymm5, ymm2 / ymm3 rows
// 8-15's; vpmaddubsw each, and each half's two products summed into (FIRST = CPUMOE_X16_ASM_FIRST) or onto
// (CPUMOE_X16_ASM_NEXT) its int16 run %[s0] / %[s1].
#define CPUMOE_X16_ASM_MADD4(FIRST)                                                                        \
  "vpmaddubsw %%ymm4, %%ymm0, %%ymm0\n\t"                                                                   \
  "vpmaddubsw %%ymm5, %%ymm1, %%ymm1\n\t"                                                                   \
  "vpmaddubsw %%ymm4, %%ymm2, %%ymm2\n\t"                                                                   \
  "vpmaddubsw %%ymm5, %%ymm3, %%ymm3\n\t"                                                                   \
  FIRST("vpaddw %%ymm1, %%ymm0, %[s0]\n\t", "vpaddw %%ymm1, %%ymm0, %%ymm0\n\tvpaddw %%ymm0, %[s0], %[s0]\n\t") \
  FIRST("vpaddw %%ymm3, %%ymm2, %[s1]\n\t", "vpaddw %%ymm3, %%ymm2, %%ymm2\n\tvpaddw %%ymm2, %[s1], %[s1]\n\t")
#define CPUMOE_X16_ASM_FIRST(a, b) a
#define CPUMOE_X16_ASM_NEXT(a, b) b
// int16 ones for vpmaddwd as a memory operand (the one-token asm blocks)
alignas(32) inline constexpr int16_t kOnes16[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

// The 16-register tiers' multi-token pass frame over rows 8h..8h+7 of a group (q4_0_x16's and e2m1_x16's half_pass):
// NT accumulators, block by block (gb bytes a block at w, 5 lines prefetched `ahead` on, or the next group's in the
// second half's pass); block(b, p, a, acc) adds block b (at p; a: the tokens' records) to acc; out[t * 16 + r].
template <int NT, int QB, class Block>
CPUMOE_INLINE void half_pass_blocks(const uint8_t* w, int nb, int gb, int h, int64_t ahead, const void* const* act,
                                    float* out, const Block& block) {
  __m256 acc[NT];
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const BlockToks<NT, QB> a(act);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* p = w + (size_t)b * gb;
    prefetch_half_pass(p, 5, h == 0, ahead, (size_t)nb * gb);
    block(b, p, a, acc);
  }
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + (size_t)t * GR, acc[t]);
}

// The 16-register tiers' one-token pass over G groups (gate and up, or a lone route's two halves of the groups):
// block by block, the G groups side by side, so G streams are in flight (one stream at a time left a Zen 3 core
// waiting on DRAM: q4_0_x16 batch 1 read 77-82% of the ceiling, 93-94% side by side). block(b, g, acc0, acc1) adds
// block b of group g to its rows 0-7 / 8-15; out gets the G groups' 16 sums each.
template <int G, class Block>
CPUMOE_INLINE void one_token_groups(int nb, const Block& block, float* out) {
  __m256 acc[G][2];
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b)
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) block(b, g, acc[g][0], acc[g][1]);
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + (size_t)g * GR + 8 * h, acc[g][h]);
}

#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
// AVX-VNNI's exact int32 sum of one 32-block for 8 rows (q4_0_x16, e2m1_x16):
//   corr + sum over j < 4 of dot(lo[j], qa[4j..4j+3]) + dot(hi[j], qa[16+4j..16+4j+3])
// per dword lane (a row), lo / hi its unsigned codes of elements 4j.. and 16+4j.., qa the token's 32 int8 codes;
// vpdpbusd in two chains. (avx2 forms the same integers code step by code step: maddubs_pair.)
CPUMOE_INLINE __m256i block32_sum(const __m256i* lo, const __m256i* hi, const int8_t* qa, int32_t corr) {
  __m256i s0 = _mm256_set1_epi32(corr), s1 = _mm256_setzero_si256();
  CPUMOE_UNROLL
  for (int j = 0; j < 4; ++j) {
    s0 = _mm256_dpbusd_avx_epi32(s0, lo[j], bcast4(qa + 4 * j));
    s1 = _mm256_dpbusd_avx_epi32(s1, hi[j], bcast4(qa + 16 + 4 * j));
  }
  return _mm256_add_epi32(s0, s1);
}
#elif CPUMOE_TIER == CPUMOE_T_AVX2
// One code step of the avx2 multi-token passes (q4_0_x16, e2m1_x16, nvfp4_x16 half_pass): the unsigned codes lo /
// hi of 8 rows against the token's 4 int8 codes at qlo / qhi, vpmaddubsw each, the two int16 pair sums added (the
// caller bounds the int16 run: codes <= 24 and |q| <= 127 give <= 2 * 2 * 24 * 127 = 12192 here).
CPUMOE_INLINE __m256i maddubs_pair(__m256i lo, __m256i hi, const int8_t* qlo, const int8_t* qhi) {
  return _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(qlo)), _mm256_maddubs_epi16(hi, bcast4(qhi)));
}
#endif
#endif
#if defined(__AVX512VNNI__)
// acc + dot(w's unsigned bytes, the signed 4 bytes at q broadcast), the broadcast folded into the instruction
// ({1to16}): one uop where the intrinsic pair (a broadcast load, then vpdpbusd) is two; GCC 12 does not fold it.
CPUMOE_INLINE __m512i dpbusd_bcast(__m512i acc, __m512i w, const int32_t* q) {
#ifdef CPUMOE_X16_NO_ASM
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(*q));
#else
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*q));
  return acc;
#endif
}
#endif
#if defined(__AVX512F__)
// v * (the float at p, broadcast), likewise folded
CPUMOE_INLINE __m512 mul_bcast(__m512 v, const float* p) {
#ifdef CPUMOE_X16_NO_ASM
  return _mm512_mul_ps(v, _mm512_set1_ps(*p));
#else
  __m512 r;
  __asm__("vmulps %2%{1to16%}, %1, %0" : "=v"(r) : "v"(v), "m"(*p));
  return r;
#endif
}
#endif

#if defined(__AVX512BF16__) && !defined(CPUMOE_X16_NO_ASM)
// acc + the 32 products of w's bf16 pairs with the pair at q broadcast, folded into the instruction ({1to16})
// (No CPUMOE_X16_NO_ASM form: no SIMDe check builds a bf16 layout's avx512bf16 tier, so one would never compile.)
CPUMOE_INLINE __m512 dpbf16_bcast(__m512 acc, __m512i w, const int32_t* q) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*q));
  return acc;
}
#endif
// One step of vdpbf16ps in scalar (the bf16 layouts' reference tier): the product is exact in fp32, so fma rounds
// once as the instruction does; a subnormal operand or result is zero there (DAZ, FTZ).
CPUMOE_INLINE float daz(float v) { return std::fabs(v) < FLT_MIN ? std::copysign(0.0f, v) : v; }
CPUMOE_INLINE float dp_step(float w, uint16_t x, float c) { return daz(std::fma(w, daz(bf16_to_f32(x)), daz(c))); }

// groups<G, nt> for a run-time nt in [1, kMaxNT].
template <class L, int G, int NT = L::kMaxNT>
CPUMOE_INLINE void groups_n(const typename L::Ref* gp, int K, int nt, const void* const* act, float* out) {
  if constexpr (NT > 1) {
    if (nt < NT) return groups_n<L, G, NT - 1>(gp, K, nt, act, out);
  }
  L::template groups<G, NT>(gp, K, act, out);
}

// Rows [i0, i1) of gate and up: the groups that hold them, whole.
template <class L>
void gate_up(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t e, int32_t i0, int32_t i1, int32_t n,
             const void* const* xs, const float* w_in, uint16_t* const* g) {
  const cpumoe_params& p = k->params;
  const int32_t I = p.inter;
  [[maybe_unused]] typename ScopeOf<L>::type scope;
  ActSink sink(p);
  {  // the first bytes of the gate and up streams (their in-stream prefetch starts further in)
    const int64_t w = std::min<int64_t>(L::kPf, (int64_t)((i1 - 1) / GR - i0 / GR + 1) * banks[L::kSlot[0]].row_stride);
    prefetch_span(L::ref(k, banks, 0, e, i0 / GR).w, w);
    prefetch_span(L::ref(k, banks, 0, e, I / GR + i0 / GR).w, w);
  }
  for (int32_t gi = i0 / GR; gi * GR < i1; ++gi) {
    const typename L::Ref gp[2] = {L::ref(k, banks, 0, e, gi), L::ref(k, banks, 0, e, I / GR + gi)};
    const int32_t r0 = std::max(i0, gi * GR) - gi * GR, r1 = std::min(i1, gi * GR + GR) - gi * GR;
    for (int32_t j0 = 0; j0 < n; j0 += L::kMaxNT) {
      const int nt = std::min<int32_t>(L::kMaxNT, n - j0);
      alignas(64) float o[2 * L::kMaxNT * GR];  // the gate group's nt x 16 sums, then the up group's
      const float *gate = o, *up = o + nt * GR;
      if (nt == 1) {  // a lone token: the gate and up groups as two streams
        L::template groups<2, 1>(gp, p.hidden, xs + j0, o);
      } else {
        groups_n<L, 1>(&gp[0], p.hidden, nt, xs + j0, o);
        groups_n<L, 1>(&gp[1], p.hidden, nt, xs + j0, o + nt * GR);
      }
      for (int t = 0; t < nt; ++t)
        for (int32_t r = r0; r < r1; ++r) {
          float gt = with_bias<L>(gate[t * GR + r], gp[0], r) * w_in[j0 + t];
          float ut = with_bias<L>(up[t * GR + r], gp[1], r) * w_in[j0 + t];
          if constexpr (RoundGateUp<L>::value) gt = round_bf16(gt), ut = round_bf16(ut);
          sink.put(&g[j0 + t][gi * GR + r], gt, ut);
        }
    }
  }
}

#if defined(__AVX2__)
// 8 floats rounded to bf16 (as floats): cpumoe_f32_to_bf16 lane by lane, NaN kept quiet with its sign
CPUMOE_INLINE __m256 round_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v), hi = _mm256_set1_epi32((int)0xFFFF0000u);
  const __m256i rne = _mm256_and_si256(bf16_rne_biased(u), hi);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  const __m256i qnan = _mm256_and_si256(_mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), hi);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(rne, qnan, nan));
}
#endif

// acc[token][h - h0] += weight * (o + bias) for group g's rows inside [h0, h1) (gp: its Ref), tokens t < nt of o's
// group slot gg (the term rounded to bf16 first where the layout rounds route terms). A group wholly inside the
// range (all but an item's ragged ends) goes 8 rows at a time: the same fp32 operations lane by lane (at 8 tokens
// the scalar loop was ~1/5 of a down item's instructions on AVX-512).
template <class L>
CPUMOE_INLINE void add_rows(const float* o, int gg, int nt, const typename L::Ref& gp, int32_t g, int32_t h0,
                            int32_t h1, const cpumoe_route* rts, float* acc, int64_t acc_stride) {
  const int32_t base = g * GR, r0 = std::max(h0, base) - base, r1 = std::min(h1, base + GR) - base;
#if defined(__AVX2__)
  if (r0 == 0 && r1 == GR) {
    for (int t = 0; t < nt; ++t) {
      float* dst = acc + rts[t].token * acc_stride + base - h0;
      const __m256 w = _mm256_set1_ps(rts[t].weight);
      CPUMOE_UNROLL
      for (int h = 0; h < GR; h += 8) {
        __m256 v = _mm256_loadu_ps(o + (gg * nt + t) * GR + h);
        if constexpr (HasBias<L>::value) v = _mm256_add_ps(v, bf16x8_f32(gp.bias + h));
        v = _mm256_mul_ps(v, w);
        if constexpr (RoundRouteTerm<L>::value) v = round_bf16x8(v);
        _mm256_storeu_ps(dst + h, _mm256_add_ps(_mm256_loadu_ps(dst + h), v));
      }
    }
    return;
  }
#endif
  for (int t = 0; t < nt; ++t) {
    float* dst = acc + rts[t].token * acc_stride;
    for (int32_t r = r0; r < r1; ++r) {
      float v = with_bias<L>(o[(gg * nt + t) * GR + r], gp, r) * rts[t].weight;
      if constexpr (RoundRouteTerm<L>::value) v = round_bf16(v);
      dst[base + r - h0] += v;
    }
  }
}

// acc[token][h - h0] += weight * dot, route by route in their order for each (token, h).
template <class L>
void down(const cpumoe_kernel* k, const cpumoe_bank* banks, int32_t h0, int32_t h1, const cpumoe_route* routes,
          int32_t n, float* acc, int64_t acc_stride) {
  const int K = k->params.inter;
  const int32_t g0 = h0 / GR, g1 = (h1 + GR - 1) / GR;  // the groups the rows touch
  const int64_t rs = banks[L::kSlot[1]].row_stride;
  [[maybe_unused]] typename ScopeOf<L>::type scope;
  for (int32_t a = 0; a < n;) {
    int32_t b = a + 1;
    while (b < n && routes[b].expert == routes[a].expert) ++b;
    const int32_t e = routes[a].expert;
    alignas(64) float o[2 * L::kMaxNT * GR];
    if (b - a == 1) {
      // a lone route: two streams, the first and the second half of the groups, so each stream's prefetch runs
      // on into its own next group; each stream's start is fetched first (an item's rows of one expert are short)
      const int32_t half = (g1 - g0) / 2;
      const cpumoe_route* rt = routes + a;
      prefetch_span(L::ref(k, banks, 1, e, g0).w, std::min<int64_t>(L::kPf, (g1 - g0) * rs));
      if (half) prefetch_span(L::ref(k, banks, 1, e, g0 + half).w, std::min<int64_t>(L::kPf, rs));
      for (int32_t i = 0; i < half; ++i) {
        const typename L::Ref gp[2] = {L::ref(k, banks, 1, e, g0 + i), L::ref(k, banks, 1, e, g0 + half + i)};
        L::template groups<2, 1>(gp, K, &rt->act, o);
        add_rows<L>(o, 0, 1, gp[0], g0 + i, h0, h1, rt, acc, acc_stride);
        add_rows<L>(o, 1, 1, gp[1], g0 + half + i, h0, h1, rt, acc, acc_stride);
      }
      if ((g1 - g0) % 2) {
        const typename L::Ref gp = L::ref(k, banks, 1, e, g1 - 1);
        L::template groups<1, 1>(&gp, K, &rt->act, o);
        add_rows<L>(o, 0, 1, gp, g1 - 1, h0, h1, rt, acc, acc_stride);
      }
    } else {  // the expert's rows as one stream, its start fetched first as for a lone route
      prefetch_span(L::ref(k, banks, 1, e, g0).w, std::min<int64_t>(L::kPf, (g1 - g0) * rs));
      for (int32_t g = g0; g < g1; ++g) {
        const typename L::Ref gp = L::ref(k, banks, 1, e, g);
        for (int32_t q0 = a; q0 < b; q0 += L::kMaxNT) {
          const int nt = std::min<int32_t>(L::kMaxNT, b - q0);
          const void* acts[L::kMaxNT];
          for (int t = 0; t < nt; ++t) acts[t] = routes[q0 + t].act;
          groups_n<L, 1>(&gp, K, nt, acts, o);
          add_rows<L>(o, 0, nt, gp, g, h0, h1, routes + q0, acc, acc_stride);
        }
      }
    }
    a = b;
  }
}

// A layout's kernel entry points for its one mode: its activation record, then x16's loops over its group dot.
// False (nothing set) for another mode.
template <class L>
CPUMOE_INLINE bool install(cpumoe_kernel* k, int mode, cpumoe_act_bytes_fn act_bytes, cpumoe_prep_act_fn prep_act) {
  if (k->params.mode != mode) return false;
  k->act_bytes = act_bytes;
  k->prep_act = prep_act;
  k->gate_up = &gate_up<L>;
  k->down = &down<L>;
  return true;
}

// install<L>, or on avx512vnni install<LNoPf> where CPUMOE_X16_PREFETCH turns the GGUF layouts' software prefetch off
// (gguf_sw_prefetch). LNoPf is instantiated on that tier only; a layout that always prefetches leaves LNoPf = L.
template <class L, class LNoPf = L>
CPUMOE_INLINE bool install_pf(cpumoe_kernel* k, int mode, cpumoe_act_bytes_fn act_bytes, cpumoe_prep_act_fn prep_act) {
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  if constexpr (!std::is_same_v<L, LNoPf>)
    if (!gguf_sw_prefetch()) return install<LNoPf>(k, mode, act_bytes, prep_act);
#endif
  return install<L>(k, mode, act_bytes, prep_act);
}

}  // namespace x16
}  // namespace CPUMOE_NS
}  // namespace cpumoe
