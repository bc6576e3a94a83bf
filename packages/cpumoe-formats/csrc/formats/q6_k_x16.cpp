// q6_k_x16: q6_k experts with 16 rows interleaved per 256-block, for CPUs (docs/formats/q6_k.md "q6_k_x16").
// Banks (slots): 0 gate_up [E, 2I/16, (H/256)*3360], 1 down [E, H/16, (I/256)*3360], uint8. A bank row is a group of
// 16 weight rows; per 256-block it holds 3360 bytes, the same 210 bytes per row as q6_k, moved
// (cpumoe_formats.repack_q6_k_x16):
//   [0, 32)      the 16 rows' fp16 d (row r at 2r)
//   [32, 288)    16 planes of 16 bytes: plane j byte r = row r's int8 scale sc[j]
//   [288, 3360)  per half h (elements 128h ..) and code step v = 0..7, at 288 + 1536 h + 192 v, three vectors of 64
//                bytes whose int32 lane r holds row r's A = ql[64h + 4v ..], B = ql[64h + 32 + 4v ..],
//                C = qh[32h + 4v ..] (4 bytes each). The step's four runs, elements 128h + 32g + 4v + i:
//                g = 0: A & 15 | (C & 3) << 4, 1: B & 15 | (C >> 2 & 3) << 4, 2: A >> 4 | (C >> 4 & 3) << 4,
//                3: B >> 4 | (C >> 6) << 4; sub-block j = 8h + 2g + v / 4.
//                The kernels read a block's bytes front to back, each step's 192 bytes once (a lone token's
//                stream is sequential, as q4_k_x16's).
//
// Mode w4a8 (q6_k's default; mode native: q6_k_x16_native.h): each activation 256-block quantized by the Q8_0
// rule (q6_k's codes and d_a).
// Record: per block 324 bytes, q[256], int32 c[16] at 256 with c[j] = -32 * (sum of sub-block j's 16 codes), float d_a
// at 320. Per (row, token), from acc = 0, block by block in K order:
//   S = sum_j sc[j] (c[j] + sum_{i in j} q_i a_i) = sum_j sc[j] sum((q_i - 32) a_i)     (exact int32)
//   acc = fma(float(S), fp32(d) * d_a, acc)
// Bounds: a sub-block's c[j] + sum(q a) is within 16 * 63 * 127 + 32 * 16 * 127 (every partial sum), times |sc| <=
// 128, over 16 sub-blocks: |S| < 2^28. Every tier forms these integers and does these fp32 operations in this order
// (std::fma in scalar): the tiers are bit-identical, and a token's result does not depend on its batch. Lanes are
// rows: a vpdpbusd serves 16 rows (zmm), and the scales and the fold are paid once per 16 rows and token where
// q6_k's row-major kernel pays them per (row, token).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "gguf_x16.h"
#include "gguf_rows.h"
#include "x16_vec.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int QK = 256, GR = x16::GR, GB = 3360, REC = 324;
constexpr int kCodes = 288, kHalf = 1536, kSub = 768, kStepB = 192;  // codes start; a half's, 4 steps', a step's bytes
// tokens per group call: zmm: a sub-half's 16 code vectors, its 4 scale vectors, per token the block sum, beside a
// run's dpbusd chain (32 registers); ymm: per token a chain and the block sum beside the code (16 registers)
constexpr int kMaxNT = CPUMOE_TIER == CPUMOE_T_AVX512VNNI ? 4 : 2;
// Software prefetch distance (bytes ahead in the group's stream): the whole of the next group-block's first
// 3 KB on each step, q4_k_x16's 3072.
#ifndef CPUMOE_Q6KX16_PF
#define CPUMOE_Q6KX16_PF 3072
#endif

