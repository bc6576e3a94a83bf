// q6_k_x16: q6_k experts with 16 rows interleaved per 256-block, for CPUs (docs/formats/q6_k.md "q6_k_x16").
// Banks (slots): 0 gate_up [E, 2I/16, (H/256)*3360], 1 down [E, H/16, (I/256)*3360], uint8. A bank row is a group of
// 16 weight rows; per 256-block it holds 3360 bytes, the same 210 bytes per row as q6_k, moved
// (cpumoe_formats.repack_q6_k_x16):
//   [0, 32)       the 16 rows' fp16 d (row r at 2r)
//   [32, 288)     16 planes of 16 bytes: plane j byte r = row r's int8 scale sc[j]
//   [288, 3360)   per half h (elements 128h ..) 1536 bytes: for code steps v = 0..7 the vectors A[v] at 64v, C[v] at
//                 512 + 64v, B[v] at 1024 + 64v (64 bytes each), int32 lane r:
//                 A = row r's ql[64h + 4v ..] (low nibbles: elements 128h + 4v .., high: 128h + 64 + 4v ..),
//                 B = ql[64h + 32 + 4v ..] (low: 128h + 32 + 4v .., high: 128h + 96 + 4v ..), C = qh[32h + 4v ..]
//                 (bits 2g, 2g+1 the high bits of run g = 0..3). The runs go 0, 2 (A and C), then 1, 3 (B and C), so
//                 a half's lines are first read as two sequential streams, then one: A, C, B interleaved per step
//                 (A C B of a step adjacent) read 6-7 GB/s from DRAM on one Zen 4 core against q4_k_x16's ~20
//
// Mode w4a8 only (q6_k's default): each activation 256-block quantized by the Q8_0 rule (q6_k's codes and d_a).
// Record: per block 324 bytes, q[256], float d_a at 256, int32 c[16] at 260 with c[j] = -32 * (sum of the codes of
// sub-block j). Per (row, token), from acc = 0, block by block in K order:
//   S = sum_j sc[j] (c[j] + sum_{i in j} q_i a_i) = sum_j sc[j] sum((q_i - 32) a_i)   (exact int32)
//   acc = fma(float(S), fp32(d) * d_a, acc)
// Every tier does these operations in this order (std::fma in scalar): the tiers are bit-identical, and a token's
// result does not depend on its batch. Lanes are rows: the scales and the fold are paid once per 16 rows and token.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../x16.h"
#include "gguf_rows.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int QK = 256, GR = x16::GR, GB = 3360, REC = 324;
// tokens per group call: a run's 8 code vectors, per token two sub-block chains, its block sum and accumulator
constexpr int kMaxNT = CPUMOE_TIER == CPUMOE_T_AVX512VNNI ? 4 : 2;
constexpr int kRunOrder[4] = {0, 2, 1, 3};  // the runs that read A and C first, then B's (the layout's order)
#ifndef CPUMOE_Q6KX16_PF
#define CPUMOE_Q6KX16_PF 1536
#endif

// The record of one token: per 256-block q[256], d_a, c[16] = -32 * (sum of each 16 codes); codes and d_a are
// q6_k's prep's (gguf_rows.h prep_act_i8<256>, run on the block).
void prep_x16(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  alignas(64) int8_t one[QK + 4 + 32];  // a one-block q6_k record: q[256], d_a, bsum[16]
  for (int32_t b = 0; b < K / QK; ++b) {
    gguf::prep_act_i8<QK>(nullptr, src + (size_t)b * QK, QK, one);
    int8_t* rec = (int8_t*)dst + (size_t)b * REC;
    std::memcpy(rec, one, QK + 4);
    for (int j = 0; j < 16; ++j) {
      int16_t bs;
      std::memcpy(&bs, one + QK + 4 + 2 * j, 2);
      const int32_t c = -32 * bs;
      std::memcpy(rec + QK + 4 + 4 * j, &c, 4);
    }
  }
}
size_t act_bytes_x16(const cpumoe_kernel*, int32_t K) { return (size_t)(K / QK) * REC; }

