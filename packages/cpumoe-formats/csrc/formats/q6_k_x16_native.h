// q6_k_x16's native mode (W6A16, q6_k's native): fp32 activations (the bf16 values), per (row, token), from acc = 0,
// block by block in K order and within a block sub-block by sub-block (j = 0..15):
//   s = 0; s = fma(float(q_e - 32), x_e, s) for the sub-block's 16 elements e in order;  acc = fma(s, d * sc[j], acc)
// (d * sc[j] is exact in fp32: 11 and 8 significant bits). Every tier does these operations in this order
// (std::fma in scalar): bit-identical, and a token's result does not depend on its batch. Lanes are rows: per element
// one conversion serves 16 rows (zmm, avx512f) or 8 (ymm, avx2) and each token pays one fma; q6_k's native kernel
// converts each row's codes alone. Q6KNativeBlock is the block decode of x16_vec.h's NativeX16 (the frames over
// groups, tokens and blocks). Included by q6_k_x16.cpp inside its anonymous namespace (QK, GB, kCodes, kHalf, kSub,
// kStepB, prefetch_lines) after x16_vec.h.
#pragma once

struct Q6KNativeBlock : x16::NativeVec {
  static constexpr int QK = cpumoe::CPUMOE_NS::QK, GB = cpumoe::CPUMOE_NS::GB;
  static constexpr int64_t kPf = CPUMOE_Q6KX16_PF;

#if CPUMOE_TIER == CPUMOE_T_AVX512F || CPUMOE_TIER == CPUMOE_T_AVX2
  // (the tier's vector: x16::NativeVec, zmm 16 rows, ymm rows 8 hr .. 8 hr + 7 of the group)
  // Run r's codes at the step at st minus 32, as signed bytes (4 per lane: elements 4v .. 4v + 3 of the run)
  static CPUMOE_INLINE VI run_codes(const uint8_t* st, int r, int hr) {
    const VI L = ld(st + 64 * (r & 1), hr), C = ld(st + 128, hr), m4 = b8(0x0F), m30 = b8(0x30);
    const VI lo = r < 2 ? and_(L, m4) : and_(srl16<4>(L), m4);
    const VI hi = r == 0 ? sll16<4>(C) : r == 1 ? sll16<2>(C) : r == 2 ? C : srl16<2>(C);
    return sub8(or_(lo, and_(hi, m30)), b8(32));
  }
  // byte i of each lane (a signed code) as float
  template <int I>
  static CPUMOE_INLINE VF elem(VI q) {
    return cvt(sra32<24>(I == 3 ? q : sll32<24 - 8 * I>(q)));
  }

  // block b (at p) of a group into acc[hh][t]: rows 8 hr .. (all 16 on zmm), hr = H0 + hh
  template <int NT, int H0, int NH>
  static CPUMOE_INLINE void block(const uint8_t* p, int b, const void* const* act, VF (&acc)[NH][NT]) {
    if (H0 == 0) prefetch_lines(p, 5);
    CPUMOE_UNROLL
    for (int hh = 0; hh < NH; ++hh) {
      const int hr = H0 + hh;
      const VF d = d_of(p, hr);
      for (int j = 0; j < 16; ++j) {  // sub-block j: half j / 8, run j % 8 / 2, steps 4 (j % 2) ..
        const int eh = j / 8, r = j % 8 / 2, s = j % 2;
        const uint8_t* st = p + kCodes + kHalf * eh + kSub * s;
        if (H0 == 0 && hh == 0 && r == 0) prefetch_lines(st, kSub / 64);
        VF sum[NT];
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) sum[t] = zero();
        CPUMOE_UNROLL
        for (int v = 0; v < 4; ++v) {
          const VI q = run_codes(st + kStepB * v, r, hr);
          const VF e[4] = {elem<0>(q), elem<1>(q), elem<2>(q), elem<3>(q)};
          CPUMOE_UNROLL
          for (int t = 0; t < NT; ++t) {
            const float* x = (const float*)act[t] + (size_t)b * QK + 16 * j + 4 * v;
            CPUMOE_UNROLL
            for (int i = 0; i < 4; ++i) sum[t] = fma(e[i], set1(x[i]), sum[t]);
          }
        }
        const VF ds = mul(d, sc_of(p + 32 + 16 * j, hr));
        CPUMOE_UNROLL
        for (int t = 0; t < NT; ++t) acc[hh][t] = fma(sum[t], ds, acc[hh][t]);
      }
    }
  }
#endif

  // scalar: the same fp32 operations, row by row
  static CPUMOE_INLINE float scalar(const uint8_t* p, const float* x, int row, float acc) {
    uint16_t dh;
    std::memcpy(&dh, p + 2 * row, 2);
    const float d = fp16_to_f32(dh);
    for (int j = 0; j < 16; ++j) {
      const int eh = j / 8, r = j % 8 / 2, s = j % 2;
      float sum = 0.f;
      for (int i = 0; i < 16; ++i) {
        const uint8_t* lane = p + kCodes + kHalf * eh + kSub * s + kStepB * (i / 4) + 4 * row + i % 4;
        const uint8_t lo = lane[64 * (r & 1)], hb = lane[128];
        const int q = (r < 2 ? lo & 15 : lo >> 4) | ((hb >> (2 * r)) & 3) << 4;
        sum = std::fma((float)(q - 32), x[16 * j + i], sum);
      }
      acc = std::fma(sum, d * (float)(int8_t)p[32 + 16 * j + row], acc);
    }
    return acc;
  }
};