// The record of one token: per 256-block q[256], c[16] = -32 * (sum of each 16 codes), d_a; the codes and d_a are
// q6_k's prep's (gguf_rows.h prep_act_i8<256>, run on the block).
void prep_x16(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  alignas(64) int8_t one[QK + 4 + 32];  // a one-block q6_k record: q[256], d_a, bsum[16]
  for (int32_t b = 0; b < K / QK; ++b) {
    gguf::prep_act_i8<QK>(nullptr, src + (size_t)b * QK, QK, one);
    int8_t* rec = (int8_t*)dst + (size_t)b * REC;
    std::memcpy(rec, one, QK);
    for (int j = 0; j < 16; ++j) {
      int16_t bs;
      std::memcpy(&bs, one + QK + 4 + 2 * j, 2);
      const int32_t c = -32 * bs;  // |bs| <= 16 * 127
      std::memcpy(rec + QK + 4 * j, &c, 4);
    }
    std::memcpy(rec + QK + 64, one + QK, 4);
  }
}
size_t act_bytes_x16(const cpumoe_kernel*, int32_t K) { return (size_t)(K / QK) * REC; }

CPUMOE_INLINE const int8_t* rec_of(const void* act, int b) { return (const int8_t*)act + (size_t)b * REC; }
CPUMOE_INLINE const int32_t* corr_of(const int8_t* rec) { return (const int32_t*)(rec + QK); }
CPUMOE_INLINE const float* da_of(const int8_t* rec) { return (const float*)(rec + QK + 64); }

// prefetcht0 of n lines from p + the distance
CPUMOE_INLINE void prefetch_lines(const uint8_t* p, int n) {
  for (int l = 0; l < n; ++l) __builtin_prefetch(p + CPUMOE_Q6KX16_PF + 64 * l, 0, 3);
}

// The group dots for gguf_x16.h's RowG16: zmm (avx512vnni), ymm row halves (avx2 / avxvnni), scalar. kSwPf: the
// software prefetch (x16.h gguf_sw_prefetch; false is built on avx512vnni only).
template <bool kSwPf>
struct Q6KX16 {
  static constexpr int QK = cpumoe::CPUMOE_NS::QK, kMaxNT = cpumoe::CPUMOE_NS::kMaxNT;
  static constexpr int64_t kPf = x16::gguf_pf(kSwPf, CPUMOE_Q6KX16_PF);

#if CPUMOE_TIER == CPUMOE_T_AVX512VNNI
  // G groups x NT tokens, all 16 rows per zmm. Per group-block and sub-half (4 steps): its 16 code vectors built once
  // (per step 3 loads, 2 ands, 5 shifts and 4 vpternlogd selects: q6_k's decode, for 16 rows at once) and its 4
  // scale vectors widened once; per token and run one vpdpbusd chain of 4 from c[j], scaled by sc[j] (vpmulld).
  template <int G, int NT>
  static CPUMOE_INLINE void zmm(const uint8_t* const* w, int nb, const void* const* act, float* out) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m33 = _mm512_set1_epi8(0x33), mcc = _mm512_set1_epi8((char)0xCC);
    auto block = [&](int b, const uint8_t* p, __m512 (&acc)[1][NT]) CPUMOE_LAMBDA_INLINE {
      if constexpr (kPf > 0) prefetch_lines(p, 5);  // d and the scales (and the first codes' half line)
      __m512i S[NT];
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) S[t] = _mm512_setzero_si512();
      CPUMOE_UNROLL
      for (int hs = 0; hs < 4; ++hs) {  // half h = hs / 2, sub-half s = hs % 2: steps 4s .. 4s + 3
        const int h = hs / 2, s = hs % 2;
        const uint8_t* st = p + kCodes + kHalf * h + kSub * s;
        if constexpr (kPf > 0) prefetch_lines(st, kSub / 64);
        __m512i q[4][4];  // [run][step]
        CPUMOE_UNROLL
        for (int v = 0; v < 4; ++v) {
          const __m512i A = _mm512_loadu_si512(st + kStepB * v), B = _mm512_loadu_si512(st + kStepB * v + 64);
          const __m512i C = _mm512_loadu_si512(st + kStepB * v + 128);
          // C & 0x33 (bits 0-1, 4-5) and C & 0xCC (2-3, 6-7), shifted so that the run's two bits land on 4-5
          // and bits 6-7 stay 0 (16-bit shifts: what crosses into the next byte lands on its bits 0-3, which
          // the select takes from the low nibbles); then one vpternlogd (0xE4: m4 ? low nibbles : high bits)
          // a run: 11 ops a step where an & 0x3F after each select took 13
          const __m512i C33 = _mm512_and_si512(C, m33), Ccc = _mm512_and_si512(C, mcc);
          q[0][v] = _mm512_ternarylogic_epi32(A, _mm512_slli_epi16(C33, 4), m4, 0xE4);
          q[1][v] = _mm512_ternarylogic_epi32(B, _mm512_slli_epi16(Ccc, 2), m4, 0xE4);
          q[2][v] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(A, 4), C33, m4, 0xE4);
          q[3][v] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(B, 4), _mm512_srli_epi16(Ccc, 2), m4, 0xE4);
        }
        __m512i sc[4];  // run g's sub-block j = 8h + 2g + s
        CPUMOE_UNROLL
        for (int r = 0; r < 4; ++r)
          sc[r] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 32 + 16 * (8 * h + 2 * r + s))));
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int8_t* rec = rec_of(act[t], b);
          CPUMOE_UNROLL
          for (int r = 0; r < 4; ++r) {
            const int32_t* qa = (const int32_t*)(rec + 128 * h + 32 * r + 16 * s);
            __m512i c = _mm512_set1_epi32(corr_of(rec)[8 * h + 2 * r + s]);
            CPUMOE_UNROLL
            for (int v = 0; v < 4; ++v) c = x16::dpbusd_bcast(c, q[r][v], qa + v);
            S[t] = _mm512_add_epi32(S[t], _mm512_mullo_epi32(c, sc[r]));
          }
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t)
        acc[0][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[t]), x16::mul_bcast(d, da_of(rec_of(act[t], b))), acc[0][t]);
    };
    x16::group_blocks<x16::Zmm, G, NT, 0, 1>(w, nb, GB, out, block);
  }