// Row lane r's 4 codes of run g (0..3) at code step v of half h (step = the half + 64 v: A at +0, C at +512, B at
// +1024), any width: the low 4 bits from A (runs 0, 2) or B (runs 1, 3), low or high nibbles; bits 4-5 from C's bits
// 2g, 2g+1.
#if defined(__AVX2__)
template <int W>  // vector width in bits
struct Codes;
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
template <>
struct Codes<512> {
  static CPUMOE_INLINE __m512i run(const uint8_t* step, int g) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i lo = _mm512_loadu_si512(step + 1024 * (g & 1)), c = _mm512_loadu_si512(step + 512);
    const __m512i l4 = g < 2 ? _mm512_and_si512(lo, m4) : _mm512_and_si512(_mm512_srli_epi16(lo, 4), m4);
    const __m512i h2 = g == 0 ? _mm512_slli_epi16(c, 4) : g == 1 ? _mm512_slli_epi16(c, 2) : g == 2 ? c : _mm512_srli_epi16(c, 2);
    return _mm512_or_si512(l4, _mm512_and_si512(h2, m30));
  }
};
#endif
template <>
struct Codes<256> {  // rows 8h..8h+7 of a step: the lanes at +32 h
  static CPUMOE_INLINE __m256i run(const uint8_t* step, int g) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i lo = _mm256_loadu_si256((const __m256i*)(step + 1024 * (g & 1)));
    const __m256i c = _mm256_loadu_si256((const __m256i*)(step + 512));
    const __m256i l4 = g < 2 ? _mm256_and_si256(lo, m4) : _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
    const __m256i h2 = g == 0 ? _mm256_slli_epi16(c, 4) : g == 1 ? _mm256_slli_epi16(c, 2) : g == 2 ? c : _mm256_srli_epi16(c, 2);
    return _mm256_or_si256(l4, _mm256_and_si256(h2, m30));
  }
};
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
// G groups x NT tokens, 16 rows per zmm. Per half and run g: the run's 8 code vectors (4 per sub-block) built once
// for the NT tokens; per token and sub-block one vpdpbusd chain of 4 started from c[j], scaled by sc[j] (vpmulld).
template <int G, int NT>
CPUMOE_INLINE void groups_zmm(const uint8_t* const* w, int nb, const void* const* act, float* out) {
  __m512 acc[G][NT];
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b)
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = w[g] + (size_t)b * GB;
      for (int l = 0; l < 5; ++l) __builtin_prefetch(p + CPUMOE_Q6KX16_PF + 64 * l, 0, 3);  // d, scales
      __m512i S[NT];
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) S[t] = _mm512_setzero_si512();
      CPUMOE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const uint8_t* half = p + 288 + 1536 * h;
        CPUMOE_UNROLL
        for (int ri = 0; ri < 4; ++ri) {
          const int run = kRunOrder[ri];
          __m512i q[8];
          CPUMOE_UNROLL
          for (int v = 0; v < 8; ++v) {
            if (ri < 2)  // the step's lines as the first runs reach them: A and C, then B
              __builtin_prefetch(half + 64 * v + (ri ? 1024 : 0) + CPUMOE_Q6KX16_PF, 0, 3);
            if (ri == 0) __builtin_prefetch(half + 512 + 64 * v + CPUMOE_Q6KX16_PF, 0, 3);
            q[v] = Codes<512>::run(half + 64 * v, run);
          }
          const int j0 = 8 * h + 2 * run;  // the run's sub-blocks j0, j0 + 1
          const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 32 + 16 * j0)));
          const __m512i s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 48 + 16 * j0)));
          CPUMOE_UNROLL
          for (int t = 0; t < NT; ++t) {
            const int8_t* rec = (const int8_t*)act[t] + (size_t)b * REC;
            const int32_t* qa = (const int32_t*)(rec + 128 * h + 32 * run);
            const int32_t* c = (const int32_t*)(rec + QK + 4);
            __m512i a0 = _mm512_set1_epi32(c[j0]), a1 = _mm512_set1_epi32(c[j0 + 1]);
            CPUMOE_UNROLL
            for (int v = 0; v < 4; ++v) a0 = x16::dpbusd_bcast(a0, q[v], qa + v), a1 = x16::dpbusd_bcast(a1, q[4 + v], qa + 4 + v);
            S[t] = _mm512_add_epi32(S[t], _mm512_add_epi32(_mm512_mullo_epi32(a0, s0), _mm512_mullo_epi32(a1, s1)));
          }
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        const float* da = (const float*)((const int8_t*)act[t] + (size_t)b * REC + QK);
        acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[t]), x16::mul_bcast(d, da), acc[g][t]);
      }
    }
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + (size_t)(g * NT + t) * GR, acc[g][t]);
}
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
// The int32 sums c + sum((q) a) of 8 rows for one 16-element sub-block: codes q[v] (v < 4, unsigned <= 63) against
// the token's 4 codes at qa[v]. avx2: vpmaddubsw (pairs <= 2 * 63 * 127 = 16002) then vpmaddwd with ones per step
// (two steps in int16 could reach 32004: no int16 run); avxvnni: vpdpbusd.
CPUMOE_INLINE __m256i sub_sum(const __m256i* q, const int8_t* qa, int32_t c) {
  __m256i s = _mm256_set1_epi32(c);
  CPUMOE_UNROLL
  for (int v = 0; v < 4; ++v) {
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
    s = _mm256_dpbusd_avx_epi32(s, q[v], x16::bcast4(qa + 4 * v));
#else
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(q[v], x16::bcast4(qa + 4 * v)), _mm256_set1_epi16(1)));
#endif
  }
  return s;
}

