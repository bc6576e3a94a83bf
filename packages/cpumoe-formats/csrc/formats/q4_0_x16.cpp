// q4_0_x16: q4_0 experts with 16 rows interleaved per 32-block, for CPUs (docs/formats/q4_0.md "q4_0_x16").
// Banks (slots): 0 gate_up [E, 2I/16, (H/32)*288], 1 down [E, H/16, (I/32)*288], uint8. A bank row is a group of
// 16 weight rows; per 32-block it holds 288 bytes: the 16 rows' fp16 d (row r at bytes 2r), then 4 x 64 bytes,
// vector j's int32 lane r = row r's q4_0 qs bytes 4j..4j+3 (elements 4j.. in the low nibbles, 16+4j.. in the high
// ones). The same 18 bytes per row and block as q4_0, moved (cpumoe_formats.repack_q4_0_x16).
//
// Mode w4a8 only (q4_0's default): each activation 32-block is quantized by the Q8_0 rule (common.h q8_block; the
// same codes and d_a as q4_0's prep). Record (x16::BlockToks): per block 40 bytes, its int8 q[32], float d_a,
// int32 corr = -8 * sum(q_b).
// Per (row, token), from acc = 0, block by block in K order:
//   acc = fma(float(corr_b + sum(nib * q)), fp32(fp16(d)) * d_a, acc)
// The integer is exact and every tier does these fp32 operations in this order (std::fma in scalar), so the tiers
// are bit-identical and a token's result does not depend on its batch. Lanes are rows: one vpdpbusd serves 16
// rows and the per-block fold (cvt, scale, fma) is paid once per 16 rows and token, not once per (row, token) as
// in q4_0's row-major kernels (that fold bounds their batches that share experts).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../x16.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int QK = 32, GR = x16::GR, GB = 288;
// tokens per group call: 8 in 32 zmm registers; the 16-register tiers take the 16 rows in two halves of 8, with
// their 8 nibble vectors and one accumulator per token live
constexpr int kMaxNT = CPUMOE_TIER == CPUMOE_T_AVX512VNNI ? 8 : 4;
// Software prefetch 3 KB ahead in each group stream (q4_0's distance), 5 lines per 288-byte block step.
#ifndef CPUMOE_Q4X16_PF
#define CPUMOE_Q4X16_PF 3072
#endif

// q4_0's w4a8 codes and d_a per 32, corr = -8 sum(q) (the raw nibbles' offset 8)
void prep_x16(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) { x16::q8_records<-8>(src, K, dst); }

