// nvfp4_x16: nvfp4 experts with 16 rows interleaved per 16-block, for CPUs (docs/formats/nvfp4.md "nvfp4_x16").
// Banks (slots): 0 gate_up [E, 2I/16, (H/16)*144] u8, 1 gate_up_global [E, 2I/16, 16] fp16, 2 down [E, H/16,
// (I/16)*144] u8, 3 down_global [E, H/16, 16] fp16. A bank row is a group of 16 weight rows. Its 16-blocks come
// in chunks of 4 (the last chunk holds nb % 4 when that is not 0): a chunk of cb blocks is cb x 16 e4m3 scales
// (block i's row r at 16 i + r), then cb x 128 code bytes: block i's two 64-byte vectors at 16 cb + 128 i + 64 j,
// whose int32 lane r is row r's nvfp4 packed bytes 4j..4j+3 (elements 8j + 2m in the low nibbles, 8j + 2m + 1 in
// the high ones). A full chunk is 576 bytes = 9 cache lines, so with K % 64 == 0 every vector load is line-aligned.
// The global bank holds the 16 rows' fp16 globals per group. The same 9 bytes per row and block and 2 per row as
// nvfp4, moved (cpumoe_formats.repack_nvfp4_x16).
//
// Mode w4a8 only: each activation 16-block is quantized as nvfp4's w4a8 (fp4_common.h quant16: the same codes and
// s_a). Record (x16::BlockToks): per block 24 bytes, the 8 even elements' codes then the 8 odd ones', float s_a,
// int32 corr = -12 * sum(q_b). Weights enter as u = 2 * E2M1 + 12 (0..24, vpshufb table w2_offset), so
//   isum_b = sum(2 E2M1 * q) = corr_b + sum(u * q)           (exact; |isum_b| <= 16 * 12 * 127)
// Per (row, token), from acc = 0, block by block in K order:
//   acc = fma(float(isum_b), (e4m3(scale_b) / 256) * s_a_b, acc);   out = acc * (128 * fp16(global))
// e4m3 / 256 is what the SIMD decode yields (an fp16 made from the code's bits); / 256 and 128 are exact, so these
// are the bits of fma(isum, e4m3 * s_a, acc) and acc * (0.5 * global) (the plain definition, which would pay
// two multiplies by 256 per block) unless a product or an accumulator falls below 2^-126 (fp32 subnormals).
// The integer is exact and every tier does these fp32 operations in this order (std::fma in scalar), so the tiers
// are bit-identical and a token's result does not depend on its batch. Lanes are rows: one vpdpbusd serves 16
// rows and the per-block fold (cvt, scale, fma) is paid once per 16 rows and token, not once per (row, token) as
// in nvfp4's row-major kernels. Results equal nvfp4 w4a8's up to fp32 rounding (nvfp4 groups its sums otherwise).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../x16.h"
#include "fp4_common.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
using fp4::kW2;
using fp4::kW2Offset;

constexpr int QB = 16, GR = x16::GR;
constexpr int CH = 4;                 // blocks per chunk
constexpr int GB = GR * (QB / 2 + 1);  // bytes per group and block: 16 scales + 128 code bytes = 144
constexpr int CB = CH * GB;            // bytes per full chunk: 576
// tokens per group call: 8 in 32 zmm registers; the 16-register tiers take the 16 rows in two halves of 8
constexpr int kMaxNT = CPUMOE_X16_ZMM ? 8 : 4;
// Software prefetch 3 KB ahead in each group stream (nvfp4's and q4_0_x16's distance), 9 lines per chunk step.
#ifndef CPUMOE_NVX16_PF
#define CPUMOE_NVX16_PF 3072
#endif

void prep_x16(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  using R = x16::BlockToks<1, QB>;
  for (int b = 0; b < K / QB; ++b) {
    int8_t* qb = (int8_t*)dst + (size_t)b * R::kStride;
    float s;
    const int32_t corr = -kW2Offset * fp4::quant16(src + (size_t)b * QB, qb, qb + 8, &s);  // nvfp4's codes and s_a
    x16::put_block_tail(qb + QB, s, corr);
  }
}

