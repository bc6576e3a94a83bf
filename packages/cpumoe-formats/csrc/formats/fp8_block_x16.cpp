// fp8_block_x16: fp8_block experts with 16 rows interleaved per K pair, for CPUs (docs/formats/fp8_block.md
// "fp8_block_x16"). Banks (slots): 0 gate_up [E, 2I/16, H*16] e4m3, 1 gate_up_scale [E, nb(2I), >= nb(H)] bf16,
// 2 down [E, H/16, I*16] e4m3, 3 down_scale [E, nb(H), >= nb(I)] bf16. A code bank row is a group of 16 weight
// rows: per K pair p, 32 bytes, row r's codes 2p and 2p+1 at bytes 2r and 2r+1 (cpumoe_formats.repack_fp8_block_x16).
//
// Mode native (W8A16; x as its exact bf16, the prepared record is the bf16 row itself). Per (row, token), from
// acc = 0, per 128-K block (the last one partial): two chains, c0 over the block's even K pairs and c1 over its
// odd ones, each pair as c = fma(w_odd, x_odd, c) then c = fma(w_even, x_even, c) (vdpbf16ps: the products are
// exact, each step rounds once, subnormal x and results read as zero), then acc = fma(c0 + c1, scale, acc).
// The scalar tier does the same fp32 operations in the same order, so the tiers are bit-identical and a token's
// result does not depend on its batch.
//
// Why: a decoded 64-byte line is 2 vectors of 16 rows' bf16 pairs, and one vdpbf16ps with the token's pair
// broadcast (folded into the instruction) takes 32 products, so each extra token sharing an expert costs one
// instruction per 32 weights; the row-major kernels stream a token's activation vectors through every row.
#include <cfloat>
#include <cmath>
#include <cstring>

#include "../x16.h"
#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
#include "fp8_block_decode.h"
#endif

// Software prefetch distance in each group stream (bytes, one line per 64-byte step).
#ifndef CPUMOE_FP8X16_PF
#define CPUMOE_FP8X16_PF 2048
#endif

namespace cpumoe {
namespace CPUMOE_NS {
namespace {

constexpr int GR = x16::GR, kBlk = 128;

struct G16 {
  static constexpr int kMaxNT = 8;
  static constexpr int64_t kPf = CPUMOE_FP8X16_PF;
  static constexpr int kSlot[2] = {0, 2};
  struct Ref {
    const uint8_t* w;   // the group's codes
    const uint16_t* s;  // its 128-row block's scale row
  };
  static CPUMOE_INLINE Ref ref(const cpumoe_kernel*, const cpumoe_bank* banks, int mat, int32_t e, int32_t g) {
    return {bank_row<uint8_t>(banks[2 * mat], e, g), bank_row<uint16_t>(banks[2 * mat + 1], e, g * GR / kBlk)};
  }
  template <int G, int NT>
  static void groups(const Ref* gp, int K, const void* const* act, float* out);
};

#if CPUMOE_TIER == CPUMOE_T_AVX512BF16
// acc + the 32 products of w's bf16 pairs with the pair at q broadcast, folded into the instruction ({1to16})
CPUMOE_INLINE __m512 dpbf16_bcast(__m512 acc, __m512i w, const int32_t* q) {
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*q));
  return acc;
}

template <int G, int NT>
void G16::groups(const Ref* gp, int K, const void* const* act, float* out) {
  const fp8dec::Decoder d;
  const uint16_t* x[NT];
  CPUMOE_UNROLL
  for (int t = 0; t < NT; ++t) x[t] = (const uint16_t*)act[t];
  for (int i = 0; i < G * NT; ++i) _mm512_storeu_ps(out + i * GR, _mm512_setzero_ps());
  for (int o = 0; o < K; o += kBlk) {
    const int n = K - o < kBlk ? K - o : kBlk;  // a multiple of 16
    __m512 c0[G][NT], c1[G][NT];
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g)
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) c0[g][t] = c1[g][t] = _mm512_setzero_ps();
    for (int k = o; k < o + n; k += 4) {  // one 64-byte line per group: pairs k/2 (-> c0) and k/2 + 1 (-> c1)
      CPUMOE_UNROLL
      for (int g = 0; g < G; ++g) {
        const uint8_t* p = gp[g].w + (size_t)k * GR;
        __builtin_prefetch(p + kPf, 0, 3);
        __m512i w0, w1;
        d.decode(p, 64, w0, w1);
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) {
          const int32_t* xa = (const int32_t*)(x[t] + k);
          c0[g][t] = dpbf16_bcast(c0[g][t], w0, xa);
          c1[g][t] = dpbf16_bcast(c1[g][t], w1, xa + 1);
        }
      }
    }
    CPUMOE_UNROLL
    for (int g = 0; g < G; ++g) {
      const __m512 s = _mm512_set1_ps(bf16_to_f32(gp[g].s[o / kBlk]));
      CPUMOE_UNROLL
      for (int t = 0; t < NT; ++t) {
        float* a = out + (g * NT + t) * GR;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_add_ps(c0[g][t], c1[g][t]), s, _mm512_loadu_ps(a)));
      }
    }
  }
}
#else
// vdpbf16ps' step: the product is exact in fp32, so fma rounds it once as the instruction does; a subnormal
// operand or result is zero there (DAZ, FTZ)
CPUMOE_INLINE float daz(float v) { return std::fabs(v) < FLT_MIN ? std::copysign(0.0f, v) : v; }
CPUMOE_INLINE float dp_step(float w, uint16_t x, float c) { return daz(std::fma(w, daz(bf16_to_f32(x)), daz(c))); }

template <int G, int NT>
void G16::groups(const Ref* gp, int K, const void* const* act, float* out) {
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < NT; ++t) {
      const uint16_t* x = (const uint16_t*)act[t];
      for (int r = 0; r < GR; ++r) {
        float acc = 0.f;
        for (int o = 0; o < K; o += kBlk) {
          const int n = K - o < kBlk ? K - o : kBlk;
          float c[2] = {0.f, 0.f};
          for (int k = o; k < o + n; k += 2) {
            const uint8_t* p = gp[g].w + (size_t)k * GR + 2 * r;
            float& ch = c[((k - o) >> 1) & 1];
            ch = dp_step(e4m3_to_f32(p[1]), x[k + 1], ch);
            ch = dp_step(e4m3_to_f32(p[0]), x[k], ch);
          }
          acc = std::fma(c[0] + c[1], bf16_to_f32(gp[g].s[o / kBlk]), acc);
        }
        out[(g * NT + t) * GR + r] = acc;
      }
    }
}
#endif

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(fp8_block_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX512BF16
  if (k->params.mode != CPUMOE_MODE_NATIVE) return false;
  k->act_bytes = &act_bytes_bf16;
  k->prep_act = &prep_act_bf16;
  k->gate_up = &x16::gate_up<G16>;
  k->down = &x16::down<G16>;
  return true;
#else
  (void)k;
  return false;  // the tiers without vdpbf16ps run scalar (the executor repacks fp8_block only from avx512bf16)
#endif
}