#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
// A block's codes of rows 8h..8h+7: lo[j] / hi[j] the low / high nibbles of vector j (block32_sum's operands)
CPUMOE_INLINE void codes8(const uint8_t* p, int h, __m256i m, __m256i* lo, __m256i* hi) {
  CPUMOE_UNROLL
  for (int j = 0; j < 4; ++j) {
    const __m256i w = _mm256_loadu_si256((const __m256i*)(p + 32 + 64 * j + 32 * h));
    lo[j] = _mm256_and_si256(w, m);
    hi[j] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m);
  }
}
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2
// One token, one 32-block of a group, all 16 rows (AVX2): acc0 / acc1 (rows 0-7 / 8-15) += cvt(corr + sum) * (d *
// d_a), the same integers and fp32 operations as the intrinsics it replaced, in inline asm. GCC 12 spilled their two
// accumulators and scale to the stack (16 ymm registers for 8 broadcast activations, the mask, the ones and the
// codes) and took 31 cycles a block on Zen 3; this schedule keeps them in registers: both halves per code step, the
// codes masked straight from memory, the ones and the broadcasts from memory (21 cycles a block, same bits).
CPUMOE_INLINE void block16_one_token(const uint8_t* p, const int8_t* rec, __m256i m, __m256& acc0, __m256& acc1) {
  static_assert(x16::BlockToks<1, QK>::kStride == 40, "record: 32 codes, float d_a at 32, int32 corr at 36");
  __m256i s0, s1;
  // code step j: rows 0-7 at 32 + 64j, rows 8-15 at 64 + 64j; its low nibbles meet codes 4j.., the high 16 + 4j..
#define CPUMOE_Q4X16_STEP(j, FIRST)                                                             \
  CPUMOE_X16_ASM_NIBBLES(#j "*64+32(%[p])", #j "*64+64(%[p])")                                  \
  "vpbroadcastd " #j "*4(%[r]), %%ymm4\n\t"                                                      \
  "vpbroadcastd " #j "*4+16(%[r]), %%ymm5\n\t"                                                   \
  CPUMOE_X16_ASM_MADD4(FIRST)
  __asm__(CPUMOE_Q4X16_STEP(0, CPUMOE_X16_ASM_FIRST) CPUMOE_Q4X16_STEP(1, CPUMOE_X16_ASM_NEXT)
          CPUMOE_Q4X16_STEP(2, CPUMOE_X16_ASM_NEXT) CPUMOE_Q4X16_STEP(3, CPUMOE_X16_ASM_NEXT)
          // int16 runs -> int32, + corr, -> fp32; times fp32(d) * d_a; fma into the rows' accumulators
          "vpmaddwd %[ones], %[s0], %[s0]\n\t"
          "vpmaddwd %[ones], %[s1], %[s1]\n\t"
          "vpbroadcastd 36(%[r]), %%ymm4\n\t"
          "vpaddd %%ymm4, %[s0], %[s0]\n\t"
          "vpaddd %%ymm4, %[s1], %[s1]\n\t"
          "vcvtdq2ps %[s0], %[s0]\n\t"
          "vcvtdq2ps %[s1], %[s1]\n\t"
          "vbroadcastss 32(%[r]), %%ymm5\n\t"
          "vcvtph2ps (%[p]), %%ymm0\n\t"
          "vcvtph2ps 16(%[p]), %%ymm1\n\t"
          "vmulps %%ymm5, %%ymm0, %%ymm0\n\t"
          "vmulps %%ymm5, %%ymm1, %%ymm1\n\t"
          "vfmadd231ps %%ymm0, %[s0], %[a0]\n\t"
          "vfmadd231ps %%ymm1, %[s1], %[a1]\n\t"
          : [a0] "+x"(acc0), [a1] "+x"(acc1), [s0] "=&x"(s0), [s1] "=&x"(s1)
          : [p] "r"(p), [r] "r"(rec), [m] "x"(m), [ones] "m"(x16::kOnes16), "m"(*(const uint8_t(*)[GB])p),
            "m"(*(const int8_t(*)[40])rec)
          : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5");
#undef CPUMOE_Q4X16_STEP
}
#elif CPUMOE_TIER == CPUMOE_T_AVXVNNI
// The same for AVX-VNNI, by intrinsics (vpdpbusd needs neither the int16 runs nor the ones).
CPUMOE_INLINE void block16_one_token(const uint8_t* p, const int8_t* rec, __m256i m, __m256& acc0, __m256& acc1) {
  float s;
  int32_t corr;
  std::memcpy(&s, rec + QK, 4);
  std::memcpy(&corr, rec + QK + 4, 4);
  CPUMOE_UNROLL
  for (int h = 0; h < 2; ++h) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
    __m256i lo[4], hi[4];
    codes8(p, h, m, lo, hi);
    __m256& A = h ? acc1 : acc0;
    A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(x16::block32_sum(lo, hi, rec, corr)), _mm256_mul_ps(d, _mm256_set1_ps(s)),
                        A);
  }
}
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
// Rows 8h..8h+7 of a group (bank row w) for NT >= 2 tokens into out[t * 16 + r]; the first half's pass brings the
// lines in, the second reads them from L1/L2 while it prefetches the next group. avx2 takes code step j outermost:
// its two nibble vectors meet every token in turn, so 2 code registers and NT int16 runs are live where
// the earlier order (all 8 code vectors first) left too few of the 16 ymm registers at NT = 4. Out of line, with
// an ordering asm per step: GCC had formed all 32 products of a block first and spilled them. One Zen 3 core in
// cache (2816 x 704, 8 tokens): gate_up 424 -> 402-422 us, down 227 -> 197-207.
template <int NT>
__attribute__((noinline)) void half_pass(const uint8_t* w, int nb, int h, const void* const* act, float* out) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  using A = x16::BlockToks<NT, QK>;
  x16::half_pass_blocks<NT, QK>(w, nb, GB, h, CPUMOE_Q4X16_PF, act, out, [&](int b, const uint8_t* p, const A& a,
                                                                             __m256* acc) CPUMOE_LAMBDA_INLINE {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
    __m256i S[NT];
#if CPUMOE_TIER == CPUMOE_T_AVX2
    __m256i s16[NT];
    CPUMOE_UNROLL
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 32 + 64 * j + 32 * h));
      const __m256i lo = _mm256_and_si256(v, m), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const __m256i pr = x16::maddubs_pair(lo, hi, a.q(t, b) + 4 * j, a.q(t, b) + 16 + 4 * j);
        s16[t] = j ? _mm256_add_epi16(s16[t], pr) : pr;  // <= 8 * 2 * 15 * 127 = 30480: exact in int16
        // the next step's codes are loaded through p after these sums: GCC's reassociation had formed every
        // product of the block first and summed them as a tree (20+ live vectors, spilled)
        __asm__("" : "+x"(s16[t]), "+r"(p));
      }
    }
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      S[t] = _mm256_add_epi32(_mm256_set1_epi32(*a.corr(t, b)), _mm256_madd_epi16(s16[t], _mm256_set1_epi16(1)));
#else
    __m256i lo[4], hi[4];
    codes8(p, h, m, lo, hi);
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) S[t] = x16::block32_sum(lo, hi, a.q(t, b), *a.corr(t, b));
#endif
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[t]), _mm256_mul_ps(d, _mm256_set1_ps(*a.s(t, b))), acc[t]);
  });
}
#endif