#if CPUMOE_X16_ZMM
// 16 e4m3 codes -> e4m3 / 256, exactly, in one zmm
CPUMOE_INLINE __m512 e4m3x16_div256(const uint8_t* p) { return _mm512_cvtph_ps(fp4::e4m3x16_fp16_div256(p)); }
#endif

#if CPUMOE_X16_ZMM
using Vec = __m512;
#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
using Vec = __m256;
#else
using Vec = float;
#endif

// The layout for x16.h's loops: a group is one bank row of the code bank and one of the global bank.
struct G16 {
  static constexpr int kMaxNT = cpumoe::CPUMOE_NS::kMaxNT;
  static constexpr int64_t kPf = CPUMOE_NVX16_PF;
  static constexpr int kSlot[2] = {0, 2};
  struct Ref {
    const uint8_t* w;    // the group's chunks
    const uint16_t* gl;  // its 16 fp16 globals
  };
  static CPUMOE_INLINE Ref ref(const cpumoe_kernel*, const cpumoe_bank* banks, int mat, int32_t e, int32_t g) {
    return {bank_row<uint8_t>(banks[2 * mat], e, g), bank_row<uint16_t>(banks[2 * mat + 1], e, g)};
  }
  template <int G, int NT>
  static void groups(const Ref* gp, int K, const void* const* act, float* out);
  // Blocks [4c, 4c + cb) of chunk c into acc[g * NT + t], a's pointers at block 4c (CB_: cb as a compile-time
  // constant, 0 = run time; the 16-register tiers: G == 1 and rows 8 HS..8 HS + 7, or with HS == 2 both halves
  // into acc[h * NT + t]).
  template <int G, int NT, int CB_, int HS = 0>
  static void chunk(const Ref* gp, int c, int cb, const x16::BlockToks<NT, QB>& a, Vec* acc, size_t row = 0);
};

#if CPUMOE_X16_ZMM
template <int G, int NT, int CB_, int>
CPUMOE_INLINE void G16::chunk(const Ref* gp, int c, int cb_rt, const x16::BlockToks<NT, QB>& a, Vec* acc, size_t) {
  const int cb = CB_ ? CB_ : cb_rt;
  const __m512i tu = fp4::tbl512(fp4::w2_offset());
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    for (int l = 0; l < CB / 64; ++l) __builtin_prefetch(gp[g].w + (size_t)c * CB + CPUMOE_NVX16_PF + 64 * l, 0, 3);
  CPUMOE_UNROLL
  for (int i = 0; i < cb; ++i) {
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = gp[g].w + (size_t)c * CB;
      const __m512 d = e4m3x16_div256(p + QB * i);
      const uint8_t* w = p + QB * cb + 128 * i;
      const __m512i w0 = _mm512_loadu_si512((const void*)w), w1 = _mm512_loadu_si512((const void*)(w + 64));
      // u[j]: the token's code dword j of the block (even elements 0-3, 4-7, odd 0-3, 4-7)
      const __m512i u0 = fp4::nib_lo512(w0, tu), u1 = fp4::nib_lo512(w1, tu);
      const __m512i u2 = fp4::nib_hi512(w0, tu), u3 = fp4::nib_hi512(w1, tu);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const int32_t* qa = (const int32_t*)a.q(t, i);
        __m512i S = _mm512_set1_epi32(*a.corr(t, i));
        if constexpr (NT * G >= 4) {  // enough independent chains: one per token
          S = x16::dpbusd_bcast(S, u0, qa);
          S = x16::dpbusd_bcast(S, u1, qa + 1);
          S = x16::dpbusd_bcast(S, u2, qa + 2);
          S = x16::dpbusd_bcast(S, u3, qa + 3);
        } else {  // two chains (the same exact integer)
          __m512i s1 = _mm512_setzero_si512();
          S = x16::dpbusd_bcast(S, u0, qa);
          s1 = x16::dpbusd_bcast(s1, u2, qa + 2);
          S = x16::dpbusd_bcast(S, u1, qa + 1);
          s1 = x16::dpbusd_bcast(s1, u3, qa + 3);
          S = _mm512_add_epi32(S, s1);
        }
        const __m512 sc = x16::mul_bcast(d, a.s(t, i));
        Vec& A = acc[g * NT + t];
        A = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), sc, A);
      }
    }
  }
}
#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
// The exact block sum of 8 rows (u: the block's 4 decoded code vectors) and a token's codes qa, plus corr (avx2
// forms the same integers in block_one_token's asm or code vector by code vector in half_pass)
CPUMOE_INLINE __m256i block_sum(const __m256i* u, const int8_t* qa, int32_t corr) {
  __m256i s0 = _mm256_set1_epi32(corr), s1 = _mm256_setzero_si256();
  s0 = _mm256_dpbusd_avx_epi32(s0, u[0], x16::bcast4(qa));
  s1 = _mm256_dpbusd_avx_epi32(s1, u[2], x16::bcast4(qa + 8));
  s0 = _mm256_dpbusd_avx_epi32(s0, u[1], x16::bcast4(qa + 4));
  s1 = _mm256_dpbusd_avx_epi32(s1, u[3], x16::bcast4(qa + 12));
  return _mm256_add_epi32(s0, s1);
}
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2
// One token, one 16-block of a group, both halves (AVX2): acc0 / acc1 (rows 0-7 / 8-15) += cvt(isum) * ((e4m3(scale)
// / 256) * s_a), e4m3x16_div256's decode and block_sum's integers and fp32 operations, in inline asm so that nothing is
// spilled (as q4_0_x16's block16_one_token). sp: the block's 16 scales, w: its 128 code bytes, rec: its record.
alignas(32) constexpr uint16_t kE4m3Mask[16] = {0xBFFF, 0xBFFF, 0xBFFF, 0xBFFF, 0xBFFF, 0xBFFF, 0xBFFF, 0xBFFF,
                                                0xBFFF, 0xBFFF, 0xBFFF, 0xBFFF, 0xBFFF, 0xBFFF, 0xBFFF, 0xBFFF};