#endif

#if CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
  // Run r's 4 codes per lane at the step at st, rows 8h..8h+7 (the lanes at +32 h): unsigned 0..63.
  static CPUMOE_INLINE __m256i run_codes(const uint8_t* st, int r, int h) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i L = _mm256_loadu_si256((const __m256i*)(st + 64 * (r & 1) + 32 * h));
    const __m256i C = _mm256_loadu_si256((const __m256i*)(st + 128 + 32 * h));
    const __m256i lo = r < 2 ? _mm256_and_si256(L, m4) : _mm256_and_si256(_mm256_srli_epi16(L, 4), m4);
    const __m256i hi = r == 0   ? _mm256_slli_epi16(C, 4)
                       : r == 1 ? _mm256_slli_epi16(C, 2)
                       : r == 2 ? C
                                : _mm256_srli_epi16(C, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, m30));
  }

  // G groups x NT tokens, rows 8h..8h+7 (h in [H0, H0 + NH)) of each group per ymm. Per run and sub-half: avx2 two
  // vpmaddubsw steps summed in int16 (codes <= 63, |q_a| <= 127: <= 2 * 2 * 63 * 127 = 32004), widened by vpmaddwd
  // with ones and added to c[j]; avxvnni a vpdpbusd chain of 4 from c[j]; then times sc[j] (vpmulld) into the block
  // sum. A lone token takes both row halves per block (G x 2 streams); several one half per pass (q4_k_x16's scheme).
  template <int G, int NT, int H0, int NH>
  static CPUMOE_INLINE void ymm(const uint8_t* const* w, int nb, const void* const* act, float* out) {
    auto block = [&](int b, const uint8_t* p, __m256 (&acc)[NH][NT]) CPUMOE_LAMBDA_INLINE {
      if (H0 == 0) prefetch_lines(p, 5);
      CPUMOE_UNROLL
      for (int hh = 0; hh < NH; ++hh) {
        const int h = H0 + hh;  // the row half
        __m256i S[NT];
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) S[t] = _mm256_setzero_si256();
        for (int hs = 0; hs < 4; ++hs) {  // element half hs / 2, sub-half hs % 2
          const int eh = hs / 2, s = hs % 2;
          const uint8_t* st = p + kCodes + kHalf * eh + kSub * s;
          if (H0 == 0 && hh == 0) prefetch_lines(st, kSub / 64);
          CPUMOE_UNROLL
          for (int r = 0; r < 4; ++r) {
            const int j = 8 * eh + 2 * r + s;
            __m256i c[NT];
            CPUMOE_UNROLL
            for (int t = 0; t < NT; ++t) c[t] = _mm256_set1_epi32(corr_of(rec_of(act[t], b))[j]);
#if CPUMOE_TIER == CPUMOE_T_AVXVNNI
            CPUMOE_UNROLL
            for (int v = 0; v < 4; ++v) {
              const __m256i q = run_codes(st + kStepB * v, r, h);
              CPUMOE_UNROLL
              for (int t = 0; t < NT; ++t) {
                const int8_t* qa = rec_of(act[t], b) + 128 * eh + 32 * r + 16 * s + 4 * v;
                c[t] = _mm256_dpbusd_avx_epi32(c[t], q, x16::bcast4(qa));
              }
            }
#else
            CPUMOE_UNROLL
            for (int v = 0; v < 4; v += 2) {
              const __m256i q0 = run_codes(st + kStepB * v, r, h), q1 = run_codes(st + kStepB * (v + 1), r, h);
              CPUMOE_UNROLL
              for (int t = 0; t < NT; ++t) {
                const int8_t* qa = rec_of(act[t], b) + 128 * eh + 32 * r + 16 * s + 4 * v;
                const __m256i P = _mm256_add_epi16(_mm256_maddubs_epi16(q0, x16::bcast4(qa)),
                                                   _mm256_maddubs_epi16(q1, x16::bcast4(qa + 4)));
                c[t] = _mm256_add_epi32(c[t], _mm256_madd_epi16(P, _mm256_set1_epi16(1)));
              }
            }
#endif
            const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 32 + 16 * j + 8 * h)));
            CPUMOE_UNROLL
            for (int t = 0; t < NT; ++t) S[t] = _mm256_add_epi32(S[t], _mm256_mullo_epi32(c[t], sc));
          }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h)));
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(*da_of(rec_of(act[t], b))));
          acc[hh][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[t]), dd, acc[hh][t]);
        }
      }
    };
    x16::group_blocks<x16::Ymm, G, NT, H0, NH>(w, nb, GB, out, block);
  }