// The layout for x16.h's loops: a group is one bank row. kSwPf: the software prefetch (x16.h gguf_sw_prefetch;
// false is built on avx512vnni only).
template <bool kSwPf>
struct G16 {
  static constexpr int kMaxNT = cpumoe::CPUMOE_NS::kMaxNT;
  static constexpr int64_t kPf = x16::gguf_pf(kSwPf, CPUMOE_Q4X16_PF);
  static constexpr int kSlot[2] = {0, 1};
  struct Ref {
    const uint8_t* w;
  };
  static CPUMOE_INLINE Ref ref(const cpumoe_kernel*, const cpumoe_bank* banks, int mat, int32_t e, int32_t g) {
    return {bank_row<uint8_t>(banks[mat], e, g)};
  }
  template <int G, int NT>
  static void groups(const Ref* gp, int K, const void* const* act, float* out);
};

// out[(g * NT + t) * 16 + r] = dot(row r of group g, token t) for G groups (bank rows gp[g]) and NT tokens.
template <bool kSwPf>
template <int G, int NT>
CPUMOE_INLINE void G16<kSwPf>::groups(const Ref* gp, int K, const void* const* act, float* out) {
  const int nb = K / QK;
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  x16::BlockToks<NT, QK> a(act);
  const __m512i m = _mm512_set1_epi8(0x0F);
  __m512 acc[G][NT];
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = gp[g].w + (size_t)b * GB;
      if constexpr (kPf > 0)
        for (int l = 0; l < 5; ++l) __builtin_prefetch(p + kPf + 64 * l, 0, 3);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
      __m512i lo[4], hi[4];
      CPUMOE_UNROLL
      for (int j = 0; j < 4; ++j) {
        const __m512i w = _mm512_loadu_si512((const void*)(p + 32 + 64 * j));
        lo[j] = _mm512_and_si512(w, m);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(w, 4), m);
      }
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        // the token's 4-code groups: elements 4j.. (low nibbles) and 16+4j.. (high)
        const int32_t* qa = (const int32_t*)a.q(t, 0);
        __m512i s0 = _mm512_set1_epi32(*a.corr(t, 0)), s1 = _mm512_setzero_si512();  // two chains
        CPUMOE_UNROLL
        for (int j = 0; j < 4; ++j) {
          s0 = x16::dpbusd_bcast(s0, lo[j], qa + j);
          s1 = x16::dpbusd_bcast(s1, hi[j], qa + 4 + j);
        }
        const __m512 sc = x16::mul_bcast(d, a.s(t, 0));
        acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), sc, acc[g][t]);
      }
    }
    a.advance(1);
  }
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + (size_t)(g * NT + t) * GR, acc[g][t]);
#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
  const __m256i m = _mm256_set1_epi8(0x0F);
  if constexpr (NT == 1) {  // one token: all 16 rows of the G groups per block, side by side
    const int8_t* rec = (const int8_t*)act[0];
    x16::one_token_groups<G>(nb, [&](int b, int g, __m256& a0, __m256& a1) CPUMOE_LAMBDA_INLINE {
      const uint8_t* p = gp[g].w + (size_t)b * GB;
      x16::prefetch_one_token(p, 5);
      block16_one_token(p, rec + (size_t)b * x16::BlockToks<1, QK>::kStride, m, a0, a1);
    }, out);
    return;
  }
  // more tokens: rows 8h..8h+7 of each group in turn (half_pass)
  for (int g = 0; g < G; ++g)
    for (int h = 0; h < 2; ++h) half_pass<NT>(gp[g].w, nb, h, act, out + (size_t)g * NT * GR + 8 * h);
#else  // scalar: the same integers and fp32 operations, row by row
  const x16::BlockToks<NT, QK> a(act);
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < GR; ++r) {
        float acc = 0.f;
        for (int b = 0; b < nb; ++b) {
          const uint8_t* p = gp[g].w + (size_t)b * GB;
          uint16_t dh;
          std::memcpy(&dh, p + 2 * r, 2);
          const int8_t* qb = a.q(t, b);
          int32_t s = *a.corr(t, b);
          for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = p[32 + 64 * j + 4 * r + i];
              s += (byte & 15) * qb[4 * j + i] + (byte >> 4) * qb[16 + 4 * j + i];
            }
          acc = std::fma((float)s, fp16_to_f32(dh) * *a.s(t, b), acc);
        }
        out[(size_t)(g * NT + t) * GR + r] = acc;
      }
#endif
}

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(q4_0_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || \
    CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  return x16::install_pf<G16<true>, G16<false>>(k, CPUMOE_MODE_W4A8, &x16::int8_record_bytes<QK>, &prep_x16);
#else
  (void)k;
  return false;  // avx512f / avx512bf16 / amx: the tier below (avxvnni or avx2) or avx512vnni runs
#endif
}