CPUMOE_INLINE void block_one_token(const uint8_t* sp, const uint8_t* w, const int8_t* rec, __m256i m, __m256i tu,
                                   __m256& acc0, __m256& acc1) {
  static_assert(x16::BlockToks<1, QB>::kStride == 24, "record: 16 codes, float s_a at 16, int32 corr at 20");
  __m256i s0, s1;
  __m256 sc0, sc1;
  // code vector v (w0 at 0, w1 at 64) of both halves (+0, +32): its low nibbles meet the record's dword at qlo, its
  // high ones the dword at qhi; u = tu[nibble]
#define CPUMOE_NVX16_STEP(v, qlo, qhi, FIRST)                                                                  \
  CPUMOE_X16_ASM_NIBBLES(#v "(%[w])", #v "+32(%[w])")                                                         \
  "vpshufb %%ymm0, %[tu], %%ymm0\n\t"                                                                          \
  "vpshufb %%ymm1, %[tu], %%ymm1\n\t"                                                                          \
  "vpshufb %%ymm2, %[tu], %%ymm2\n\t"                                                                          \
  "vpshufb %%ymm3, %[tu], %%ymm3\n\t"                                                                          \
  "vpbroadcastd " #qlo "(%[r]), %%ymm4\n\t"                                                                    \
  "vpbroadcastd " #qhi "(%[r]), %%ymm5\n\t"                                                                    \
  CPUMOE_X16_ASM_MADD4(FIRST)
  __asm__(// the 16 scales: (sign-extended c << 7) & 0xBFFF is the fp16 of e4m3 / 256 (e4m3x16_div256's decode);
          // times s_a
          "vpmovsxbw (%[sp]), %%ymm0\n\t"
          "vpsllw $7, %%ymm0, %%ymm0\n\t"
          "vpand %[emask], %%ymm0, %%ymm0\n\t"
          "vcvtph2ps %%xmm0, %[sc0]\n\t"
          "vextracti128 $1, %%ymm0, %%xmm0\n\t"
          "vcvtph2ps %%xmm0, %[sc1]\n\t"
          "vbroadcastss 16(%[r]), %%ymm1\n\t"
          "vmulps %%ymm1, %[sc0], %[sc0]\n\t"
          "vmulps %%ymm1, %[sc1], %[sc1]\n\t"
          CPUMOE_NVX16_STEP(0, 0, 8, CPUMOE_X16_ASM_FIRST) CPUMOE_NVX16_STEP(64, 4, 12, CPUMOE_X16_ASM_NEXT)
          "vpmaddwd %[ones], %[s0], %[s0]\n\t"
          "vpmaddwd %[ones], %[s1], %[s1]\n\t"
          "vpbroadcastd 20(%[r]), %%ymm4\n\t"
          "vpaddd %%ymm4, %[s0], %[s0]\n\t"
          "vpaddd %%ymm4, %[s1], %[s1]\n\t"
          "vcvtdq2ps %[s0], %[s0]\n\t"
          "vcvtdq2ps %[s1], %[s1]\n\t"
          "vfmadd231ps %[sc0], %[s0], %[a0]\n\t"
          "vfmadd231ps %[sc1], %[s1], %[a1]\n\t"
          : [a0] "+x"(acc0), [a1] "+x"(acc1), [s0] "=&x"(s0), [s1] "=&x"(s1), [sc0] "=&x"(sc0), [sc1] "=&x"(sc1)
          : [sp] "r"(sp), [w] "r"(w), [r] "r"(rec), [m] "x"(m), [tu] "x"(tu), [ones] "m"(x16::kOnes16),
            [emask] "m"(kE4m3Mask), "m"(*(const uint8_t(*)[QB])sp), "m"(*(const uint8_t(*)[128])w),
            "m"(*(const int8_t(*)[24])rec)
          : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5");
#undef CPUMOE_NVX16_STEP
}
#endif

template <int G, int NT, int CB_, int HS>
CPUMOE_INLINE void G16::chunk(const Ref* gp, int c, int cb_rt, const x16::BlockToks<NT, QB>& a, Vec* acc, size_t row) {
  static_assert(G == 1, "the 16-register tiers take one group (one half of it, or both for few tokens) at a time");
  constexpr int h0 = HS == 2 ? 0 : HS, h1 = HS == 2 ? 2 : HS + 1;
  const int cb = CB_ ? CB_ : cb_rt;
  const __m256i m = _mm256_set1_epi8(0x0F), tu = fp4::w2_offset();
  const uint8_t* p = gp[0].w + (size_t)c * CB;
  if constexpr (HS == 2)
    x16::prefetch_one_token(p, CB / 64);
  else
    x16::prefetch_half_pass(p, CB / 64, HS != 1, CPUMOE_NVX16_PF, row);
#if CPUMOE_TIER == CPUMOE_T_AVX2
  static_assert(HS == 2 && NT == 1, "avx2 takes one token here; several go through half_pass");
  (void)h0, (void)h1;
  CPUMOE_UNROLL
  for (int i = 0; i < cb; ++i) block_one_token(p + QB * i, p + QB * cb + 128 * i, a.q(0, i), m, tu, acc[0], acc[1]);
#else
  CPUMOE_UNROLL
  for (int i = 0; i < cb; ++i) {
    __m256 ds[2];  // the block's scales of rows 8 h.. (both halves: decoded together)
    if constexpr (HS == 2)
      fp4::e4m3x16_div256(p + QB * i, ds);
    else
      ds[HS] = fp4::e4m3x8_div256(fp4::load8(p + QB * i + 8 * HS));
    CPUMOE_UNROLL
    for (int h = h0; h < h1; ++h) {
      const __m256 d = ds[h];
      const uint8_t* w = p + QB * cb + 128 * i + 32 * h;
      const __m256i w0 = _mm256_loadu_si256((const __m256i*)w), w1 = _mm256_loadu_si256((const __m256i*)(w + 64));
      // u[j]: the token's code dword j of the block (even elements 0-3, 4-7, odd 0-3, 4-7)
      const __m256i u[4] = {_mm256_shuffle_epi8(tu, _mm256_and_si256(w0, m)),
                            _mm256_shuffle_epi8(tu, _mm256_and_si256(w1, m)),
                            _mm256_shuffle_epi8(tu, _mm256_and_si256(_mm256_srli_epi16(w0, 4), m)),
                            _mm256_shuffle_epi8(tu, _mm256_and_si256(_mm256_srli_epi16(w1, 4), m))};
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const __m256i S = block_sum(u, a.q(t, i), *a.corr(t, i));
        const __m256 sc = _mm256_mul_ps(d, _mm256_set1_ps(*a.s(t, i)));
        Vec& A = acc[(h - h0) * NT + t];
        A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), sc, A);
      }
    }
  }
