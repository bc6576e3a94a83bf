// ds_fp4_x16: ds_fp4 experts with 16 rows interleaved per 32-block, for CPUs (docs/formats/ds_fp4.md "ds_fp4_x16").
// Banks (slots): 0 gate_up [E, 2I/16, (H/32)*272], 1 down [E, H/16, (I/32)*272], uint8. A bank row is a group of
// 16 weight rows; per 32-block it holds 272 bytes: the 16 rows' e8m0 scales (row r at byte r), then 4 x 64 code
// bytes, vector j's int32 lane r = row r's codes of elements 4j..4j+3 in the low nibbles and 16+4j..16+4j+3 in the
// high ones (byte i of the lane: elements 4j+i and 16+4j+i). The same 17 bytes per row and block as ds_fp4 (16
// packed bytes, 1 scale), moved (cpumoe_formats.repack_ds_fp4_x16; ds_fp4 pairs elements 2i, 2i+1 in a byte).
//
// Mode w4a8 only: the activation goes through ds_fp4's prep (ds_fp4_act.h: the FP8 round trip per 128, then the
// Q8_0 rule per 32: the same codes q and 0.5 s_b as ds_fp4's w4a8). Record (x16::BlockToks): per block 40
// bytes, int8 q[32] (element order), fp32 hs = 0.5 s_b, int32 corr = -12 sum(q_b). Weights enter the integer
// dots as u = 2 E2M1 + 12 in [0, 24] (vpshufb of the nibble), so per (row, block) the exact
//   S_b = corr_b + sum(u q) = sum(2 E2M1 q)      (|S_b| <= 32 * 12 * 127)
// and per (row, token), from acc = 0, block by block in K order:
//   acc = fma((float)S_b * hs_b, 2^(min(s,254) - 127), acc)      (s = 0: 2^-127, exact)
// The e8m0 factor comes last, as in ds_fp4 (hs_b * 2^-127 could be an fp32 subnormal). The integer is exact and
// every tier does these fp32 operations in this order (std::fma in scalar), so the tiers are bit-identical and a
// token's result does not depend on its batch. Not bit-identical to ds_fp4, whose kernels add per-8-element lane
// sums (SIMD) or sum blocks unfused (scalar). Lanes are rows: the per-block fold (cvt, scale, fma) is paid once
// per 16 rows and token, not once per (row, token) as in ds_fp4's row-major kernels.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "ds_fp4_act.h"
#include "e2m1_x16.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
using namespace fp4;
using namespace dsfp4;
using e2m1x16::QK;

void prep_x16(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  constexpr int RS = x16::BlockToks<1, QK>::kStride;
  for (int32_t b0 = 0; b0 < K; b0 += 128) {
    int8_t* rec = (int8_t*)dst + (size_t)(b0 / QK) * RS;  // the 128 elements' 4 block records
    float hs[4];
#if defined(__AVX2__)
    __m256i v[4];
    quant_w8_128_simd(src + b0, v, hs);  // quant_w8_128's codes and 0.5 s_b, bit for bit
    for (int j = 0; j < 4; ++j) {
      _mm256_storeu_si256((__m256i*)(rec + RS * j), v[j]);
      x16::put_block_tail(rec + RS * j + QK, hs[j], -kW2Offset * hsum8_i32(sum4_i8(v[j])));
    }
#else
    int8_t q[128];
    quant_w8_128(src + b0, q, hs);
    for (int j = 0; j < 4; ++j) {
      int32_t s = 0;
      for (int i = 0; i < QK; ++i) s += q[QK * j + i];
      std::memcpy(rec + RS * j, q + QK * j, QK);
      x16::put_block_tail(rec + RS * j + QK, hs[j], -kW2Offset * s);
    }
#endif
  }
}

// ds_fp4's fold: acc = fma((float)S * hs_b, 2^(s - 127), acc), the e8m0 factor last (hs_b * 2^-127 could be an
// fp32 subnormal).
struct Fold {
#if CPUMOE_X16_ZMM
  static CPUMOE_INLINE __m512 scale16(const uint8_t* p) { return e2m1x16::e8m0x16(p); }
  static CPUMOE_INLINE __m512 fold(__m512 acc, __m512i S, __m512 sw, const float* hs) {
    return _mm512_fmadd_ps(x16::mul_bcast(_mm512_cvtepi32_ps(S), hs), sw, acc);
  }
#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
  static CPUMOE_INLINE __m256 scale8(const uint8_t* p) { return e8m0x8(load8(p)); }
  static CPUMOE_INLINE __m256 fold(__m256 acc, __m256i S, __m256 sw, const float* hs) {
    return _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S), _mm256_set1_ps(*hs)), sw, acc);
  }
#endif
  static CPUMOE_INLINE float scale1(uint8_t s) { return e8m0_to_f32(s); }
  static CPUMOE_INLINE float fold(float acc, int32_t S, float sw, const float* hs) {
    return std::fma((float)S * *hs, sw, acc);
  }
};

// The layout for x16.h's loops: a group is one bank row.
struct G16 {
  static constexpr int kMaxNT = e2m1x16::kMaxNT;
  static constexpr int64_t kPf = e2m1x16::kPf;
  static constexpr int kSlot[2] = {0, 1};
  static constexpr bool kRoundGateUp = true, kRoundRouteTerm = true;  // ds_fp4's bf16 roundings
  struct Ref {
    const uint8_t* w;
  };
  static CPUMOE_INLINE Ref ref(const cpumoe_kernel*, const cpumoe_bank* banks, int mat, int32_t e, int32_t g) {
    return {bank_row<uint8_t>(banks[mat], e, g)};
  }
  template <int G, int NT>
  static CPUMOE_INLINE void groups(const Ref* gp, int K, const void* const* act, float* out) {
    e2m1x16::groups<Fold, G, NT>(gp, K, act, out);
  }
};

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(ds_fp4_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || \
    CPUMOE_X16_ZMM
  return x16::install<G16>(k, CPUMOE_MODE_W4A8, &x16::int8_record_bytes<QK>, &prep_x16);
#else
  (void)k;
  return false;  // avx512f: the tier below (avxvnni or avx2) runs; amx: not built for this format
#endif
}