// G groups x NT tokens, rows 8h..8h+7 (hr in [H0, H0 + NH)) of each group per ymm; a lone token takes both row
// halves per block (G x 2 streams), several one row half per pass (q4_k_x16's scheme).
template <int G, int NT, int H0, int NH>
CPUMOE_INLINE void groups_ymm(const uint8_t* const* w, int nb, const void* const* act, float* out) {
  __m256 acc[G][NH][NT];
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int hh = 0; hh < NH; ++hh)
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) acc[g][hh][t] = _mm256_setzero_ps();
  for (int b = 0; b < nb; ++b)
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = w[g] + (size_t)b * GB;
      if (H0 == 0)
        for (int l = 0; l < 5; ++l) __builtin_prefetch(p + CPUMOE_Q6KX16_PF + 64 * l, 0, 3);  // d, scales
      CPUMOE_UNROLL
      for (int hh = 0; hh < NH; ++hh) {
        const int hr = H0 + hh;  // the row half
        __m256i S[NT];
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) S[t] = _mm256_setzero_si256();
        for (int h = 0; h < 2; ++h)  // the element half
          CPUMOE_UNROLL
          for (int ri = 0; ri < 4; ++ri) {
            const int run = kRunOrder[ri];
            __m256i q[8];
            CPUMOE_UNROLL
            for (int v = 0; v < 8; ++v) {
              const uint8_t* step = p + 288 + 1536 * h + 64 * v;
              if (H0 == 0 && hr == 0 && ri < 2) {  // the step's lines as the first runs reach them
                __builtin_prefetch(step + (ri ? 1024 : 0) + CPUMOE_Q6KX16_PF, 0, 3);
                if (ri == 0) __builtin_prefetch(step + 512 + CPUMOE_Q6KX16_PF, 0, 3);
              }
              q[v] = Codes<256>::run(step + 32 * hr, run);
            }
            const int j0 = 8 * h + 2 * run;
            const __m256i s0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 32 + 16 * j0 + 8 * hr)));
            const __m256i s1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 48 + 16 * j0 + 8 * hr)));
            CPUMOE_UNROLL
            for (int t = 0; t < NT; ++t) {
              const int8_t* rec = (const int8_t*)act[t] + (size_t)b * REC;
              const int8_t* qa = rec + 128 * h + 32 * run;
              const int32_t* c = (const int32_t*)(rec + QK + 4);
              const __m256i a0 = sub_sum(q, qa, c[j0]), a1 = sub_sum(q + 4, qa + 16, c[j0 + 1]);
              S[t] = _mm256_add_epi32(S[t], _mm256_add_epi32(_mm256_mullo_epi32(a0, s0), _mm256_mullo_epi32(a1, s1)));
            }
          }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * hr)));
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          const float* da = (const float*)((const int8_t*)act[t] + (size_t)b * REC + QK);
          acc[g][hh][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[t]), _mm256_mul_ps(d, _mm256_set1_ps(*da)), acc[g][hh][t]);
        }
      }
    }
  CPUMOE_UNROLL
  for (int g = 0; g < G; ++g)
    CPUMOE_UNROLL
    for (int t = 0; t < NT; ++t)
      CPUMOE_UNROLL
      for (int hh = 0; hh < NH; ++hh) _mm256_storeu_ps(out + (size_t)(g * NT + t) * GR + 8 * (H0 + hh), acc[g][hh][t]);
}
#endif