#endif
}
#else
template <int G, int NT, int CB_, int>
CPUMOE_INLINE void G16::chunk(const Ref*, int, int, const x16::BlockToks<NT, QB>&, Vec*, size_t) {}  // scalar: groups()
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
// 8 rows' sums times 128 * their fp16 globals (the definition's 0.5, times the 2^8 of the e4m3 / 256 scales)
CPUMOE_INLINE void store_scaled(float* out, __m256 acc, const uint16_t* gl) {
  const __m256 s = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)gl)), _mm256_set1_ps(128.f));
  _mm256_storeu_ps(out, _mm256_mul_ps(acc, s));
}
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2
// Rows 8h..8h+7 of a group (chunks at w, globals gl) for NT >= 2 tokens into out[t * 16 + r] (avx2): code vector j
// outermost (w0, then w1 of a block), its two u vectors meet every token in turn, so 2 code registers and NT int16
// runs are live where the earlier order (the 4 u vectors first) spilled at NT = 4; the same integers and fp32
// operations. Out of line, with an ordering asm per step (as q4_0_x16's and e2m1_x16's half_pass).
template <int NT>
__attribute__((noinline)) void half_pass(const uint8_t* w, int nb, int h, const void* const* act, float* out,
                                         const uint16_t* gl) {
  const int nc = nb / CH, rem = nb % CH;
  const __m256i m = _mm256_set1_epi8(0x0F), tu = fp4::w2_offset(), one = _mm256_set1_epi16(1);
  __m256 acc[NT];
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  x16::BlockToks<NT, QB> a(act);
  for (int c = 0; c * CH < nb; ++c, a.advance(CH)) {
    const int cb = c < nc ? CH : rem;
    const uint8_t* p = w + (size_t)c * CB;
    x16::prefetch_half_pass(p, CB / 64, h == 0, CPUMOE_NVX16_PF, (size_t)nb * GB);
    for (int i = 0; i < cb; ++i) {
      const __m256 d = fp4::e4m3x8_div256(fp4::load8(p + QB * i + 8 * h));
      const uint8_t* wb = p + QB * cb + 128 * i + 32 * h;
      __m256i s16[NT];
      CPUMOE_UNROLL
      for (int j = 0; j < 2; ++j) {  // vector j: its low nibbles meet the record's dword j, its high ones dword 2 + j
        const __m256i v = _mm256_loadu_si256((const __m256i*)(wb + 64 * j));
        const __m256i lo = _mm256_shuffle_epi8(tu, _mm256_and_si256(v, m));
        const __m256i hi = _mm256_shuffle_epi8(tu, _mm256_and_si256(_mm256_srli_epi16(v, 4), m));
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          const __m256i pr = x16::maddubs_pair(lo, hi, a.q(t, i) + 4 * j, a.q(t, i) + 8 + 4 * j);
          s16[t] = j ? _mm256_add_epi16(s16[t], pr) : pr;  // <= 4 * 2 * 24 * 127 = 24384: exact in int16
          __asm__("" : "+x"(s16[t]), "+r"(wb));  // the next vector loads after these sums
        }
      }
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const __m256i S = _mm256_add_epi32(_mm256_madd_epi16(s16[t], one), _mm256_set1_epi32(*a.corr(t, i)));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, _mm256_set1_ps(*a.s(t, i))), acc[t]);
      }
    }
  }
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) store_scaled(out + (size_t)t * GR, acc[t], gl + 8 * h);
}
#endif