#endif

#if CPUMOE_TIER == CPUMOE_T_SCALAR
  // scalar: the same integers and fp32 operations, row by row
  template <int G, int NT>
  static void scalar(const uint8_t* const* w, int nb, const void* const* act, float* out) {
    auto block = [&](const uint8_t* p, int t, int b, int r, float acc) CPUMOE_LAMBDA_INLINE {
      const int8_t* rec = rec_of(act[t], b);
      int32_t S = 0;
      for (int j = 0; j < 16; ++j) {
        const int h = j / 8, run = j % 8 / 2, s = j % 2;
        int32_t c = corr_of(rec)[j];
        for (int v = 4 * s; v < 4 * s + 4; ++v)
          for (int i = 0; i < 4; ++i) {
            const uint8_t* lane = p + kCodes + kHalf * h + kStepB * v + 4 * r + i;
            const uint8_t lo = lane[64 * (run & 1)], hb = lane[128];
            const int q = (run < 2 ? lo & 15 : lo >> 4) | ((hb >> (2 * run)) & 3) << 4;
            c += q * rec[128 * h + 32 * run + 4 * v + i];
          }
        S += (int8_t)p[32 + 16 * j + r] * c;
      }
      uint16_t dh;
      std::memcpy(&dh, p + 2 * r, 2);
      acc = std::fma((float)S, fp16_to_f32(dh) * *da_of(rec), acc);
      return acc;
    };
    x16::scalar_rows<G, NT>(w, nb, GB, out, block);
  }
#endif
};

#include "q6_k_x16_native.h"  // mode native (Q6KNativeBlock)

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

// w4a8: scalar, avx2, avxvnni, avx512vnni; native: scalar, avx2, avx512f (q6_k's tiers).
bool CPUMOE_INIT_FN(q6_k_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
  return x16::install_native_or_w4a8<Q6KNativeBlock, Q6KX16<true>, Q6KX16<false>>(k, &act_bytes_x16, &prep_x16);
}