// The layout for x16.h's loops: a group is one bank row.
struct G16 {
  static constexpr int kMaxNT = cpumoe::CPUMOE_NS::kMaxNT;
  static constexpr int64_t kPf = CPUMOE_Q6KX16_PF;
  static constexpr int kSlot[2] = {0, 1};
  struct Ref {
    const uint8_t* w;
  };
  static CPUMOE_INLINE Ref ref(const cpumoe_kernel*, const cpumoe_bank* banks, int mat, int32_t e, int32_t g) {
    return {bank_row<uint8_t>(banks[mat], e, g)};
  }
  // out[(g * NT + t) * 16 + r] = dot(row r of group g, token t) for G groups (bank rows gp[g]) and NT tokens.
  template <int G, int NT>
  static void groups(const Ref* gp, int K, const void* const* act, float* out) {
    const uint8_t* w[G];
    for (int g = 0; g < G; ++g) w[g] = gp[g].w;
#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
    groups_zmm<G, NT>(w, K / QK, act, out);
#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
    if constexpr (NT == 1) {
      groups_ymm<G, 1, 0, 2>(w, K / QK, act, out);
    } else {
      groups_ymm<G, NT, 0, 1>(w, K / QK, act, out);
      groups_ymm<G, NT, 1, 1>(w, K / QK, act, out);
    }
#else  // scalar: the same integers and fp32 operations, row by row
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < NT; ++t)
        for (int r = 0; r < GR; ++r) {
          float acc = 0.f;
          for (int b = 0; b < K / QK; ++b) {
            const uint8_t* p = w[g] + (size_t)b * GB;
            const int8_t* rec = (const int8_t*)act[t] + (size_t)b * REC;
            int32_t S = 0;
            for (int h = 0; h < 2; ++h)
              for (int run = 0; run < 4; ++run)
                for (int sub = 0; sub < 2; ++sub) {
                  const int j = 8 * h + 2 * run + sub;
                  int32_t c;
                  std::memcpy(&c, rec + QK + 4 + 4 * j, 4);
                  int32_t s = c;
                  for (int v = 4 * sub; v < 4 * sub + 4; ++v)
                    for (int i = 0; i < 4; ++i) {
                      const uint8_t* step = p + 288 + 1536 * h + 64 * v + 4 * r + i;
                      const uint8_t lo = step[1024 * (run & 1)], hb = step[512];
                      const int q = (run < 2 ? lo & 15 : lo >> 4) | ((hb >> (2 * run)) & 3) << 4;
                      s += q * rec[128 * h + 32 * run + 4 * v + i];
                    }
                  S += (int8_t)p[32 + 16 * j + r] * s;
                }
            uint16_t dh;
            std::memcpy(&dh, p + 2 * r, 2);
            float da;
            std::memcpy(&da, rec + QK, 4);
            acc = std::fma((float)S, fp16_to_f32(dh) * da, acc);
          }
          out[(size_t)(g * NT + t) * GR + r] = acc;
        }
#endif
  }
};

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(q6_k_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || \
    CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  return x16::install<G16>(k, CPUMOE_MODE_W4A8, &act_bytes_x16, &prep_x16);
#else
  (void)k;
  return false;  // avx512f / avx512bf16 / amx: the tier below (avxvnni or avx2) or avx512vnni runs
#endif
}