// out[(g * NT + t) * 16 + r] = dot(row r of group g, token t) for G groups (gp[g]) and NT tokens.
template <int G, int NT>
CPUMOE_INLINE void G16::groups(const Ref* gp, int K, const void* const* act, float* out) {
  const int nb = K / QB, nc = nb / CH, rem = nb % CH;
#if CPUMOE_X16_ZMM
  __m512 acc[G * NT];
  CPUMOE_UNROLL
  for (int i = 0; i < G * NT; ++i) acc[i] = _mm512_setzero_ps();
  x16::BlockToks<NT, QB> a(act);
  for (int c = 0; c < nc; ++c) chunk<G, NT, CH>(gp, c, CH, a, acc), a.advance(CH);
  if (rem) chunk<G, NT, 0>(gp, nc, rem, a, acc);
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g) {
    const __m512 gl = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)gp[g].gl)),
                                    _mm512_set1_ps(128.f));
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + (size_t)(g * NT + t) * GR, _mm512_mul_ps(acc[g * NT + t], gl));
  }
#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
  const size_t row = (size_t)nb * GB;
  if constexpr (NT == 1) {  // one token: both halves of the G groups per chunk, the G streams side by side
    __m256 acc[G * 2];
    CPUMOE_UNROLL
    for (int t = 0; t < G * 2; ++t) acc[t] = _mm256_setzero_ps();
    x16::BlockToks<1, QB> a(act);
    for (int c = 0; c < nc; ++c, a.advance(CH))
      CPUMOE_UNROLL
      for (int g = 0; g < G; ++g) chunk<1, 1, CH, 2>(gp + g, c, CH, a, acc + 2 * g, row);
    if (rem)
      CPUMOE_UNROLL
      for (int g = 0; g < G; ++g) chunk<1, 1, 0, 2>(gp + g, nc, rem, a, acc + 2 * g, row);
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g)
      CPUMOE_UNROLL
      for (int h = 0; h < 2; ++h) store_scaled(out + (size_t)g * GR + 8 * h, acc[2 * g + h], gp[g].gl + 8 * h);
    return;
  }
  // more tokens: rows 8h..8h+7 of each group in turn, NT tokens' accumulators each (the second half's pass
  // prefetches the next group)
