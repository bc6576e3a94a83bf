// mxfp4_x16: gpt-oss mxfp4 experts with 16 rows interleaved per 32-block, for CPUs (docs/formats/mxfp4.md
// "mxfp4_x16"). Banks (slots): 0 gate_up [E, 2I/16, (H/32)*272] u8, 1 gate_up_bias [E, 2I] bf16, 2 down [E, H/16,
// (I/32)*272] u8, 3 down_bias [E, H] bf16. The code banks are ds_fp4_x16's group layout (e2m1_x16.h: per group of
// 16 rows and 32-block, the 16 e8m0 scales then 256 code bytes); gate rows are 0..I-1 and up rows I..2I-1 (mxfp4
// interleaves them by column), and the gate_up bias is in that row order. The same codes, scales and biases as
// mxfp4, moved (cpumoe_formats.repack_mxfp4_x16).
//
// Mode w4a8 only, and bit-identical to mxfp4's w4a8 in every tier: the activation record has mxfp4's int8 codes
// q and scales s_b per 32 (the Q8_0 rule) and corr_b = -12 sum(q_b), per block (x16::BlockToks, 40 bytes); per
// (row, token), from acc = 0, block by block in K order, acc = fma((float)S_b, (e8m0 * 0.5f) * s_b, acc) (mul,
// fma: mxfp4_w8.h's operations), then gate/up = (acc + bias) * w_in and a route's down term (acc + bias) *
// weight (x16.h with Ref::bias, mxfp4's order). Lanes are rows: the per-block fold is paid once per 16 rows and token, and the decode of a block is two
// instructions per 64 weights (mxfp4_panel's w4a8 interleaves each row pair into dwords first).
#include <cstring>

#include "e2m1_x16.h"

namespace cpumoe {
namespace CPUMOE_NS {
namespace {
using namespace fp4;
using e2m1x16::QK;

// mxfp4's w4a8 codes and scales (mxfp4_w8.h prep_act's rule: q8_block32 / q8_block), corr = -12 sum(q).
void prep_x16(const cpumoe_kernel*, const uint16_t* src, int32_t K, void* dst) {
  x16::q8_records<-kW2Offset>(src, K, dst);
}

// mxfp4's fold: the weight factor e8m0 * 0.5 (exact: >= 2^-128), times s_b; the integer times that, added in one
// fma (a mul and an add would be one vector uop more per block and token, 1 in 13 at 8 tokens)
struct Fold {
#if CPUMOE_X16_ZMM
  static CPUMOE_INLINE __m512 scale16(const uint8_t* p) {
    return _mm512_mul_ps(e2m1x16::e8m0x16(p), _mm512_set1_ps(0.5f));
  }
  static CPUMOE_INLINE __m512 fold(__m512 acc, __m512i S, __m512 sw, const float* sb) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), x16::mul_bcast(sw, sb), acc);
  }
#elif CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI
  static CPUMOE_INLINE __m256 scale8(const uint8_t* p) { return _mm256_mul_ps(e8m0x8(load8(p)), _mm256_set1_ps(0.5f)); }
  static CPUMOE_INLINE __m256 fold(__m256 acc, __m256i S, __m256 sw, const float* sb) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(sw, _mm256_set1_ps(*sb)), acc);
  }
#endif
  static CPUMOE_INLINE float scale1(uint8_t s) { return e8m0_to_f32(s) * 0.5f; }
  static CPUMOE_INLINE float fold(float acc, int32_t S, float sw, const float* sb) {
    return std::fma((float)S, sw * *sb, acc);
  }
};

// The layout for x16.h's loops: a group is one code bank row and 16 biases.
struct G16 {
  static constexpr int kMaxNT = e2m1x16::kMaxNT;
  static constexpr int64_t kPf = e2m1x16::kPf;
  static constexpr int kSlot[2] = {0, 2};
  struct Ref {
    const uint8_t* w;
    const uint16_t* bias;  // the group's 16 bf16 biases
  };
  static CPUMOE_INLINE Ref ref(const cpumoe_kernel*, const cpumoe_bank* banks, int mat, int32_t e, int32_t g) {
    const cpumoe_bank& b = banks[2 * mat + 1];
    return {bank_row<uint8_t>(banks[2 * mat], e, g),
            (const uint16_t*)((const char*)b.ptr + (int64_t)e * b.expert_stride) + (int64_t)g * x16::GR};
  }
  template <int G, int NT>
  static CPUMOE_INLINE void groups(const Ref* gp, int K, const void* const* act, float* out) {
    e2m1x16::groups<Fold, G, NT>(gp, K, act, out);
  }
};

}  // namespace
}  // namespace CPUMOE_NS
}  // namespace cpumoe

bool CPUMOE_INIT_FN(mxfp4_x16)(cpumoe_kernel* k) {
  using namespace cpumoe::CPUMOE_NS;
#if CPUMOE_TIER == CPUMOE_T_SCALAR || CPUMOE_TIER == CPUMOE_T_AVX2 || CPUMOE_TIER == CPUMOE_T_AVXVNNI || \
    CPUMOE_X16_ZMM
  return x16::install<G16>(k, CPUMOE_MODE_W4A8, &x16::int8_record_bytes<QK>, &prep_x16);
#else
  (void)k;
  return false;  // avx512f: the tier below (avxvnni or avx2) runs; amx: not built for this format
#endif
}