#if CPUMOE_TIER == CPUMOE_T_AVX2
  for (int g = 0; g < G; ++g)
    for (int h = 0; h < 2; ++h) half_pass<NT>(gp[g].w, nb, h, act, out + (size_t)g * NT * GR + 8 * h, gp[g].gl);
#else
  for (int g = 0; g < G; ++g)
    for (int h = 0; h < 2; ++h) {
      __m256 acc[NT];
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
      x16::BlockToks<NT, QB> a(act);
      if (h == 0) {
        for (int c = 0; c < nc; ++c) chunk<1, NT, CH, 0>(gp + g, c, CH, a, acc, row), a.advance(CH);
        if (rem) chunk<1, NT, 0, 0>(gp + g, nc, rem, a, acc, row);
      } else {
        for (int c = 0; c < nc; ++c) chunk<1, NT, CH, 1>(gp + g, c, CH, a, acc, row), a.advance(CH);
        if (rem) chunk<1, NT, 0, 1>(gp + g, nc, rem, a, acc, row);
      }
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) store_scaled(out + (size_t)(g * NT + t) * GR + 8 * h, acc[t], gp[g].gl + 8 * h);
    }
#endif
#else  // scalar: the same integers and fp32 operations, row by row
  const x16::BlockToks<NT, QB> a(act);
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < GR; ++r) {
        float acc = 0.f;
        for (int b = 0; b < nb; ++b) {
          const int c = b / CH, i = b % CH, cb = c < nc ? CH : rem;
          const uint8_t* p = gp[g].w + (size_t)c * CB;
          const uint8_t* w = p + QB * cb + 128 * i;
          const int8_t* qb = a.q(t, b);
          int32_t s = 0;
          for (int mm = 0; mm < 8; ++mm) {
            const uint8_t byte = w[64 * (mm / 4) + 4 * r + mm % 4];
            s += kW2[byte & 15] * qb[mm] + kW2[byte >> 4] * qb[8 + mm];
          }
          acc = std::fma((float)s, (e4m3_to_f32(p[QB * i + r]) * 0x1p-8f) * *a.s(t, b), acc);
        }
        out[(size_t)(g * NT + t) * GR + r] = acc * (128.f * fp16_to_f32(gp[g].gl[r]));
      }
#endif
}

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(nvfp4_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || CPUMOE_X16_ZMM
  return x16::install<G16>(k, CPUMOE_MODE_W4A8, &x16::int8_record_bytes<QB>, &prep_x16);
#else
  (void)k;
  return false;  // avx512f: the tier below (avxvnni or avx2) runs
#endif
}
